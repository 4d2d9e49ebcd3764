"""Grouped-query causal self-attention with rotary position embeddings, the Llama family's
(:class:`LlamaAttention`): separate q, k, v and output projections, so tensor parallelism
splits each by heads, and head counts read from the projections' widths, so each rank runs
its local heads with the same code.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.train.llama.config import LlamaConfig
from plait.train.llama.rms_norm import RMSNorm
from plait.train.llama.rotary import apply_rotary, rope_inv_freq
from plait.train.packing import Packing, causal_attention, takes_grouped_heads

__all__ = ["LlamaAttention"]


class LlamaAttention(nn.Module):
    """Grouped-query causal self-attention with rotary embeddings. The query and key/value
    head counts come from the projections' output widths (this rank's under tensor
    parallelism); ``positions`` is set by :class:`~plait.train.llama.Llama`.

    ``repeat_kv``: whether the key/value heads are repeated to the query heads before SDPA
    (the default), or handed to it grouped with ``enable_gqa``. Context parallelism turns
    it off (:func:`plait.train.parallelize.parallelize`): :mod:`plait.context` takes
    grouped heads and exchanges them at their own width, ``heads / kv_heads`` times fewer
    bytes than repeated ones. Packed rows that run the variable-length kernel
    (:func:`~plait.train.packing.takes_grouped_heads`) get them grouped too. Elsewhere they
    stay repeated, as SDPA's memory-efficient kernel (CUDA, fp32) takes no ``enable_gqa``
    and such a call would fall back to the math kernel."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        c, d = cfg.hidden_size, cfg.dim_head
        self.head_dim = d
        self.q = nn.Linear(c, cfg.num_attention_heads * d, bias=cfg.qkv_bias)
        self.k = nn.Linear(c, cfg.num_key_value_heads * d, bias=cfg.qkv_bias)
        self.v = nn.Linear(c, cfg.num_key_value_heads * d, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.num_attention_heads * d, c, bias=cfg.proj_bias)
        # Qwen3: each head's queries and keys RMS-normalised (one gain per head dimension,
        # shared by the heads) before the rotary embedding.
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self._rope = cfg  # reset_buffers recomputes inv_freq from it
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.positions: torch.Tensor | None = None
        self.repeat_kv = True

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` where it lives (after ``to_empty``: a model built on the
        meta device): on the CPU in float64, as the constructor does, then copied, so its
        values are the constructor's on every device."""
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        inv_freq.copy_(rope_inv_freq(self._rope))

    def forward(self, x: torch.Tensor, pack: Packing | None = None) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]  # x: (B, T, C)
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )  # (B, heads, T, d) and (B, kv heads, T, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        pos = self.positions if self.positions is not None else torch.arange(t, device=x.device)
        if pack is not None:  # packed rows: positions in each document, (B, T)
            pos = pack.positions
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        angles = pos.to(inv_freq.device, torch.float32)[..., None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)  # (T, d), or (B, T, d) per row
        cos, sin = angles.cos(), angles.sin()
        if cos.dim() == 3:  # per row: broadcast over the heads
            cos, sin = cos[:, None], sin[:, None]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = q.shape[1] // k.shape[1]
        # Each kv head serves `groups` consecutive q heads; the variable-length kernel takes
        # them grouped, SDPA's memory-efficient one (CUDA, fp32) repeated.
        if groups > 1 and self.repeat_kv and not takes_grouped_heads(q, k, v, pack):
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = causal_attention(q, k, v, pack, enable_gqa=k.shape[1] != q.shape[1])
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, C)
