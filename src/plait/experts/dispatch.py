"""Token dispatch and combine: rows travel to the rank that holds their expert, and back.

A rank starts with its rows sorted by global expert (``counts[e]`` rows for expert ``e``).
With ``ep`` ranks each holding ``L = E / ep`` consecutive experts, rank ``j``'s experts'
rows are one contiguous run, so:

1. **Plan** (:func:`plan_exchange`): an all-to-all of the counts tells each rank how many
   rows every peer has for each of its local experts (``blocks[i][l]``: from rank ``i``
   for local expert ``l``), hence how many rows to send to and receive from each peer.
   One device-to-host read for both: split sizes are data-dependent in dropless routing.
2. **Dispatch** (:func:`dispatch`): one uneven all-to-all of the rows. They arrive
   rank-major (all of rank 0's, then rank 1's, ...); a regroup makes them expert-major
   (local expert 0's rows from every rank, in rank order, then expert 1's, ...).
3. The experts compute on their contiguous blocks.
4. **Combine** (:func:`combine`): the regroup undone, then the reverse all-to-all: every
   rank gets its own rows back, in the order it sent them.

Why this is exact: the ep ranks hold consecutive pieces of the batch, so "rows from rank
0, then rank 1, ..." is the global batch order. Each expert therefore multiplies the very
rows, in the very order, that one process running the whole batch gives it, and its weight
gradient is the same sum. Regrouping is ``split`` + ``cat`` (no arithmetic), and the
all-to-all's backward is the reverse all-to-all (``plait.experts.all_to_all``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.experts.all_to_all import all_to_all, exchange_counts
from plait.experts.counts import host_counts_together

__all__ = ["Exchange", "combine", "dispatch", "plan_exchange", "regroup"]


@dataclass(frozen=True)
class Exchange:
    """How one forward's rows travel between the ep ranks of ``group``."""

    group: dist.ProcessGroup
    send: list[int]  # (ep,) rows this rank sends to each rank
    recv: list[int]  # (ep,) rows this rank receives from each rank
    blocks: list[list[int]]  # (ep, L) rows from rank i for local expert l

    @property
    def local_counts(self) -> list[int]:
        """Rows per local expert, from all ranks together."""
        return [sum(column) for column in zip(*self.blocks, strict=True)]


def plan_exchange(counts: torch.Tensor, group: dist.ProcessGroup, rows: int) -> Exchange:
    """The exchange for this rank's ``rows`` expert-sorted rows, ``counts`` ``(E,)`` per
    global expert.

    A collective over ``group``: every rank calls it with its own counts.
    """
    ep = dist.get_world_size(group)
    received = exchange_counts(counts, group)  # (ep, L)
    mine = counts.view(ep, -1)  # (ep, L) this rank's rows for rank j's experts
    # What arrives: as many rows as leave when every rank sends alike (balanced_counts);
    # otherwise the received counts themselves. Both read in one transfer.
    send, flat = host_counts_together((mine.sum(dim=1), rows), (received, rows))
    local = received.shape[1]
    blocks = [flat[i * local : (i + 1) * local] for i in range(ep)]
    return Exchange(group=group, send=send, recv=[sum(row) for row in blocks], blocks=blocks)


def regroup(rows: torch.Tensor, blocks: list[list[int]]) -> torch.Tensor:
    """``rows`` made of blocks of ``blocks[i][j]`` rows in ``(i, j)`` order, returned in
    ``(j, i)`` order (a transpose of the block grid; rows inside a block keep their order)."""
    outer, inner = len(blocks), len(blocks[0])
    pieces = rows.split([n for row in blocks for n in row])
    return torch.cat([pieces[i * inner + j] for j in range(inner) for i in range(outer)])


def _transposed(blocks: list[list[int]]) -> list[list[int]]:
    return [list(column) for column in zip(*blocks, strict=True)]


def dispatch(rows: torch.Tensor, exchange: Exchange) -> tuple[torch.Tensor, torch.Tensor]:
    """Send expert-sorted ``rows`` ``(n, dim)`` to their experts' ranks. Returns this
    rank's rows ``(m, dim)`` grouped by local expert, and their counts ``(L,)``."""
    arrived = all_to_all(rows, exchange.send, exchange.recv, exchange.group, "experts.dispatch")
    local = regroup(arrived, exchange.blocks)  # (m, dim) expert-major
    counts = torch.tensor(exchange.local_counts, dtype=torch.int64, device=rows.device)
    return local, counts


def combine(out: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """The experts' outputs ``(m, dim)`` (as :func:`dispatch` grouped them) back to the
    ranks their rows came from: ``(n, dim)`` in the order they were sent."""
    rank_major = regroup(out, _transposed(exchange.blocks))  # (m, dim)
    return all_to_all(rank_major, exchange.recv, exchange.send, exchange.group, "experts.combine")
