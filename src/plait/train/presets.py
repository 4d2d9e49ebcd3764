"""Model presets for ``plait train --model-config``: published configurations by name, and
tiny ones for quick CPU runs.

``--model-config`` takes a path to a Hugging Face ``config.json`` or one of the names in
:data:`PRESETS`; a file of that name wins over the preset, so a preset name never hides a
file. The published presets carry their model's ``config.json`` values as published (the
keys that describe the model and its tokens; bookkeeping such as ``transformers_version``,
``torch_dtype`` and ``use_cache`` left out); they are for the planner and dry runs (a 70B
model does not train on a laptop). The ``tiny-*`` presets are small models of each family
(a vocabulary of 512, two to four blocks of width 64) that train in seconds on a CPU.

A run records the configuration it trained in its run directory (:data:`RUN_FILE`), the
exact bytes whose sha256 is the run's ``model_hash``: a preset's bytes are its JSON as
:func:`config_bytes` writes it, so a checkpoint of a preset loads only into the same
preset, and export finds the configuration without the preset table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["PRESETS", "RUN_FILE", "config_bytes", "is_preset", "preset_names"]

#: The file in a run directory holding the ``config.json`` the run trained.
RUN_FILE = "model_config.json"

_LLAMA3_ROPE = {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

#: Preset name -> its config.json values.
PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.2-1B
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "vocab_size": 128256,
    },
    # meta-llama/Llama-3.1-8B
    "llama3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": _LLAMA3_ROPE,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
    },
    # meta-llama/Llama-3.1-70B
    "llama3.1-70b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 8192,
        "initializer_range": 0.02,
        "intermediate_size": 28672,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": _LLAMA3_ROPE,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
    },
    # meta-llama/Llama-3.1-405B
    "llama3.1-405b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 16384,
        "initializer_range": 0.02,
        "intermediate_size": 53248,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 128,
        "num_hidden_layers": 126,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": _LLAMA3_ROPE,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
    },
    # Qwen/Qwen2.5-0.5B
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 896,
        "initializer_range": 0.02,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "model_type": "qwen2",
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # mistralai/Mistral-7B-v0.3 (v0.1 had a 4096-token sliding window and 32000 tokens)
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": 32768,
    },
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
    },
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # Tiny models of each family, for CPU runs and tests (not published models).
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": 1024,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": 512,
    },
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": 1024,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 512,
    },
    "tiny-mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 64,
        "max_position_embeddings": 1024,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": 512,
    },
    "tiny-qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": 1024,
        "mlp_only_layers": [0],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 512,
    },
}


def config_object(data: bytes | str, where: str, error: type[ValueError]) -> dict[str, Any]:
    """``data``, a ``config.json``'s text, as its JSON object; ``error`` (its message begins
    with ``where``) when it is not valid JSON or not an object."""
    try:
        values = json.loads(data)
    except json.JSONDecodeError as err:
        raise error(f"{where}: not valid JSON: {err}") from err
    if not isinstance(values, dict):
        raise error(f"{where}: not a JSON object")
    return values


def read_config(path: str | Path, where: str, error: type[ValueError]) -> dict[str, Any]:
    """The JSON object of the file ``path`` (:func:`config_object`); ``error`` also when it
    cannot be read."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise error(f"{where}: cannot read it ({err.strerror})") from err
    return config_object(data, where, error)


def preset_names() -> str:
    """The preset names, for help texts and messages."""
    return ", ".join(PRESETS)


def is_preset(value: str) -> bool:
    """Whether ``--model-config value`` names a preset (no file of that name exists)."""
    return value in PRESETS and not Path(value).exists()


def config_bytes(value: str) -> bytes:
    """The ``config.json`` of ``--model-config value``: the file's bytes, or a preset's JSON
    (sorted keys, two-space indent, a final newline). OSError when ``value`` is neither a
    readable file nor a preset."""
    if is_preset(value):
        return (json.dumps(PRESETS[value], indent=2, sort_keys=True) + "\n").encode()
    return Path(value).read_bytes()
