"""``plait export``: a run's checkpoint as a Hugging Face model directory.

:func:`export_run` loads a run's checkpoint, of any layout, into one process's whole
model and writes a directory ``transformers.AutoModelForCausalLM`` reads:
``config.json``, ``model.safetensors`` (or shards and their index) and the run's
tokenizer files.

A command, above the library it uses: it builds the model as training does
(:func:`plait.train.loop.build_model`) and writes its weights with
:mod:`plait.train.hf_save`, so it imports the loop; nothing in the library imports it
(only :mod:`plait.train.cli` and tests), which keeps the loop free to import the loading
half (:mod:`plait.train.hf`) without a circle.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

# The module, not its functions: checkpointing's functions are looked up at call time, so
# a test that patches one (e.g. read_info) sees export use the patched one.
from plait.train import checkpointing
from plait.train.config import ConfigError, from_mapping
from plait.train.hf_names import CONFIG_FILE, is_tied, rules_for
from plait.train.hf_save import export_state, parse_size, write_weights
from plait.train.llama import FAMILIES
from plait.train.loop import build_model
from plait.train.materialize import empty_model
from plait.train.presets import RUN_FILE, config_object
from plait.train.resolve import model_config_bytes

__all__ = ["export_run"]

#: A tokenizer's files, as transformers saves them: ``tokenizer.json`` first (required),
#: then the optional settings files copied when they stand beside it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _checkpoint_of(run_dir: Path, step: int | None) -> Path:
    found = checkpointing.list_checkpoints(run_dir)
    if not found:
        raise ConfigError(f"--run-dir {run_dir} holds no checkpoint; train first (plait train)")
    if step is None:
        return found[-1]
    for path in found:
        if checkpointing.checkpoint_step(path) == step:
            return path
    steps = ", ".join(p.name.split("_")[1].lstrip("0") or "0" for p in found)
    raise ConfigError(f"--step {step}: {run_dir} has no checkpoint of it (it has steps {steps})")


def _tokenizer_files(tokenizer: str) -> list[tuple[Path, str]]:
    """(source, name in the export) of a run's tokenizer: ``tokenizer.json`` (the path, or
    in the directory it names) and the optional files beside it."""
    path = Path(tokenizer)
    main = path / "tokenizer.json" if path.is_dir() else path
    if not main.is_file():
        raise ConfigError(f"the run's tokenizer {tokenizer}: no {main} to export")
    found = [(main, "tokenizer.json")]
    for name in TOKENIZER_FILES[1:]:
        if (main.parent / name).is_file():
            found.append((main.parent / name, name))
    return found


def _source_config(train_config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The ``config.json`` the run trained, checked against its ``model_hash``: the copy
    in the run directory (:data:`plait.train.presets.RUN_FILE`), else the run's
    ``--model-config`` (a file or a preset). ``train_config["model_config"]`` is pointed
    at what was read, so the model is built from the same bytes."""
    recorded = run_dir / RUN_FILE
    source = str(recorded) if recorded.is_file() else str(train_config["model_config"])
    try:
        data = model_config_bytes(source)
    except ConfigError as err:
        raise ConfigError(
            f"the run's model configuration is gone ({err}): plait export needs it to "
            "describe the model; put it back"
        ) from err
    digest = hashlib.sha256(data).hexdigest()
    if train_config.get("model_hash") and digest != train_config["model_hash"]:
        raise ConfigError(
            f"the run's model configuration {source} changed since the run trained (its "
            "sha256 differs): restore the file the run was trained with"
        )
    train_config["model_config"] = source
    return config_object(data, source, ConfigError)


def _hf_config(config: dict[str, Any], model: nn.Module, dtype: torch.dtype) -> dict[str, Any]:
    """``config`` (the run's ``--model-config``) with what transformers needs to pick the
    class and dtype."""
    kind = str(config.setdefault("model_type", "llama"))
    config.setdefault("architectures", [FAMILIES.get(kind, "LlamaForCausalLM")])
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if "dtype" in config:  # transformers 5's name for it: the two must agree
        config["dtype"] = config["torch_dtype"]
    config["tie_word_embeddings"] = is_tied([model])
    return config


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    step: int | None = None,
    max_shard_size: str | int = "5GB",
) -> Path:
    """Write checkpoint ``step`` (default: the latest) of the run in ``run_dir`` as a
    Hugging Face model directory ``out_dir``: ``config.json``, ``model.safetensors`` (or
    shards of at most ``max_shard_size`` and ``model.safetensors.index.json``) and the
    run's tokenizer files if it has one. The checkpoint may be of any layout: it is loaded
    into one process's whole model on the CPU. ``out_dir`` appears complete or not at all
    (written beside it, then renamed). Refuses a run of plait's GPT (not a transformers
    model) and an ``out_dir`` that is not empty. Returns ``out_dir``."""
    run_dir, out = Path(run_dir), Path(out_dir)
    limit = parse_size(max_shard_size)
    checkpoint = _checkpoint_of(run_dir, step)
    config = checkpointing.read_info(checkpoint).config
    if not config.get("model_config"):
        raise ConfigError(
            f"--run-dir {run_dir} trained plait's GPT, which transformers has no class for: "
            "plait export writes Llama-family runs (plait train --model-config)"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not empty: choose a new directory")
    model_config = _source_config(config, run_dir)
    checkpointing.verify_checkpoint(checkpoint)
    model = empty_model(lambda: build_model(from_mapping(config)))  # the checkpoint fills it
    checkpointing.load_weights(checkpoint, model, verify=False)
    hf_config = _hf_config(model_config, model, next(model.parameters()).dtype)
    tensors = export_state(model, rules_for(hf_config))
    tokenizer = str(config.get("tokenizer", "") or "")
    copies = _tokenizer_files(tokenizer) if tokenizer else []

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_weights(tmp, tensors, limit)
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        for source, name in copies:
            shutil.copyfile(source, tmp / name)
        if out.exists():
            out.rmdir()  # empty: checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
