"""A Llama-family decoder for ``plait train``, shaped by a Hugging Face ``config.json``.

Pre-norm blocks of RMSNorm, grouped-query causal self-attention with rotary position
embeddings (separate q, k, v and output projections, biases only where the family has
them) and a SwiGLU MLP (``gate``, ``up``, ``down``) or a mixture of SwiGLU experts
(:class:`plait.experts.MoE`); a final RMSNorm and a head, tied to the token embedding or
not. The structure mirrors :class:`plait.train.model.GPT`, so ``plait train``'s recipe
applies unchanged: blocks in ``self.blocks`` (each with ``ln1``, ``attn`` with ``q``,
``k``, ``v``, ``proj``, ``ln2`` and ``mlp``), ``tok_emb``, ``ln_f`` and ``head`` falsy on
pipeline stages without them, and ``positions``: the tokens' global positions under
context parallelism, which the rotary embedding uses. Attention reads its query and
key/value head counts from the projections' widths, so tensor parallelism's local heads
work with the same code.

The families it builds (:data:`FAMILIES`, by the config's ``model_type``, else its
``architectures``), each as transformers defines it, keys it leaves out taking that
family's defaults:

* ``llama`` (``LlamaForCausalLM``): as above; ``attention_bias`` gives q, k, v and the
  output projection biases.
* ``mistral`` (``MistralForCausalLM``): a Llama; its ``sliding_window`` must be null or
  at least the trained sequence length (no window is applied).
* ``qwen2`` (``Qwen2ForCausalLM``): q, k and v with biases (``attn.q.bias`` ...), the output
  projection without; a sliding window only where ``use_sliding_window`` says so.
* ``qwen3`` (``Qwen3ForCausalLM``): per-head RMSNorms on queries and keys before the
  rotary embedding (``attn.q_norm``, ``attn.k_norm``, of ``head_dim``), an explicit
  ``head_dim``, ``attention_bias`` (all four projections).
* ``mixtral`` (``MixtralForCausalLM``): every block's MLP a :class:`plait.experts.MoE` at
  ``blocks.{i}.mlp`` (``num_local_experts`` SwiGLU experts of ``intermediate_size``,
  ``num_experts_per_tok`` chosen by a softmax router, their weights renormalised to sum 1,
  no shared experts, ``router_aux_loss_coef`` weighting the balance loss).
* ``qwen3_moe`` (``Qwen3MoeForCausalLM``): qwen3's attention; MoE blocks of ``num_experts``
  experts of ``moe_intermediate_size`` (weights renormalised when ``norm_topk_prob``) every
  ``decoder_sparse_step``-th block, dense SwiGLU blocks (``intermediate_size``) in
  ``mlp_only_layers``.

Other model types (e.g. ``qwen2_moe``: its gated shared expert), rope scaling other than
none or ``"llama3"``, activations other than SiLU and MLP biases are refused, the message
naming the key. The balance loss is plait's ``"global"`` one (per block, over each
forward's tokens on all data-parallel ranks: :mod:`plait.experts.balance`), not
transformers' single loss over all blocks' logits; so pipelines and gradient accumulation,
whose forwards see microbatches, move it slightly (the losses stay exact without it). No
router z-loss, no router jitter, no balancing bias; ``plait train``'s MoE flags are the
GPT's and do not apply.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from plait.experts import MoE
from plait.train.model import Packing, causal_attention, packing
from plait.train.presets import read_config

__all__ = [
    "FAMILIES",
    "Llama",
    "LlamaConfig",
    "LlamaConfigError",
    "RMSNorm",
    "apply_rotary",
    "families_help",
    "rope_inv_freq",
]


class LlamaConfigError(ValueError):
    """A ``config.json`` this module cannot build a model from; the message names the key."""


_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)

#: The model families built here: ``model_type`` -> the ``architectures`` entry of its
#: causal language model (the module docstring says what each adds to a Llama).
FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

#: Each family's defaults for keys a config.json leaves out, where transformers' differ
#: from Llama's (rms_norm_eps 1e-6, rope_theta 1e4, max_position_embeddings 2048, as many
#: KV heads as query heads, head_dim hidden_size / heads, no sliding window).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
    },
    "mixtral": {
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
    },
    # Qwen's sliding_window applies only with use_sliding_window (_sliding_window).
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096},
    "qwen3": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "sliding_window": 4096,
    },
    "qwen3_moe": {
        "sliding_window": 4096,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "router_aux_loss_coef": 0.001,
    },
}


def families_help() -> str:
    """The supported families, for help texts: ``llama (LlamaForCausalLM), ...``."""
    return ", ".join(f"{kind} ({arch})" for kind, arch in FAMILIES.items())


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
    model_type: str = "llama"  # one of FAMILIES
    qkv_bias: bool = False  # biases on the q, k and v projections
    proj_bias: bool = False  # a bias on attention's output projection
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before rotary (qwen3)
    #: The attention window of the layers that have one (mistral, qwen's sliding layers);
    #: None: none. A model refuses a sequence longer than the window (it applies none).
    sliding_window: int | None = None
    # Mixture of experts: the blocks in moe_layers have a MoE of num_experts SwiGLU
    # experts of moe_intermediate_size, num_experts_per_tok per token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum 1
    router_aux_loss_coef: float = 0.0  # the balance loss's weight

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
        if self.model_type not in FAMILIES:
            raise LlamaConfigError(_unsupported_type(self.model_type))
        if self.moe_layers:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise LlamaConfigError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                    f"the number of experts ({self.num_experts})"
                )
            if self.moe_intermediate_size < 1:
                raise LlamaConfigError(
                    f"the experts' width {self.moe_intermediate_size}: must be at least 1"
                )
            if not all(0 <= i < self.num_hidden_layers for i in self.moe_layers):
                raise LlamaConfigError(f"MoE layers {self.moe_layers}: out of range")

    @property
    def moe_shape(self) -> tuple[int, int] | None:
        """``(num_hidden_layers, num_experts)`` of a model with MoE blocks (the shape of
        its expert-load table); None for a dense one."""
        return (self.num_hidden_layers, self.num_experts) if self.moe_layers else None

    @property
    def dim_head(self) -> int:
        """Each attention head's width."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, values: Mapping[str, Any]) -> LlamaConfig:
        """The configuration in a Hugging Face ``config.json`` dict of one of
        :data:`FAMILIES` (the keys it leaves out take that family's defaults in
        transformers); LlamaConfigError names the key it cannot build from."""
        kind = _model_type(values)
        missing = [key for key in _REQUIRED if key not in values]
        if missing:
            raise LlamaConfigError(f"config.json has no {', '.join(missing)}")
        merged = {**_FAMILY_DEFAULTS[kind], **values}
        # transformers names a MoE's expert count either way (its attribute_map aliases
        # them: Qwen3-MoE's published configs say num_experts, transformers 5 writes
        # num_local_experts); the one the file gives wins over the family default.
        for given, other in (
            ("num_local_experts", "num_experts"),
            ("num_experts", "num_local_experts"),
        ):
            if given in values:
                merged[other] = values[given]
        fields: dict[str, Any] = {key: _int(values, key) for key in _REQUIRED}
        layers, heads = fields["num_hidden_layers"], fields["num_attention_heads"]
        fields["num_key_value_heads"] = _int(merged, "num_key_value_heads", heads)
        fields["max_position_embeddings"] = _int(merged, "max_position_embeddings", 2048)
        fields["head_dim"] = _int(merged, "head_dim", 0)
        fields["rms_norm_eps"] = _float(merged, "rms_norm_eps", 1e-6)
        fields["tie_word_embeddings"] = _bool(values, "tie_word_embeddings", False)
        if _bool(values, "mlp_bias", False):
            raise LlamaConfigError("mlp_bias true is not supported (MLPs without biases)")
        act = values.get("hidden_act", "silu")
        if act != "silu":
            raise LlamaConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        fields["rope_theta"], fields["rope_scaling"] = _rope(merged)
        fields["model_type"] = kind
        fields |= _attention(kind, values)
        fields["sliding_window"] = _sliding_window(kind, merged, layers)
        fields |= _experts(kind, merged, layers, fields["intermediate_size"])
        return cls(**fields)

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        """The configuration in the ``config.json`` file ``path``."""
        values = read_config(path, str(path), LlamaConfigError)
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


