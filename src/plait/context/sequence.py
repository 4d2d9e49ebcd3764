"""Where each token of a sequence lives over the cp ranks, and moving tensors there and back.

Two layouts of a sequence of ``T`` tokens over ``cp`` ranks:

* plain: ``cp`` equal chunks, rank ``r`` holds chunk ``r``;
* load-balanced (the default, as torch's head-tail balancer): ``2 * cp`` equal chunks,
  rank ``r`` holds chunk ``r`` then chunk ``2 * cp - 1 - r``. Under a causal mask a token
  attends to the tokens before it, so early chunks have little work and late ones much:
  pairing them gives every rank the same work.

A rank's local tensor is its chunks concatenated in that order. Attention is exact in
either layout because masks are built from the *global* positions of the tokens
(:meth:`SequenceLayout.positions`), never from local indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.context.collectives import CPMesh, cp_group, gather_sequence

__all__ = [
    "SequenceLayout",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]


@dataclass(frozen=True)
class SequenceLayout:
    """A sequence split over ``cp`` ranks, plain or load-balanced (see the module doc)."""

    cp: int
    load_balance: bool = True

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.load_balance else 1

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The chunk indices rank ``rank`` holds, in its local order."""
        if self.load_balance:
            return (rank, 2 * self.cp - 1 - rank)
        return (rank,)

    def check_global(self, seq_len: int, what: str = "the sequence") -> None:
        """``ValueError`` unless a sequence of ``seq_len`` tokens splits into equal chunks."""
        parts = self.cp * self.chunks_per_rank
        if seq_len % parts:
            raise ValueError(self._uneven(f"{what} has {seq_len} tokens", parts))

    def check_local(self, local_len: int, what: str = "the local sequence") -> None:
        """``ValueError`` unless a rank's ``local_len`` tokens are whole chunks."""
        if local_len % self.chunks_per_rank:
            seq_len = local_len * self.cp
            raise ValueError(
                self._uneven(
                    f"{what} has {local_len} tokens per rank ({seq_len} over cp={self.cp})",
                    self.cp * self.chunks_per_rank,
                )
            )

    def _uneven(self, has: str, parts: int) -> str:
        if self.load_balance:
            return (
                f"context parallelism: {has}, not a multiple of 2 * cp = {parts}: the "
                f"load-balanced layout cuts it into {parts} equal chunks. Pad the sequence "
                f"to a multiple of {parts}, or pass load_balance=False (then a multiple of "
                f"cp = {self.cp} will do)"
            )
        return (
            f"context parallelism: {has}, not a multiple of cp = {parts}: each rank must "
            f"hold an equal part. Pad the sequence to a multiple of {parts}"
        )

    def positions(
        self, rank: int, local_len: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """The global positions ``(local_len,)`` of rank ``rank``'s tokens, in local order."""
        self.check_local(local_len)
        size = local_len // self.chunks_per_rank
        return torch.cat(
            [torch.arange(c * size, (c + 1) * size, device=device) for c in self.chunks(rank)]
        )

    def span(self, rank: int, local_len: int) -> tuple[int, int]:
        """The first and last global position rank ``rank`` holds (host integers: used to
        skip blocks a causal mask hides entirely, without a device sync)."""
        size = local_len // self.chunks_per_rank
        chunks = self.chunks(rank)
        return min(chunks) * size, (max(chunks) + 1) * size - 1

    def gathered_positions(
        self, local_len: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """The global positions ``(cp * local_len,)`` of every rank's tokens concatenated in
        rank order, which is what a gather along the sequence yields."""
        return torch.cat([self.positions(r, local_len, device) for r in range(self.cp)])

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s part of the whole sequence ``x`` (sequence along ``dim``)."""
        self.check_global(x.shape[dim])
        pieces = x.chunk(self.cp * self.chunks_per_rank, dim)
        return torch.cat([pieces[c] for c in self.chunks(rank)], dim)

    def restore(self, gathered: torch.Tensor, dim: int) -> torch.Tensor:
        """The natural order of ``gathered`` (every rank's part in rank order along ``dim``)."""
        if not self.load_balance:
            return gathered  # chunks already arrive in order
        local_len = gathered.shape[dim] // self.cp
        order = torch.argsort(self.gathered_positions(local_len, gathered.device))
        return gathered.index_select(dim, order)


def _layout(mesh: CPMesh, load_balance: bool) -> tuple[SequenceLayout, dist.ProcessGroup]:
    group = cp_group(mesh)
    return SequenceLayout(dist.get_world_size(group), load_balance), group


def shard_sequence(
    x: torch.Tensor, mesh: CPMesh, dim: int = 1, *, load_balance: bool = True
) -> torch.Tensor:
    """This rank's part of ``x``, a whole sequence along ``dim`` (a new tensor; autograd
    flows back into ``x``). ``ValueError`` if the length does not split evenly."""
    layout, group = _layout(mesh, load_balance)
    return layout.shard(x, dim % x.ndim, dist.get_rank(group))


@torch.no_grad()
def unshard_sequence(
    x: torch.Tensor, mesh: CPMesh, dim: int = 1, *, load_balance: bool = True
) -> torch.Tensor:
    """The whole sequence, in natural order, from every rank's part ``x`` along ``dim``
    (a collective: every cp rank calls it). Not differentiable, as torch's."""
    layout, group = _layout(mesh, load_balance)
    dim = dim % x.ndim
    layout.check_local(x.shape[dim])
    return layout.restore(gather_sequence(x.detach(), dim, group), dim)


def sequence_positions(
    seq_len: int,
    mesh: CPMesh,
    *,
    load_balance: bool = True,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The global positions ``(seq_len // cp,)`` of this rank's tokens of a sequence of
    ``seq_len`` (e.g. for rotary embeddings computed per rank)."""
    layout, group = _layout(mesh, load_balance)
    layout.check_global(seq_len)
    return layout.positions(dist.get_rank(group), seq_len // layout.cp, device)
