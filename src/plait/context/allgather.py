"""All-gather attention: every rank gathers the whole sequence's keys and values and
attends its own queries to them.

After the gather the keys and values are put in natural order, and each local query
chunk attends to the keys it can see as fused blocks merged by log-sum-exp
(:func:`plait.context.blocks.plan_blocks`): under a causal mask the prefix before the
chunk as one unmasked block plus the chunk's own keys as the causal diagonal block (the
keys after it are skipped, not masked), otherwise all keys unmasked; only blocks that
packed documents cut take a block-sized mask. No ``(T / cp) x T`` mask is ever built.

Backward: the blocks' own (:func:`plait.context.blocks.blocked_attention`, fused backward
kernels from the saved output and log-sum-exp), then autograd through the reorder and the
gather, whose backward is a reduce-scatter that sums every rank's gradient of each
key/value slice back onto the rank that holds it. Memory per rank holds the whole
sequence's keys and values (and their gradients in backward), nothing score-sized;
communication is one all-gather of them (keys and values stacked, one collective) forward
and one reduce-scatter backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.context.blocks import (
    Block,
    ChunkDocs,
    blocked_attention,
    expand_heads,
    plan_blocks,
    planned,
)
from plait.context.collectives import gather_sequence
from plait.context.sequence import SequenceLayout

__all__ = ["allgather_attention"]


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    layout: SequenceLayout,
    is_causal: bool,
    docs: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Exact attention of local ``q`` ``(B, H, Tl, D)`` over the gathered ``k``, ``v``
    ``(B, Hkv, Tl, D)``; ``docs`` ``(B, Tl)`` this rank's document ids or None."""
    local_len = q.shape[2]
    chunk_len = local_len // layout.chunks_per_rank
    kv = gather_sequence(torch.stack([k, v]), 3, group)  # (2, B, Hkv, cp * Tl, D)
    kv = layout.restore(kv, 3)  # natural order: chunk c at rows c * chunk_len
    k_all, v_all = expand_heads(kv[0], q.shape[1]), expand_heads(kv[1], q.shape[1])

    def plan() -> list[Block]:
        chunk_docs = None
        if docs is not None:
            gathered = layout.restore(gather_sequence(docs, 1, group), 1)
            chunk_docs = ChunkDocs.of(gathered, chunk_len)
        return plan_blocks(
            layout.chunks(dist.get_rank(group)),
            range(layout.cp * layout.chunks_per_rank),
            chunk_len,
            is_causal,
            chunk_docs,
            q.device,
        )

    key = ("allgather", group, layout, chunk_len, is_causal, q.device)
    return blocked_attention(q, k_all, v_all, planned(docs, key, plan), scale)
