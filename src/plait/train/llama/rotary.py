"""Rotary position embeddings: the inverse frequencies of a configuration (llama3 scaling
included) and the rotation of queries and keys by their positions' angles.

The frequencies are computed in float64 and kept in float32, as transformers keeps them;
the rotation returns its input's dtype.
"""

from __future__ import annotations

import math

import torch

from plait.train.llama.config import LlamaConfig

__all__ = ["apply_rotary", "rope_inv_freq"]


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """The rotary embedding's inverse frequencies ``(dim_head / 2,)``, float32, llama3
    scaling applied when the configuration has it."""
    d = cfg.dim_head
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    if cfg.rope_scaling is not None:
        factor, low, high, original = cfg.rope_scaling
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = original / low, original / high
        smooth = (original / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(
            wavelen > low_wavelen, inv / factor, torch.where(wavelen < high_wavelen, inv, mid)
        )
    return inv.float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, heads, T, d)`` rotated by angles whose cosines and sines are ``(T, d)``
    (each frequency twice: the first and second halves of a head pair up)."""
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)