def _bool(values: Mapping[str, Any], key: str, default: bool) -> bool:
    value = values.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, bool):
        raise LlamaConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _unsupported_type(kind: object) -> str:
    return f"model_type {kind!r} is not supported; plait builds {families_help()}"


def _model_type(values: Mapping[str, Any]) -> str:
    """The family of a config.json: its ``model_type``, else its ``architectures``' (a
    config with neither is read as a Llama's)."""
    kind = values.get("model_type")
    if kind is None:
        archs = values.get("architectures") or []
        if not isinstance(archs, list):
            raise LlamaConfigError(f"architectures must be a list, got {archs!r}")
        by_arch = {arch: name for name, arch in FAMILIES.items()}
        known = [by_arch[a] for a in archs if a in by_arch]
        if archs and not known:
            raise LlamaConfigError(
                f"architectures {archs} is not supported; plait builds {families_help()}"
            )
        kind = known[0] if known else "llama"
    if kind not in FAMILIES:
        raise LlamaConfigError(_unsupported_type(kind))
    return str(kind)


def _rope(values: Mapping[str, Any]) -> tuple[float, tuple[float, float, float, int] | None]:
    """``rope_theta`` and the llama3 scaling, from ``rope_theta`` / ``rope_scaling`` or
    transformers 5's ``rope_parameters`` (which holds both)."""
    theta = _float(values, "rope_theta", 10000.0)
    scaling = values.get("rope_scaling")
    params = values.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise LlamaConfigError(f"rope_parameters must be an object or null, got {params!r}")
        theta = _float(params, "rope_theta", theta)
        scaling = scaling if scaling is not None else params
    return theta, _rope_scaling(scaling)


