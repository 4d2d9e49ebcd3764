"""Saving a whole model as Hugging Face safetensors: its tensors under transformers'
names (:func:`export_state`), written in one file or in shards with their index
(:func:`write_weights`, at most :func:`parse_size` bytes a shard).

The library half of ``plait export``: it takes a model already built and loaded, and
writes only weights. Which run, which checkpoint, the config.json and the tokenizer are
the command's (:mod:`plait.train.export`). safetensors is an optional package
(``plait[train]``), imported when weights are written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from plait.train.config import ConfigError
from plait.train.extras import require
from plait.train.hf_names import INDEX_FILE, LLAMA_RULES, WEIGHTS_FILE, Rule, hf_source, is_tied

__all__ = ["export_state", "parse_size", "write_weights"]

# Decimal units as transformers' max_shard_size reads them, and binary ones.
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: a number with an optional unit, ``5GB`` (10^9, as transformers),
    ``500MiB`` (2^20); ConfigError naming ``--max-shard-size`` otherwise."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def export_state(model: nn.Module, rules: Sequence[Rule] = LLAMA_RULES) -> dict[str, torch.Tensor]:
    """``model``'s parameters (a whole, unsharded model) under their transformers names,
    contiguous (experts unstacked and transposed; a tied head written once, as the
    embedding, like transformers)."""
    tied = is_tied([model])
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():  # a tied head is the embedding: skipped
        source = hf_source(rules, name, param.shape, tied=tied)
        if source is None:
            raise ValueError(f"parameter {name!r} has no Hugging Face name (plait.train.hf rules)")
        value = param.detach()
        parts = value.unbind(0) if source.stacked else (value,)
        for key, part in zip(source.keys, parts, strict=True):
            out[key] = (part.t() if source.transpose else part).contiguous()
    return out


def _shards(tensors: Mapping[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Keys in order, cut into groups of at most ``limit`` bytes (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups


def write_weights(directory: Path, tensors: Mapping[str, torch.Tensor], limit: int) -> None:
    """``tensors`` into ``directory``: one ``model.safetensors`` when they fit in ``limit``
    bytes, else numbered shards of at most ``limit`` bytes each (a larger tensor alone) and
    ``model.safetensors.index.json`` naming each tensor's shard, as transformers writes."""
    # Optional (plait[train]): imported only when weights are written.
    save_file = require("safetensors.torch", "plait export").save_file

    groups = _shards(tensors, limit)
    if len(groups) == 1:
        save_file(dict(tensors), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for n, keys in enumerate(groups, start=1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, str(directory / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(keys, name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
