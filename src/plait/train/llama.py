"""A Llama-family decoder for ``plait train``, shaped by a Hugging Face ``config.json``.

Pre-norm blocks of RMSNorm, grouped-query causal self-attention with rotary position
embeddings (separate q, k, v and output projections, no biases) and a SwiGLU MLP
(``gate``, ``up``, ``down``); a final RMSNorm and a head, tied to the token embedding or
not. The structure mirrors :class:`plait.train.model.GPT`, so ``plait train``'s recipe
applies unchanged: blocks in ``self.blocks`` (each with ``ln1``, ``attn`` with ``q``,
``k``, ``v``, ``proj``, ``ln2`` and ``mlp``), ``tok_emb``, ``ln_f`` and ``head`` falsy on
pipeline stages without them, and ``positions``: the tokens' global positions under
context parallelism, which the rotary embedding uses. Attention reads its query and
key/value head counts from the projections' widths, so tensor parallelism's local heads
work with the same code.

Only what a ``config.json`` of ``LlamaForCausalLM`` says is read; rope scaling other than
none or ``"llama3"`` is refused.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Llama", "LlamaConfig", "LlamaConfigError", "RMSNorm", "apply_rotary", "rope_inv_freq"]


class LlamaConfigError(ValueError):
    """A ``config.json`` this module cannot build a model from; the message names the key."""


_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    #: llama3 rope scaling: (factor, low_freq_factor, high_freq_factor, original max
    #: positions); None: no scaling.
    rope_scaling: tuple[float, float, float, int] | None = None

    def __post_init__(self) -> None:
        for name in (*_REQUIRED, "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise LlamaConfigError(f"{name} {getattr(self, name)}: must be at least 1")
        if not self.head_dim and self.hidden_size % self.num_attention_heads:
            raise LlamaConfigError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); give head_dim"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise LlamaConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.dim_head % 2:
            raise LlamaConfigError(f"head dimension {self.dim_head} must be even (rotary)")

    @property
    def dim_head(self) -> int:
        """Each attention head's width."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, values: Mapping[str, Any]) -> LlamaConfig:
        """The configuration in a Hugging Face ``config.json`` dict."""
        missing = [key for key in _REQUIRED if key not in values]
        if missing:
            raise LlamaConfigError(f"config.json has no {', '.join(missing)}")
        fields: dict[str, Any] = {key: _int(values, key) for key in _REQUIRED}
        heads = fields["num_attention_heads"]
        fields["num_key_value_heads"] = _int(values, "num_key_value_heads", heads)
        fields["max_position_embeddings"] = _int(values, "max_position_embeddings", 2048)
        fields["head_dim"] = _int(values, "head_dim", 0)
        fields["rms_norm_eps"] = _float(values, "rms_norm_eps", 1e-6)
        fields["rope_theta"] = _float(values, "rope_theta", 10000.0)
        tie = values.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise LlamaConfigError(f"tie_word_embeddings must be true or false, got {tie!r}")
        fields["tie_word_embeddings"] = tie
        for key in ("attention_bias", "mlp_bias"):
            if values.get(key, False):
                raise LlamaConfigError(f"{key} true is not supported (no biases)")
        act = values.get("hidden_act", "silu")
        if act != "silu":
            raise LlamaConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        fields["rope_scaling"] = _rope_scaling(values.get("rope_scaling"))
        return cls(**fields)

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        """The configuration in the ``config.json`` file ``path``."""
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise LlamaConfigError(f"{path}: cannot read it ({err.strerror})") from err
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise LlamaConfigError(f"{path}: not valid JSON: {err}") from err
        if not isinstance(values, dict):
            raise LlamaConfigError(f"{path}: not a JSON object")
        try:
            return cls.from_hf(values)
        except LlamaConfigError as err:
            raise LlamaConfigError(f"{path}: {err}") from err


