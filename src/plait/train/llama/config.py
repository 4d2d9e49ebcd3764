"""The configuration of a Llama-family model (:class:`LlamaConfig`), read from a Hugging
Face ``config.json`` (:meth:`LlamaConfig.from_hf`, :meth:`LlamaConfig.from_file`) with the
keys it leaves out taking its family's defaults, and checked on construction.

What is refused (other model types, rope scaling other than none or ``"llama3"``,
activations other than SiLU, MLP biases) raises :class:`LlamaConfigError` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.train.llama.families import (
    FAMILIES,
    FAMILY_DEFAULTS,
    attention_fields,
    expert_fields,
    model_type,
    sliding_window,
    unsupported_type,
)
from plait.train.llama.values import LlamaConfigError, read_bool, read_float, read_int
from plait.train.model_spec import ModelSpec
from plait.train.presets import read_config

__all__ = ["LlamaConfig"]

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
            raise LlamaConfigError(unsupported_type(self.model_type))
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

    def spec(self, name: str = "", source: str = "") -> ModelSpec:
        """This model as the planner prices it and the layout rules see it (the one
        description of its shape), named ``name``, built by ``plait train --model-config
        source``: RMSNorm and SwiGLU of width ``intermediate_size``, no linear biases, the
        MoE blocks' ``num_experts`` experts of ``moe_intermediate_size`` (no shared ones).

        ``dense_layers`` is the number of blocks not in ``moe_layers``, wherever they are:
        the parameter count and the widths tensor parallelism splits are exact, while
        the spec places those blocks first (Qwen3-MoE's ``mlp_only_layers`` or
        ``decoder_sparse_step`` may interleave them), which only a pipeline stage's share
        of them can tell. Not described (the planner's counts leave them out): Qwen2's
        q, k and v biases and ``attention_bias``' biases, ``heads x head_dim + 2 x kv_heads
        x head_dim`` parameters a block (and ``hidden_size`` more with attention_bias)."""
        moe = bool(self.moe_layers)
        return ModelSpec(
            name=name,
            layers=self.num_hidden_layers,
            d_model=self.hidden_size,
            heads=self.num_attention_heads,
            kv_heads=self.num_key_value_heads,
            ffn_hidden=self.intermediate_size,
            vocab=self.vocab_size,
            tied=self.tie_word_embeddings,
            experts=self.num_experts if moe else 0,
            top_k=self.num_experts_per_tok if moe else 1,
            expert_hidden=self.moe_intermediate_size if moe else 0,
            dense_layers=self.num_hidden_layers - len(self.moe_layers) if moe else 0,
            head_dim=self.head_dim,
            qk_norm=self.qk_norm,
            source=source,
        )

    @classmethod
    def from_hf(cls, values: Mapping[str, Any]) -> LlamaConfig:
        """The configuration in a Hugging Face ``config.json`` dict of one of
        :data:`FAMILIES` (the keys it leaves out take that family's defaults in
        transformers); LlamaConfigError names the key it cannot build from."""
        kind = model_type(values)
        missing = [key for key in _REQUIRED if key not in values]
        if missing:
            raise LlamaConfigError(f"config.json has no {', '.join(missing)}")
        merged = {**FAMILY_DEFAULTS[kind], **values}
        # transformers names a MoE's expert count either way (its attribute_map aliases
        # them: Qwen3-MoE's published configs say num_experts, transformers 5 writes
        # num_local_experts); the one the file gives wins over the family default.
        for given, other in (
            ("num_local_experts", "num_experts"),
            ("num_experts", "num_local_experts"),
        ):
            if given in values:
                merged[other] = values[given]
        fields: dict[str, Any] = {key: read_int(values, key) for key in _REQUIRED}
        layers, heads = fields["num_hidden_layers"], fields["num_attention_heads"]
        fields["num_key_value_heads"] = read_int(merged, "num_key_value_heads", heads)
        fields["max_position_embeddings"] = read_int(merged, "max_position_embeddings", 2048)
        fields["head_dim"] = read_int(merged, "head_dim", 0)
        fields["rms_norm_eps"] = read_float(merged, "rms_norm_eps", 1e-6)
        fields["tie_word_embeddings"] = read_bool(values, "tie_word_embeddings", False)
        if read_bool(values, "mlp_bias", False):
            raise LlamaConfigError("mlp_bias true is not supported (MLPs without biases)")
        act = values.get("hidden_act", "silu")
        if act != "silu":
            raise LlamaConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        fields["rope_theta"], fields["rope_scaling"] = _rope(merged)
        fields["model_type"] = kind
        fields |= attention_fields(kind, values)
        fields["sliding_window"] = sliding_window(kind, merged, layers)
        fields |= expert_fields(kind, merged, layers, fields["intermediate_size"])
        return cls(**fields)

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        """The configuration in the ``config.json`` file ``path``."""
        values = read_config(path, str(path), LlamaConfigError)
        try:
            return cls.from_hf(values)
        except LlamaConfigError as err:
            raise LlamaConfigError(f"{path}: {err}") from err


def _rope(values: Mapping[str, Any]) -> tuple[float, tuple[float, float, float, int] | None]:
    """``rope_theta`` and the llama3 scaling, from ``rope_theta`` / ``rope_scaling`` or
    transformers 5's ``rope_parameters`` (which holds both)."""
    theta = read_float(values, "rope_theta", 10000.0)
    scaling = values.get("rope_scaling")
    params = values.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise LlamaConfigError(f"rope_parameters must be an object or null, got {params!r}")
        theta = read_float(params, "rope_theta", theta)
        scaling = scaling if scaling is not None else params
    return theta, _rope_scaling(scaling)


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
        read_float(scaling, "factor", 0.0),
        read_float(scaling, "low_freq_factor", 0.0),
        read_float(scaling, "high_freq_factor", 0.0),
        read_int(scaling, "original_max_position_embeddings"),
    )
