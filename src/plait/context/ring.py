"""Ring attention: key/value blocks travel around the ring of cp ranks; each rank attends
its queries to every block as it passes and merges the partial results exactly (online
softmax over the blocks' log-sum-exps, :mod:`plait.context.blocks`).

Forward: ``cp - 1`` shifts of the stacked keys and values, each started before the
current block is computed so that communication overlaps compute. Each rank's queries
over one arriving key block are planned chunk by chunk on the host
(:func:`plait.context.blocks.plan_blocks`): blocks that causality or documents hide are
skipped, fully visible ones and the causal diagonal run SDPA's fused kernel (which returns
the log-sum-exp), and only blocks that documents cut take the explicit, masked path.

Backward is custom, not autograd through the blocks (which would keep every block alive
and pass each block's gradient back through its own chain of shifts): the key/value
blocks go round the ring again, and with each travels the accumulator of its own
gradient; every rank adds its queries' share (flash attention's block backward, from the
saved merged output and log-sum-exp, by the fused backward kernel) and passes both on.
After ``cp`` shifts of the accumulators each block's complete gradient is back on the rank
that holds it. Saved between forward and backward: the local q, k, v, output and
log-sum-exp only; nothing score-sized is ever alive (masked blocks aside), so memory per
rank is linear in the local length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.context.blocks import (
    Block,
    ChunkDocs,
    accumulate_dtype,
    attend_blocks,
    blocks_backward,
    expand_heads,
    plan_blocks,
    planned,
)
from plait.context.collectives import gather_sequence, ring_shift
from plait.context.sequence import SequenceLayout

__all__ = ["ring_attention"]

_KV_TAG, _GRAD_TAG = 0, 1  # the two shifts of a backward step are in flight together


@dataclass(frozen=True)
class _Ring:
    """What every step needs: who this rank is, and the blocks of this rank's queries
    over each rank's keys (planned once, on the host, from the layout and documents)."""

    group: dist.ProcessGroup
    layout: SequenceLayout
    rank: int
    scale: float
    plans: tuple[tuple[Block, ...], ...]  # by source rank; empty: hidden entirely

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
        acc = accumulate_dtype(q.dtype)
        out = q.new_zeros((*q.shape[:3], v.shape[-1]), dtype=acc)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=acc)
        for step in ring.steps():
            works: list[dist.Work] = []
            if step < last:
                incoming, works = ring_shift(kv, ring.group, "plait.context.ring", _KV_TAG)
            plan = ring.plans[ring.source(step)]
            if plan:
                k_b, v_b = expand_heads(kv[0], heads), expand_heads(kv[1], heads)
                attend_blocks(out, lse, q, k_b, v_b, plan, ring.scale)
            if step < last:
                _wait(works)
                kv = incoming
        result = out.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        heads, last = q.shape[1], ring.layout.cp - 1
        acc = accumulate_dtype(q.dtype)
        dq = torch.zeros_like(q, dtype=acc)
        kv = torch.stack([k, v])
        # This rank's share of the held block's gradient is computed while that block's
        # accumulator is still on its way from the previous rank (its shift overlaps the
        # compute), then added to it and sent on.
        share = torch.zeros_like(kv, dtype=acc)
        dkv = torch.zeros_like(kv, dtype=acc)  # at step 0 the block is this rank's own
        next_dkv = dkv
        grad_works: list[dist.Work] = []  # nothing in flight before the first step
        for step in ring.steps():
            kv_works: list[dist.Work] = []
            if step < last:
                next_kv, kv_works = ring_shift(kv, ring.group, "plait.context.ring", _KV_TAG)
            plan = ring.plans[ring.source(step)]
            if plan:
                k_b, v_b = expand_heads(kv[0], heads), expand_heads(kv[1], heads)
                share.zero_()
                dk, dv = share.unbind(0)  # views: the sums land in share
                blocks_backward(dq, dk, dv, dout, q, k_b, v_b, out, lse, plan, ring.scale)
            if grad_works:  # the accumulator of the block held now has arrived
                _wait(grad_works)
                dkv = next_dkv
            if plan:
                dkv += share
            # The accumulator follows its block; the last shift brings it home.
            next_dkv, grad_works = ring_shift(dkv, ring.group, "plait.context.ring", _GRAD_TAG)
            if step < last:
                _wait(kv_works)
                kv = next_kv
        _wait(grad_works)
        dkv = next_dkv
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
    chunk_len, rank = local_len // layout.chunks_per_rank, dist.get_rank(group)

    def plan() -> tuple[tuple[Block, ...], ...]:
        chunk_docs = None
        if docs is not None:
            gathered = layout.restore(gather_sequence(docs, 1, group), 1)
            chunk_docs = ChunkDocs.of(gathered, chunk_len)
        mine = layout.chunks(rank)
        return tuple(
            tuple(plan_blocks(mine, layout.chunks(s), chunk_len, is_causal, chunk_docs, q.device))
            for s in range(layout.cp)
        )

    key = ("ring", group, layout, chunk_len, is_causal, q.device)
    plans = planned(docs, key, plan)
    ring = _Ring(group, layout, rank, scale, plans)
    out: torch.Tensor = _RingAttention.apply(q, k, v, ring)
    return out
