"""All-to-all (Ulysses) attention: trade the sequence split for a head split, attend
ordinary full-sequence attention over ``H / cp`` heads, and trade back.

After the exchange the sequence is put in natural order, so that a causal mask is SDPA's
own ``is_causal`` (no mask tensor; the output is put back in the layout's order after);
with packed documents the whole sequence runs as fused blocks merged by log-sum-exp
(:func:`plait.context.blocks.blocked_attention`), masked only where documents cut a block.

Backward: autograd through SDPA (or the blocks' own backward), the reorders and the
all-to-alls, each of which has the other as its backward. Needs the number of heads to
divide by cp; key/value heads that do not (grouped-query attention with few of them) are
expanded to the query heads before the exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.context.blocks import (
    Block,
    ChunkDocs,
    blocked_attention,
    expand_heads,
    plan_blocks,
    planned,
)
from plait.context.collectives import gather_sequence, heads_to_sequence, sequence_to_heads
from plait.context.sequence import SequenceLayout

__all__ = ["check_heads", "ulysses_attention"]


def check_heads(heads: int, cp: int) -> None:
    """``ValueError`` unless ``heads`` query heads split over ``cp`` ranks."""
    if heads % cp:
        raise ValueError(
            f'context parallelism with method="alltoall" splits the {heads} attention heads '
            f"over cp={cp} ranks, but {heads} is not a multiple of {cp}: use "
            'method="allgather" or "ring", or a cp that divides the number of heads'
        )


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    layout: SequenceLayout,
    is_causal: bool,
    docs: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Exact attention of local ``q`` ``(B, H, Tl, D)`` over the whole sequence's ``k``,
    ``v`` ``(B, Hkv, Tl, D)``; ``docs`` ``(B, Tl)`` this rank's document ids or None."""
    heads, cp = q.shape[1], layout.cp
    check_heads(heads, cp)
    if k.shape[1] % cp:
        k, v = expand_heads(k, heads), expand_heads(v, heads)
    if k.shape[1] == heads:  # one exchange for all three
        q_h, k_h, v_h = sequence_to_heads(torch.stack([q, k, v]), group).unbind(0)
    else:
        q_h = sequence_to_heads(q, group)
        k_h, v_h = sequence_to_heads(torch.stack([k, v]), group).unbind(0)
    # (B, H/cp, T, D), the sequence in rank order: the gathered layout.
    k_h, v_h = expand_heads(k_h, q_h.shape[1]), expand_heads(v_h, q_h.shape[1])
    if docs is None and not (is_causal and layout.load_balance):
        # No mask, or the plain layout (gathered in natural order): SDPA's own rule.
        out = F.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=is_causal, scale=scale)
        return heads_to_sequence(out, group)
    # Natural order, where causality is SDPA's is_causal (no mask) and a plan's chunk c is
    # rows c * chunk_len; the output goes back to the gathered layout after.
    q_h, k_h, v_h = (layout.restore(t, 2) for t in (q_h, k_h, v_h))
    if docs is None:
        out = F.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=True, scale=scale)
    else:
        chunk_len = q.shape[2] // layout.chunks_per_rank

        def plan() -> list[Block]:
            gathered = layout.restore(gather_sequence(docs, 1, group), 1)
            chunks = range(layout.cp * layout.chunks_per_rank)
            chunk_docs = ChunkDocs.of(gathered, chunk_len)
            return plan_blocks(chunks, chunks, chunk_len, is_causal, chunk_docs, q.device)

        key = ("ulysses", group, layout, chunk_len, is_causal, q.device)
        out = blocked_attention(q_h, k_h, v_h, planned(docs, key, plan), scale)
    if layout.load_balance:
        out = out.index_select(2, layout.gathered_positions(q.shape[2], out.device))
    return heads_to_sequence(out, group)