def _attention(kind: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """Attention's biases and query/key norms in ``kind`` (module docstring)."""
    if kind == "qwen2":  # transformers' Qwen2: q, k and v always biased, o never
        return {"qkv_bias": True, "proj_bias": False}
    bias = kind in ("llama", "qwen3", "qwen3_moe") and _bool(values, "attention_bias", False)
    return {"qkv_bias": bias, "proj_bias": bias, "qk_norm": kind in ("qwen3", "qwen3_moe")}


def _sliding_window(kind: str, values: Mapping[str, Any], layers: int) -> int | None:
    """The attention window of the layers that have one (None: no layer has one): always
    mistral's and mixtral's ``sliding_window``; qwen's only with ``use_sliding_window``,
    on the layers from ``max_window_layers`` on (or those ``layer_types`` names)."""
    if kind == "llama" or values.get("sliding_window") is None:
        return None
    if kind in ("qwen2", "qwen3", "qwen3_moe"):
        if not _bool(values, "use_sliding_window", False):
            return None
        types = values.get("layer_types")
        if kind == "qwen3_moe":
            pass  # every layer
        elif types is not None:
            if "sliding_attention" not in types:
                return None
        elif _int(values, "max_window_layers", 28) >= layers:
            return None
    window = _int(values, "sliding_window")
    if window < 1:
        raise LlamaConfigError(f"sliding_window {window}: must be at least 1, or null")
    return window


def _experts(
    kind: str, values: Mapping[str, Any], layers: int, intermediate: int
) -> dict[str, Any]:
    """The mixture-of-experts fields of ``kind`` (none for a dense family)."""
    if kind == "mixtral":
        key = "num_local_experts"  # or num_experts: aliases (from_hf)
        if _float(values, "router_jitter_noise", 0.0):
            raise LlamaConfigError(
                "router_jitter_noise is not supported (plait's router has no noise): use 0.0"
            )
        experts, hidden, moe_layers = _int(values, key), intermediate, tuple(range(layers))
        norm = True  # Mixtral always renormalises the top-k weights
    elif kind == "qwen3_moe":
        experts = _int(values, "num_experts")
        hidden = _int(values, "moe_intermediate_size")
        step = _int(values, "decoder_sparse_step", 1)
        if step < 1:
            raise LlamaConfigError(f"decoder_sparse_step {step}: must be at least 1")
        dense = values.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise LlamaConfigError(f"mlp_only_layers must be a list of layer indices: {dense!r}")
        moe_layers = tuple(
            i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0
        )
        norm = _bool(values, "norm_topk_prob", False)
    else:
        return {}
    if not moe_layers:
        return {}  # a dense model after all
    return {
        "num_experts": experts,
        "num_experts_per_tok": _int(values, "num_experts_per_tok"),
        "moe_intermediate_size": hidden,
        "moe_layers": moe_layers,
        "norm_topk_prob": norm,
        "router_aux_loss_coef": _float(values, "router_aux_loss_coef", 0.001),
    }


def _float(values: Mapping[str, Any], key: str, default: float) -> float:
    value = values.get(key, default)
    if value is None:  # an explicit null: the default
        value = default
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
        self.q = nn.Linear(c, cfg.num_attention_heads * d, bias=cfg.qkv_bias)
        self.k = nn.Linear(c, cfg.num_key_value_heads * d, bias=cfg.qkv_bias)
        self.v = nn.Linear(c, cfg.num_key_value_heads * d, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.num_attention_heads * d, c, bias=cfg.proj_bias)
        # Qwen3: each head's queries and keys RMS-normalised (one gain per head dimension,
        # shared by the heads) before the rotary embedding.
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.positions: torch.Tensor | None = None

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
        if groups > 1:  # every kv head serves `groups` consecutive query heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = causal_attention(q, k, v, pack)
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


def moe_block(cfg: LlamaConfig) -> MoE:
    """The mixture-of-experts feed-forward of ``cfg``'s MoE blocks: a softmax router's
    top-k (renormalised with ``norm_topk_prob``), SwiGLU experts (``w1`` the gate, ``w3``
    the up and ``w2`` the down projection: Mixtral's and Qwen3-MoE's math), no shared
    experts, ``router_aux_loss_coef`` weighting the balance loss over the global batch."""
    return MoE(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        score_func="softmax",
        route_norm=cfg.norm_topk_prob,
        aux_loss_coeff=cfg.router_aux_loss_coef,
        aux_loss_type="global",
    )


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        """Block ``layer`` of ``cfg``: its MLP a MoE when ``cfg.moe_layers`` has it."""
        super().__init__()
        self.ln1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = LlamaAttention(cfg)
        self.ln2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = moe_block(cfg) if layer in cfg.moe_layers else SwiGLU(cfg)

    def forward(self, x: torch.Tensor, pack: Packing | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), pack=pack)  # by keyword: TP prepares x only
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
        if cfg.sliding_window is not None and seq_len > cfg.sliding_window:
            raise LlamaConfigError(
                f"seq_len {seq_len} exceeds sliding_window {cfg.sliding_window} (attention "
                "here spans the whole sequence: no window)"
            )
        self.cfg = cfg
        self.seq_len = seq_len
        tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.tok_emb: nn.Embedding | None = tok_emb
        self.blocks = nn.ModuleList(LlamaBlock(cfg, i) for i in range(cfg.num_hidden_layers))
        self.ln_f: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            head.weight = tok_emb.weight
        self.head: nn.Linear | None = head
        self.init_weights()

    @property
    def moe_shape(self) -> tuple[int, int] | None:
        """``(blocks, experts)`` of the expert-load table of a model with MoE blocks (dense
        blocks' rows stay zero); None for a dense model."""
        return self.cfg.moe_shape

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
        """Normal(0, 0.02) matrices (the experts' too), the projections into the residual
        scaled down by depth, zero biases, unit norm gains; deterministic given the torch
        seed."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() < 2:
                nn.init.ones_(p)  # RMSNorm gains
            elif name.endswith(("attn.proj.weight", "mlp.down.weight", "mlp.experts.w2")):
                nn.init.normal_(p, std=residual_std)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(
        self,
        x: torch.Tensor,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``documents`` / ``positions``: packed rows, as :meth:`plait.train.model.GPT.forward`."""
        t = x.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len={self.seq_len}")
        pack = packing(documents, positions, sharded=self.positions is not None)
        if self.tok_emb:  # falsy on stages without it (split_model)
            x = self.tok_emb(x)  # (B, T, C)
        for block in self.blocks:
            x = block(x, pack)
        if self.ln_f and self.head:
            x = self.head(self.ln_f(x))  # (B, T, vocab)
        return x
