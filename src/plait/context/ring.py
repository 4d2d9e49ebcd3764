"""Ring attention: key/value blocks travel around the ring of cp ranks; each rank attends
its queries to every block as it passes and merges the partial results exactly (online
softmax over the blocks' log-sum-exps, :mod:`plait.context.blocks`).

Forward: ``cp - 1`` shifts of the stacked keys and values, each started before the
current block is computed so that communication overlaps compute. Blocks that a causal
mask hides entirely (known from the layout, on the host) are skipped.

Backward is custom, not autograd through the blocks (which would keep every block alive
and pass each block's gradient back through its own chain of shifts): the key/value
blocks go round the ring again, and with each travels the accumulator of its own
gradient; every rank adds its queries' share (flash attention's block backward, from the
saved merged output and log-sum-exp) and passes both on. After ``cp`` shifts of the
accumulators each block's complete gradient is back on the rank that holds it. Saved
between forward and backward: the local q, k, v, output and log-sum-exp only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.context.blocks import (
    accumulate_dtype,
    block_attention,
    block_grads,
    expand_heads,
    fold_heads,
    merge,
)
from plait.context.collectives import gather_sequence, ring_shift
from plait.context.masks import allowed
from plait.context.sequence import SequenceLayout

__all__ = ["ring_attention"]

_KV_TAG, _GRAD_TAG = 0, 1  # the two shifts of a backward step are in flight together


@dataclass(frozen=True)
class _Ring:
    """What every step needs: who this rank is, the layout, and the mask's inputs."""

    group: dist.ProcessGroup
    layout: SequenceLayout
    rank: int
    local_len: int
    is_causal: bool
    scale: float
    docs: torch.Tensor | None  # (B, Tl) this rank's document ids
    all_docs: torch.Tensor | None  # (B, cp * Tl) every rank's, in rank order

    def hidden(self, source: int) -> bool:
        """True when a causal mask hides all of rank ``source``'s keys from every query
        here (with documents too: they only hide more)."""
        if not self.is_causal:
            return False
        first_key, _ = self.layout.span(source, self.local_len)
        _, last_query = self.layout.span(self.rank, self.local_len)
        return first_key > last_query

    def mask(self, source: int, device: torch.device) -> torch.Tensor | None:
        q_pos = self.layout.positions(self.rank, self.local_len, device)
        k_pos = self.layout.positions(source, self.local_len, device)
        k_docs = None
        if self.all_docs is not None:
            k_docs = self.all_docs[:, source * self.local_len : (source + 1) * self.local_len]
        return allowed(q_pos, k_pos, self.is_causal, self.docs, k_docs)

    def steps(self) -> range:
        return range(self.layout.cp)

    def source(self, step: int) -> int:
        """Whose keys this rank holds at ``step`` (they move one rank on per step)."""
        return (self.rank - step) % self.layout.cp


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring
    ) -> torch.Tensor:
        heads, last = q.shape[1], ring.layout.cp - 1
        kv = torch.stack([k, v])  # (2, B, Hkv, Tl, D): one message per step
        out: torch.Tensor | None = None
        lse: torch.Tensor | None = None
        for step in ring.steps():
            works: list[dist.Work] = []
            if step < last:
                incoming, works = ring_shift(kv, ring.group, "plait.context.ring", _KV_TAG)
            source = ring.source(step)
            if not ring.hidden(source):
                mask = ring.mask(source, q.device)
                k_b, v_b = expand_heads(kv[0], heads), expand_heads(kv[1], heads)
                out, lse = merge(out, lse, *block_attention(q, k_b, v_b, mask, ring.scale))
            if step < last:
                _wait(works)
                kv = incoming
        assert out is not None and lse is not None  # a rank's own block is never hidden
        result = out.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        heads, kv_heads, last = q.shape[1], k.shape[1], ring.layout.cp - 1
        acc = accumulate_dtype(q.dtype)
        dout = dout.contiguous()
        delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, H, Tl)
        dq = torch.zeros_like(q, dtype=acc)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv, dtype=acc)  # the gradient of the block held now
        for step in ring.steps():
            kv_works: list[dist.Work] = []
            if step < last:
                next_kv, kv_works = ring_shift(kv, ring.group, "plait.context.ring", _KV_TAG)
            source = ring.source(step)
            if not ring.hidden(source):
                mask = ring.mask(source, q.device)
                k_b, v_b = expand_heads(kv[0], heads), expand_heads(kv[1], heads)
                dq_b, dk_b, dv_b = block_grads(q, k_b, v_b, mask, ring.scale, dout, lse, delta)
                dq += dq_b
                dkv[0] += fold_heads(dk_b, kv_heads)
                dkv[1] += fold_heads(dv_b, kv_heads)
            # The accumulator follows its block; the last shift brings it home.
            next_dkv, grad_works = ring_shift(dkv, ring.group, "plait.context.ring", _GRAD_TAG)
            _wait(grad_works)
            dkv = next_dkv
            if step < last:
                _wait(kv_works)
                kv = next_kv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    layout: SequenceLayout,
    is_causal: bool,
    docs: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Exact attention of local ``q`` ``(B, H, Tl, D)`` over every rank's ``k``, ``v``
    ``(B, Hkv, Tl, D)`` passed round the ring; ``docs`` ``(B, Tl)`` this rank's document
    ids or None (gathered once up front: they are small and needed by every step)."""
    local_len = q.shape[2]
    layout.check_local(local_len)
    all_docs = None if docs is None else gather_sequence(docs, 1, group)
    ring = _Ring(group, layout, dist.get_rank(group), local_len, is_causal, scale, docs, all_docs)
    out: torch.Tensor = _RingAttention.apply(q, k, v, ring)
    return out
