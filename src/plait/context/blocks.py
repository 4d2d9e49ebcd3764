"""Attention over one block of keys with the log-sum-exp that lets blocks be merged
exactly, the merge, and one block's gradients given the merged result: the pieces that
every method assembles.

For queries ``q`` and one key block, with scores ``S = scale * q k^T`` (masked scores are
``-inf``): ``lse = logsumexp(S)`` per query and ``out = softmax(S) v``. Two blocks merge
into the attention over both as ``lse = logaddexp(lse1, lse2)``, ``out = out1 * exp(lse1 -
lse) + out2 * exp(lse2 - lse)`` (online softmax). A query that sees no key of a block has
``lse = -inf`` and ``out = 0`` there, which the merge weighs as nothing. Merged outputs
and ``lse`` are out-sized (never score-sized) and kept in at least float32.

Backward of the merged attention, block by block (as flash attention's): with ``P =
exp(S - lse)`` (``lse`` the merged one), ``dv = P^T dout``, ``dS = P * (dout v^T -
delta)`` where ``delta = rowsum(dout * out)`` (``out`` the merged one), ``dq = scale * dS
k``, ``dk = scale * dS^T q``. So a block's gradients need only the block's inputs and the
*final* ``out`` and ``lse``: fused backward kernels that take ``out`` and ``logsumexp``
compute exactly that.

Kernels (:func:`fused_attention`, :func:`fused_attention_backward`): SDPA's own fused
kernels, which never hold a score-sized tensor: on CPU
``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), on CUDA
``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``; every dtype, fp32
included). A block is computed fused when it is fully visible (no mask) or the square
diagonal block of a causal mask (``is_causal``); only a block that packed documents cut
(:func:`plait.context.masks.visibility`) takes the explicit path
(:func:`block_attention`, :func:`block_grads`: scores of the block's size, in the input
dtype) with its block-sized mask.

:func:`plan_blocks` lays out the blocks of local queries over a key tensor, chunk by chunk
(blocks hidden by causality or documents skipped, neighbouring fully visible blocks
fused into one call); :func:`attend_blocks` / :func:`blocks_backward` run a plan into
running accumulators (the ring's steps), :func:`blocked_attention` is a plan as one
differentiable call (all-gather and Ulysses with documents).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from plait.context.masks import DocSpan, Visibility, allowed, doc_spans, visibility

__all__ = [
    "DOC_TILE",
    "Block",
    "BlockGrads",
    "ChunkDocs",
    "accumulate_dtype",
    "attend_blocks",
    "block_attention",
    "block_grads",
    "blocked_attention",
    "blocks_backward",
    "doc_tile",
    "expand_heads",
    "fold_heads",
    "fused_attention",
    "fused_attention_backward",
    "merge",
    "plan_blocks",
    "planned",
]

_aten = torch.ops.aten


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for lower-precision inputs, else ``dtype``."""
    return torch.promote_types(dtype, torch.float32)


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: key/value heads ``(B, Hkv, T, D)`` repeated to ``heads``
    (query head ``h`` uses key head ``h // (heads // Hkv)``, as SDPA's ``enable_gqa``)."""
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def fold_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of :func:`expand_heads`: ``(B, H, T, D)`` summed back to ``kv_heads``."""
    b, h, t, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, t, d).sum(2)


# -- fused kernels ---------------------------------------------------------------------


def _cuda_lse_len(rows: int) -> int:
    # The efficient kernel's log-sum-exp is padded to a multiple of 32 rows (not on ROCm).
    return rows if torch.version.hip else math.ceil(rows / 32) * 32


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, H, Tq, D) in q's dtype, lse (B, H, Tq) float32)`` of ``q`` over the whole
    key block (``is_causal``: the square diagonal block), by SDPA's fused kernel."""
    if q.device.type == "cuda":
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, is_causal, scale=scale
        )
        return out, lse[..., : q.shape[2]]
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, scale=scale
    )
    return out, lse


def fused_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one key block, in q's dtype, given the *merged* ``out`` (q's
    dtype) and ``lse`` (float32) of these queries over every block (see the module doc)."""
    dout, out, lse = dout.contiguous(), out.contiguous(), lse.float().contiguous()
    if q.device.type == "cuda":
        rows = q.shape[2]
        lse = F.pad(lse, (0, _cuda_lse_len(rows) - rows))
        empty = torch.empty((), dtype=torch.long, device=q.device)  # no dropout: no rng
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, empty, empty, 0.0,
            [True, True, True, False], is_causal, scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, scale=scale
    )
    return dq, dk, dv


# -- the explicit path (masked blocks) -------------------------------------------------


def _scores(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # A fully masked row has lse = -inf; subtracting 0 instead keeps exp(-inf) = 0, not nan.
    return lse.masked_fill(torch.isinf(lse), 0.0)


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, H, Tq, D), lse (B, H, Tq))`` of ``q`` over one key block (heads already
    expanded) by explicit matmuls; ``out`` in the input dtype, ``lse`` in the accumulation
    dtype. Holds score-sized tensors: for masked blocks only."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s.to(accumulate_dtype(s.dtype)), dim=-1)
    p = torch.exp(s - _finite(lse).to(s.dtype)[..., None])
    return torch.matmul(p, v), lse


def merge(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The running ``(out, lse)`` merged with one more block's (``None``: nothing yet)."""
    block_lse = block_lse.to(accumulate_dtype(block_out.dtype))
    block_out = block_out.to(block_lse.dtype)
    if out is None or lse is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    out = (
        out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None]
    )
    return out, new


