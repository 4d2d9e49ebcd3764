"""All-gather attention: every rank gathers the whole sequence's keys and values and
attends its own queries to them.

Backward: autograd through SDPA, then the gather's own backward, a reduce-scatter that sums
every rank's gradient of each key/value slice back onto the rank that holds it. Memory
per rank holds the whole sequence's keys and values; communication is one all-gather of
them (keys and values stacked, one collective) forward and one reduce-scatter backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.context.blocks import expand_heads
from plait.context.collectives import gather_sequence
from plait.context.masks import allowed
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
    kv = gather_sequence(torch.stack([k, v]), 3, group)  # (2, B, Hkv, cp * Tl, D)
    k_all, v_all = expand_heads(kv[0], q.shape[1]), expand_heads(kv[1], q.shape[1])
    q_pos = layout.positions(dist.get_rank(group), local_len, q.device)
    k_pos = layout.gathered_positions(local_len, q.device)
    k_docs = None if docs is None else gather_sequence(docs, 1, group)
    mask = allowed(q_pos, k_pos, is_causal, docs, k_docs)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)
