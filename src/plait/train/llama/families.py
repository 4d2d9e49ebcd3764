"""The model families built here (:data:`FAMILIES`), and what sets them apart, read from a
``config.json`` as transformers reads it: each family's defaults for the keys a file leaves
out, its attention's biases and query/key norms, its sliding window, its experts.

The package docstring (:mod:`plait.train.llama`) says what each family adds to a Llama.
Every function here returns fields of :class:`~plait.train.llama.LlamaConfig` or raises
:class:`~plait.train.llama.LlamaConfigError` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.train.llama.values import LlamaConfigError, read_bool, read_float, read_int

__all__ = [
    "FAMILIES",
    "FAMILY_DEFAULTS",
    "attention_fields",
    "expert_fields",
    "families_help",
    "model_type",
    "sliding_window",
    "unsupported_type",
]

#: The model families built here: ``model_type`` -> the ``architectures`` entry of its
#: causal language model (the package docstring says what each adds to a Llama).
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
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
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
    # Qwen's sliding_window applies only with use_sliding_window (sliding_window below).
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


def unsupported_type(kind: object) -> str:
    """The message refusing ``model_type`` ``kind``."""
    return f"model_type {kind!r} is not supported; plait builds {families_help()}"


def model_type(values: Mapping[str, Any]) -> str:
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
        raise LlamaConfigError(unsupported_type(kind))
    return str(kind)


def attention_fields(kind: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """Attention's biases and query/key norms in ``kind`` (package docstring)."""
    if kind == "qwen2":  # transformers' Qwen2: q, k and v always biased, o never
        return {"qkv_bias": True, "proj_bias": False}
    bias = kind in ("llama", "qwen3", "qwen3_moe") and read_bool(values, "attention_bias", False)
    return {"qkv_bias": bias, "proj_bias": bias, "qk_norm": kind in ("qwen3", "qwen3_moe")}


def sliding_window(kind: str, values: Mapping[str, Any], layers: int) -> int | None:
    """The attention window of the layers that have one (None: no layer has one): always
    mistral's and mixtral's ``sliding_window``; qwen's only with ``use_sliding_window``,
    on the layers from ``max_window_layers`` on (or those ``layer_types`` names)."""
    if kind == "llama" or values.get("sliding_window") is None:
        return None
    if kind in ("qwen2", "qwen3", "qwen3_moe"):
        if not read_bool(values, "use_sliding_window", False):
            return None
        types = values.get("layer_types")
        if kind == "qwen3_moe":
            pass  # every layer
        elif types is not None:
            if "sliding_attention" not in types:
                return None
        elif read_int(values, "max_window_layers", 28) >= layers:
            return None
    window = read_int(values, "sliding_window")
    if window < 1:
        raise LlamaConfigError(f"sliding_window {window}: must be at least 1, or null")
    return window


def expert_fields(
    kind: str, values: Mapping[str, Any], layers: int, intermediate: int
) -> dict[str, Any]:
    """The mixture-of-experts fields of ``kind`` (none for a dense family)."""
    if kind == "mixtral":
        key = "num_local_experts"  # or num_experts: aliases (LlamaConfig.from_hf)
        if read_float(values, "router_jitter_noise", 0.0):
            raise LlamaConfigError(
                "router_jitter_noise is not supported (plait's router has no noise): use 0.0"
            )
        experts, hidden, moe_layers = read_int(values, key), intermediate, tuple(range(layers))
        norm = True  # Mixtral always renormalises the top-k weights
    elif kind == "qwen3_moe":
        experts = read_int(values, "num_experts")
        hidden = read_int(values, "moe_intermediate_size")
        step = read_int(values, "decoder_sparse_step", 1)
        if step < 1:
            raise LlamaConfigError(f"decoder_sparse_step {step}: must be at least 1")
        dense = values.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise LlamaConfigError(f"mlp_only_layers must be a list of layer indices: {dense!r}")
        moe_layers = tuple(
            i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0
        )
        norm = read_bool(values, "norm_topk_prob", False)
    else:
        return {}
    if not moe_layers:
        return {}  # a dense model after all
    return {
        "num_experts": experts,
        "num_experts_per_tok": read_int(values, "num_experts_per_tok"),
        "moe_intermediate_size": hidden,
        "moe_layers": moe_layers,
        "norm_topk_prob": norm,
        "router_aux_loss_coef": read_float(values, "router_aux_loss_coef", 0.001),
    }