def _int(values: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = values.get(key, default)
    if value is None:  # an explicit null: the default
        value = default
    if not isinstance(value, int) or isinstance(value, bool):
        raise LlamaConfigError(f"{key} must be an integer, got {value!r}")
    return value


def _float(values: Mapping[str, Any], key: str, default: float) -> float:
    value = values.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise LlamaConfigError(f"{key} must be a number, got {value!r}")
    return float(value)


def _rope_scaling(scaling: Any) -> tuple[float, float, float, int] | None:
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise LlamaConfigError(f"rope_scaling must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise LlamaConfigError(
            f"rope_scaling type {kind!r} is not supported (only none or 'llama3')"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [key for key in keys if key not in scaling]
    if missing:
        raise LlamaConfigError(f"rope_scaling 'llama3' has no {', '.join(missing)}")
    return (
        _float(scaling, "factor", 0.0),
        _float(scaling, "low_freq_factor", 0.0),
        _float(scaling, "high_freq_factor", 0.0),
        _int(scaling, "original_max_position_embeddings"),
    )


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


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 (plain tensor ops: DTensors under
    sequence parallelism run them too)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query causal self-attention with rotary embeddings. The query and key/value
    head counts come from the projections' output widths (this rank's under tensor
    parallelism); ``positions`` is set by :class:`Llama`."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        c, d = cfg.hidden_size, cfg.dim_head
        self.head_dim = d
        self.q = nn.Linear(c, cfg.num_attention_heads * d, bias=False)
        self.k = nn.Linear(c, cfg.num_key_value_heads * d, bias=False)
        self.v = nn.Linear(c, cfg.num_key_value_heads * d, bias=False)
        self.proj = nn.Linear(cfg.num_attention_heads * d, c, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.positions: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]  # x: (B, T, C)
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )  # (B, heads, T, d) and (B, kv heads, T, d)
        pos = self.positions if self.positions is not None else torch.arange(t, device=x.device)
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        angles = pos.to(inv_freq.device, torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)  # (T, d)
        cos, sin = angles.cos(), angles.sin()
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # every kv head serves `groups` consecutive query heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, C)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.ln1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = LlamaAttention(cfg)
        self.ln2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Llama(nn.Module):
    """``forward(idx: (B, T) int64) -> logits (B, T, vocab)``; on a pipeline stage without
    the embedding it takes hidden states, without the head it returns them (as GPT)."""

    def __init__(self, cfg: LlamaConfig, seq_len: int) -> None:
        super().__init__()
        if seq_len > cfg.max_position_embeddings:
            raise LlamaConfigError(
                f"seq_len {seq_len} exceeds max_position_embeddings {cfg.max_position_embeddings}"
            )
        self.cfg = cfg
        self.seq_len = seq_len
        tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.tok_emb: nn.Embedding | None = tok_emb
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.ln_f: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            head.weight = tok_emb.weight
        self.head: nn.Linear | None = head
        self.init_weights()

    @property
    def positions(self) -> torch.Tensor | None:
        """The global positions of the tokens ``forward`` gets, when they are not the first
        ``T`` of a sequence (context parallelism); every attention's rotary embedding
        uses them."""
        for block in self.blocks:
            if isinstance(block, LlamaBlock):
                return block.attn.positions
        return None

    @positions.setter
    def positions(self, value: torch.Tensor | None) -> None:
        for block in self.blocks:
            if isinstance(block, LlamaBlock):
                block.attn.positions = value

    def init_weights(self) -> None:
        """Normal(0, 0.02) matrices, the projections into the residual scaled down by
        depth, unit norm gains; deterministic given the torch seed."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.ones_(p)  # RMSNorm gains (no biases)
            elif name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, std=residual_std)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len={self.seq_len}")
        if self.tok_emb:  # falsy on stages without it (split_model)
            x = self.tok_emb(x)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        if self.ln_f and self.head:
            x = self.head(self.ln_f(x))  # (B, T, vocab)
        return x
