"""``plait train --init-from DIR``: the checks made before any worker starts.

:func:`with_default_model_config` lets ``--init-from`` alone name the model (its
directory's ``config.json``); :func:`check_init_from` refuses a directory whose weights
cannot load into the ``--model-config`` model (plait's GPT, other shapes, no safetensors
weights), and returns warnings for settings that differ without changing a shape.
Loading the weights themselves is :func:`plait.train.hf_load.load_hf_checkpoint`'s, in
each worker; both are reached through :mod:`plait.train.hf`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from plait.train.config import ConfigError, TrainConfig
from plait.train.hf_load import weight_map
from plait.train.hf_names import CONFIG_FILE
from plait.train.llama import LlamaConfig, LlamaConfigError
from plait.train.resolve import llama_config

__all__ = ["check_init_from", "with_default_model_config"]

#: Llama settings that shape the weights: a checkpoint with other values cannot load.
#: Any other difference (rope theta, norm epsilon, ...) is worth a warning only.
_SHAPING = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "dim_head",
    "tie_word_embeddings",
    "qkv_bias",
    "proj_bias",
    "qk_norm",
    "num_experts",
    "moe_intermediate_size",
    "moe_layers",
)


def with_default_model_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``--model-config`` defaulting to ``--init-from``'s
    ``config.json`` when only ``--init-from`` is given (and not resuming)."""
    if cfg.init_from and not cfg.model_config and not cfg.resume:
        config = Path(cfg.init_from) / CONFIG_FILE
        if not config.is_file():
            raise ConfigError(
                f"--init-from {cfg.init_from}: no {CONFIG_FILE} there to build the model from; "
                "give --model-config"
            )
        return cfg.replace(model_config=str(config))
    return cfg


def check_init_from(cfg: TrainConfig) -> list[str]:
    """Refuse an ``--init-from`` that cannot load into ``cfg``'s model:
    the GPT (no ``--model-config``), or a directory whose ``config.json`` describes other
    shapes. Returns warnings about settings that differ without changing a shape (rope
    theta, norm epsilon). Nothing to check when resuming: the run's checkpoint wins."""
    if not cfg.init_from or cfg.resume:
        return []
    if not cfg.model_config:
        raise ConfigError(
            f"--init-from {cfg.init_from} loads a Hugging Face model, but this run trains "
            "plait's GPT (no --model-config): give --model-config, or leave it out on the "
            "command line to use the directory's config.json"
        )
    directory = Path(cfg.init_from)
    if not directory.is_dir():
        raise ConfigError(f"--init-from {directory}: no such directory")
    weight_map(directory)  # refuses a directory without safetensors weights
    theirs_path = directory / CONFIG_FILE
    if not theirs_path.is_file():
        return [f"--init-from {directory} has no {CONFIG_FILE}: only tensor shapes are checked"]
    try:
        theirs = LlamaConfig.from_file(theirs_path)
    except LlamaConfigError as err:
        raise ConfigError(f"--init-from {err}") from err
    ours = llama_config(cfg)
    names = dict.fromkeys([*_SHAPING, *(f.name for f in dataclasses.fields(ours))])
    differ = [n for n in names if getattr(ours, n, None) != getattr(theirs, n, None)]
    shaped = [name for name in differ if name in _SHAPING]
    if shaped:
        described = ", ".join(
            f"{name} {getattr(theirs, name)} (--model-config: {getattr(ours, name)})"
            for name in shaped
        )
        raise ConfigError(
            f"--init-from {directory}: its {CONFIG_FILE} describes another model: {described}; "
            f"use --model-config {theirs_path} (or leave --model-config out)"
        )
    notes = []
    if (directory / "tokenizer.json").is_file() and not getattr(cfg, "tokenizer", ""):
        notes.append(
            f"--init-from {directory} has a tokenizer.json, but the run trains on bytes (no "
            f"--tokenizer): to continue the model's own vocabulary, add --tokenizer "
            f"{directory / 'tokenizer.json'}"
        )
    return notes + [
        f"--init-from {directory}: {name} is {getattr(theirs, name)} there but "
        f"{getattr(ours, name)} in --model-config {cfg.model_config}; training uses the latter"
        for name in differ
        if name not in shaped and name not in ("max_position_embeddings", "head_dim")
    ]