BlockGrads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def block_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
) -> BlockGrads:
    """``(dq, dk, dv)`` of one key block's share of the merged attention by explicit
    matmuls (see the module doc); ``lse`` and ``delta`` ``(B, H, Tq)`` are the merged
    attention's."""
    s = _scores(q, k, mask, scale)
    p = torch.exp(s - lse.to(s.dtype)[..., None])  # the merged lse is finite in every row
    dv = torch.matmul(p.transpose(-2, -1), dout)
    dp = torch.matmul(dout, v.transpose(-2, -1))
    ds = p * (dp - delta.to(dp.dtype)[..., None])
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    return dq, dk, dv


# -- plans: which blocks, how --------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """Local query rows ``q`` over key rows ``k``: ``"full"`` or ``"causal"`` (fused) or
    ``"masked"`` (explicit, with ``mask`` ``(B or 1, 1, len q, len k)``)."""

    q: slice
    k: slice
    kind: Visibility
    mask: torch.Tensor | None = None


#: With packed documents, blocks are planned on tiles of at most this many tokens (a
#: layout chunk halved while it is larger and even): documents then cut fewer and smaller
#: blocks, and the masks that remain are tile-sized.
DOC_TILE = 256


def doc_tile(chunk_len: int) -> int:
    """The tile that packed documents are planned on, for chunks of ``chunk_len``."""
    tile = chunk_len
    while tile > DOC_TILE and tile % 2 == 0:
        tile //= 2
    return tile


@dataclass(frozen=True)
class ChunkDocs:
    """Packed documents for planning: ``docs`` ``(B, T)`` every token's document id in
    natural order, planned on tiles of ``tile`` tokens (:func:`doc_tile`), and each tile's
    :data:`DocSpan` (``None``: unknown)."""

    docs: torch.Tensor
    tile: int
    spans: list[DocSpan] | None

    @staticmethod
    def of(docs: torch.Tensor, chunk_len: int) -> ChunkDocs:
        tile = doc_tile(chunk_len)
        return ChunkDocs(docs, tile, doc_spans(docs, tile))

    def chunk(self, c: int) -> torch.Tensor:
        return self.docs[:, c * self.tile : (c + 1) * self.tile]


def _rows(i: int, size: int) -> slice:
    return slice(i * size, (i + 1) * size)


def plan_blocks(
    q_chunks: Sequence[int],
    k_chunks: Sequence[int],
    chunk_len: int,
    is_causal: bool,
    docs: ChunkDocs | None,
    device: torch.device,
) -> list[Block]:
    """The blocks of queries over keys, both given as global chunk indices in their local
    order (row ``i * chunk_len`` of the query tensor starts chunk ``q_chunks[i]``; the same
    for keys). With documents the chunks are planned as tiles of ``docs.tile`` tokens.
    Hidden blocks are left out; a query chunk's fully visible key chunks that lie next to
    each other in the key tensor become one block, and neighbouring query chunks that see
    all the keys the same way share their blocks."""
    spans = None
    if docs is not None:
        split = chunk_len // docs.tile
        q_chunks = [c * split + i for c in q_chunks for i in range(split)]
        k_chunks = [c * split + i for c in k_chunks for i in range(split)]
        chunk_len, spans = docs.tile, docs.spans
    rows: list[list[Block]] = []
    for i, qc in enumerate(q_chunks):
        blocks: list[Block] = []
        for j, kc in enumerate(k_chunks):
            kind = visibility(qc, kc, is_causal, spans, docs is not None)
            if kind == "hidden":
                continue
            q_rows, k_rows = _rows(i, chunk_len), _rows(j, chunk_len)
            last = blocks[-1] if blocks else None
            if kind == "full" and last and last.kind == "full" and last.k.stop == k_rows.start:
                blocks[-1] = Block(q_rows, slice(last.k.start, k_rows.stop), "full")
                continue
            mask = None
            if kind == "masked":
                pos = torch.arange(chunk_len, device=device)
                assert docs is not None
                mask = allowed(
                    pos + qc * chunk_len,
                    pos + kc * chunk_len,
                    is_causal,
                    docs.chunk(qc).to(device),
                    docs.chunk(kc).to(device),
                )
            blocks.append(Block(q_rows, k_rows, kind, mask))
        rows.append(blocks)
    plan: list[Block] = []
    previous: list[Block] = []
    for blocks in rows:
        if (
            previous
            and all(b.kind == "full" for b in blocks + previous)
            and [b.k for b in blocks] == [b.k for b in previous]
        ):
            start = previous[0].q.start
            stop = blocks[0].q.stop
            previous = [Block(slice(start, stop), b.k, "full") for b in blocks]
            plan[-len(blocks) :] = previous
            continue
        plan.extend(blocks)
        previous = blocks
    return plan


_Plan = TypeVar("_Plan")
#: Plans per documents tensor, while it lives: ``(its version, {key: plan})``.
_PLANS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def planned(docs: torch.Tensor | None, key: Hashable, build: Callable[[], _Plan]) -> _Plan:
    """``build()``, once per documents tensor ``docs`` and ``key`` while that tensor lives.

    Every attention of one forward (each layer, a checkpointed block's recompute, the
    backward) is handed the same documents tensor, so the plan, with what building it
    costs (gathering the ids, a collective; reading their spans on the host, a device
    sync on GPUs; the masks), is made once per forward instead of once per layer.
    ``key``: everything else the plan depends on. Built every time without documents,
    while tracing, and again after ``docs`` changes in place (its version). Every rank
    makes the same calls with a tensor of the same life, so all hit or miss alike and a
    collective inside ``build`` stays matched."""
    if docs is None or torch.compiler.is_compiling():
        return build()
    version = docs._version
    entry = _PLANS.get(docs)
    if entry is None or entry[0] != version:
        entry = (version, {})
        _PLANS[docs] = entry
    plans: dict[Hashable, Any] = entry[1]
    if key not in plans:
        plans[key] = build()
    plan: _Plan = plans[key]
    return plan


def attend_blocks(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Sequence[Block],
    scale: float,
) -> None:
    """Merge every block of ``plan`` into the running ``out`` ``(B, H, Tq, D)`` and ``lse``
    ``(B, H, Tq)`` (accumulation dtype; start them at 0 and ``-inf``), in place. ``k`` and
    ``v`` have as many heads as ``q``."""
    for b in plan:
        q_b, k_b, v_b = q[:, :, b.q], k[:, :, b.k], v[:, :, b.k]
        if b.kind == "masked":
            block = block_attention(q_b, k_b, v_b, b.mask, scale)
        else:
            block = fused_attention(q_b, k_b, v_b, b.kind == "causal", scale)
        o, s = merge(out[:, :, b.q], lse[:, :, b.q], *block)
        out[:, :, b.q] = o
        lse[:, :, b.q] = s


def blocks_backward(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: Sequence[Block],
    scale: float,
) -> None:
    """Add every block's gradients to ``dq`` and to ``dk`` / ``dv`` (which may have fewer,
    grouped heads than ``k`` / ``v``: folded), in place; ``out`` (q's dtype) and ``lse``
    are the merged attention's over *all* keys, ``dout`` its gradient."""
    delta: torch.Tensor | None = None
    kv_heads = dk.shape[1]
    for b in plan:
        q_b, k_b, v_b = q[:, :, b.q], k[:, :, b.k], v[:, :, b.k]
        if b.kind == "masked":
            if delta is None:
                acc = accumulate_dtype(q.dtype)
                delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, H, Tq)
            grads = block_grads(
                q_b, k_b, v_b, b.mask, scale, dout[:, :, b.q], lse[:, :, b.q], delta[:, :, b.q]
            )
        else:
            grads = fused_attention_backward(
                dout[:, :, b.q], q_b, k_b, v_b, out[:, :, b.q], lse[:, :, b.q],
                b.kind == "causal", scale,
            )  # fmt: skip
        dq[:, :, b.q] += grads[0]
        dk[:, :, b.k] += fold_heads(grads[1], kv_heads)
        dv[:, :, b.k] += fold_heads(grads[2], kv_heads)


class _Blocked(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: list[Block],
        scale: float,
    ) -> torch.Tensor:
        acc = accumulate_dtype(q.dtype)
        out = q.new_zeros((*q.shape[:3], v.shape[-1]), dtype=acc)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=acc)
        attend_blocks(out, lse, q, k, v, plan, scale)
        result = out.to(q.dtype)
        ctx.plan, ctx.scale = plan, scale
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        acc = accumulate_dtype(q.dtype)
        dq = torch.zeros_like(q, dtype=acc)
        dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
        blocks_backward(dq, dk, dv, dout, q, k, v, out, lse, ctx.plan, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: list[Block], scale: float
) -> torch.Tensor:
    """Exact attention of ``q`` over ``k``, ``v`` (as many heads) as laid out by ``plan``
    (every query row in at least one block), differentiable: its backward runs the plan's
    blocks again from the saved output and log-sum-exp, so nothing score-sized is kept."""
    out: torch.Tensor = _Blocked.apply(q, k, v, plan, scale)
    return out
