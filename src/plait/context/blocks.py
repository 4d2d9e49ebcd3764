"""Attention over one block of keys, with the log-sum-exp that lets blocks be merged
exactly, and the gradients of one block given the merged result (the ring's pieces).

For queries ``q`` and one key block, with scores ``S = scale * q k^T`` (masked scores are
``-inf``): ``lse = logsumexp(S)`` per query and ``out = softmax(S) v``. Two blocks merge
into the attention over both as ``lse = logaddexp(lse1, lse2)``, ``out = out1 * exp(lse1 -
lse) + out2 * exp(lse2 - lse)`` (online softmax). A query that sees no key of a block has
``lse = -inf`` and ``out = 0`` there, which the merge weighs as nothing.

Backward of the merged attention, block by block (as flash attention's): with ``P =
exp(S - lse)`` (``lse`` the merged one), ``dv = P^T dout``, ``dS = P * (dout v^T -
delta)`` where ``delta = rowsum(dout * out)``, ``dq = scale * dS k``, ``dk = scale * dS^T
q``. Scores and probabilities are computed in the input dtype; merged outputs, ``lse``
and accumulated gradients are kept in at least float32.
"""

from __future__ import annotations

import torch

__all__ = [
    "BlockGrads",
    "accumulate_dtype",
    "block_attention",
    "block_grads",
    "expand_heads",
    "fold_heads",
    "merge",
]


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
    expanded); ``out`` in the input dtype, ``lse`` in the accumulation dtype."""
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
    """``(dq, dk, dv)`` of one key block's share of the merged attention (see the module
    doc); ``lse`` and ``delta`` ``(B, H, Tq)`` are the merged attention's."""
    s = _scores(q, k, mask, scale)
    p = torch.exp(s - lse.to(s.dtype)[..., None])  # the merged lse is finite in every row
    dv = torch.matmul(p.transpose(-2, -1), dout)
    dp = torch.matmul(dout, v.transpose(-2, -1))
    ds = p * (dp - delta.to(dp.dtype)[..., None])
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    return dq, dk, dv
