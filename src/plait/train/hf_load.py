"""Loading a Hugging Face safetensors checkpoint into each rank's shards of the model.

:func:`load_hf_checkpoint` goes into the stage modules *after*
:func:`~plait.train.parallelize.parallelize`: each rank reads, tensor by tensor with
``safetensors.safe_open`` (memory-mapped; never the whole model, never a pickle), what
its own parameters need, and copies only its local piece into a DTensor (fully_shard,
tensor parallelism: :func:`plait.train.param_init.copy_into` slices the full tensor
without communication), or the whole tensor into a plain parameter. Before
anything is copied, every rank checks the checkpoint against the *whole* model (the same
on every rank, so all ranks refuse together rather than leave peers in a collective):
missing tensors, shape mismatches, tensors the model has no place for, and dtypes it
cannot take (floating weights of any width are cast to the parameter's dtype). Which
tensor fills which parameter is :mod:`plait.train.hf_names`'s to say.

safetensors is an optional package (``plait[train]``): it is imported when a checkpoint
is read, through :func:`plait.train.extras.require`, so a missing one is a ConfigError.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.train.config import ConfigError
from plait.train.extras import require
from plait.train.hf_names import (
    CONFIG_FILE,
    INDEX_FILE,
    WEIGHTS_FILE,
    Rule,
    Source,
    hf_source,
    is_tied,
    rules_for,
)
from plait.train.param_init import copy_into
from plait.train.presets import read_config

__all__ = ["HFCheckpointError", "load_hf_checkpoint", "weight_map"]

#: Tensors a checkpoint may hold that no model parameter takes (recomputed from the config).
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
#: safetensors dtype names of floating weights, which load cast to the parameter's dtype.
FLOAT_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


class HFCheckpointError(ConfigError):
    """A Hugging Face checkpoint that does not fit the model; names the tensor, the file
    and the fix. A :class:`ConfigError`, so ``plait train`` reports it as a setting to fix."""


def _hf_shape(source: Source, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape each of ``source``'s tensors must have for a parameter of ``shape``."""
    if not source.stacked:
        return tuple(shape)
    inner = tuple(shape[1:])
    return inner[::-1] if source.transpose else inner


def _safetensors() -> Any:
    # Optional (plait[train]): imported at the first read, so a run that loads no
    # checkpoint never needs it.
    return require("safetensors", "reading or writing Hugging Face checkpoints")


def weight_map(directory: Path) -> dict[str, Path]:
    """Each tensor's file in checkpoint ``directory``: the index's map, or every tensor of
    the one ``model.safetensors``. :class:`HFCheckpointError` for a directory that holds
    neither (naming pickled ``*.bin`` weights if it has those) or a broken index."""
    index, single = directory / INDEX_FILE, directory / WEIGHTS_FILE
    if index.is_file():
        try:
            raw = json.loads(index.read_text())
            mapping = raw["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise HFCheckpointError(
                f"{index}: not a safetensors index (no weight_map): {err}"
            ) from err
        files = {key: directory / str(file) for key, file in mapping.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise HFCheckpointError(f"{index} names {path.name}, which is not in {directory}")
        return files
    if single.is_file():
        with _safetensors().safe_open(str(single), framework="pt") as f:
            return {key: single for key in f.keys()}  # noqa: SIM118 (a reader, not a dict)
    if not directory.is_dir():
        raise HFCheckpointError(f"{directory}: no such directory")
    legacy = [p.name for p in directory.glob("*.bin")]
    hint = (
        f" ({', '.join(legacy)}: pickled weights, which plait does not load; convert them with "
        "transformers' save_pretrained(..., safe_serialization=True))"
        if legacy
        else ""
    )
    raise HFCheckpointError(f"{directory} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")


class _Readers:
    """Open safetensors files, each opened once, on first use (memory-mapped)."""

    def __init__(self, stack: ExitStack) -> None:
        self._stack = stack
        self._open: dict[Path, Any] = {}

    def __call__(self, path: Path) -> Any:
        reader = self._open.get(path)
        if reader is None:
            handle = _safetensors().safe_open(str(path), framework="pt")
            reader = self._open[path] = self._stack.enter_context(handle)
        return reader


@contextmanager
def _readers() -> Iterator[_Readers]:
    with ExitStack() as stack:
        yield _Readers(stack)


def _plan(
    shapes: Mapping[str, Sequence[int]],
    files: Mapping[str, Path],
    rules: Sequence[Rule],
    tied: bool,
    directory: Path,
) -> dict[str, Source]:
    """Each parameter's source, after checking that the checkpoint holds every tensor the
    model needs and nothing it has no place for."""
    plan: dict[str, Source] = {}
    missing: list[str] = []
    for name, shape in shapes.items():
        source = hf_source(rules, name, shape, tied=tied)
        if source is None:
            raise HFCheckpointError(
                f"parameter {name!r} of the model has no Hugging Face name: plait.train.hf's "
                "rules do not cover this model"
            )
        plan[name] = source
        missing += [f"{key} (for {name})" for key in source.keys if key not in files]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise HFCheckpointError(
            f"--init-from {directory}: the checkpoint has no tensor {shown}. Is it a checkpoint "
            "of this model? Its config.json must describe the --model-config model"
            + (
                " (tie_word_embeddings false needs lm_head.weight)"
                if "lm_head.weight" in shown
                else ""
            )
        )
    wanted = {key for source in plan.values() for key in source.keys}
    harmless = {"lm_head.weight"} if tied else set()
    extra = sorted(
        key
        for key in files
        if key not in wanted and key not in harmless and not key.endswith(HARMLESS_SUFFIXES)
    )
    if extra:
        shown = ", ".join(f"{key} ({files[key].name})" for key in extra[:5])
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise HFCheckpointError(
            f"--init-from {directory}: the model has no place for tensor {shown}{more}: the "
            "checkpoint is of a different model (e.g. more layers, biases or per-head norms "
            "the --model-config model lacks); use a --model-config that matches it, e.g. its "
            "own config.json"
        )
    return plan


def _check_tensors(
    plan: Mapping[str, Source],
    shapes: Mapping[str, Sequence[int]],
    files: Mapping[str, Path],
    readers: _Readers,
    directory: Path,
) -> None:
    """Shapes and dtypes of every tensor the model reads, from the files' headers."""
    for name, source in plan.items():
        want = _hf_shape(source, shapes[name])
        for key in source.keys:
            piece = readers(files[key]).get_slice(key)
            shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
            where = f"--init-from {directory}: tensor {key} ({files[key].name})"
            if shape != want:
                raise HFCheckpointError(
                    f"{where} has shape {list(shape)}, but the model's {name} needs "
                    f"{list(want)}: the checkpoint's config.json and --model-config describe "
                    "different models; use a --model-config that matches the checkpoint"
                )
            if dtype not in FLOAT_DTYPES:
                raise HFCheckpointError(
                    f"{where} is {dtype}, which a float parameter cannot take (a quantized "
                    f"checkpoint?): plait loads {', '.join(FLOAT_DTYPES)} weights; dequantize "
                    "the checkpoint first"
                )


def _read(source: Source, files: Mapping[str, Path], readers: _Readers) -> torch.Tensor:
    """The full value of a parameter: its tensor, or its experts' stacked (one parameter
    at a time: the peak is one parameter's worth of memory)."""
    tensors = [readers(files[key]).get_tensor(key) for key in source.keys]
    if source.transpose:
        tensors = [t.t() for t in tensors]
    return torch.stack(tensors) if source.stacked else tensors[0]


def load_hf_checkpoint(
    modules: Sequence[nn.Module],
    directory: str | Path,
    *,
    expected: Mapping[str, Sequence[int]] | None = None,
    tied: bool | None = None,
    rules: Sequence[Rule] | None = None,
) -> list[str]:
    """Copy the safetensors checkpoint in ``directory`` (``model.safetensors``, or
    ``model.safetensors.index.json`` and its shards) into ``modules``, this rank's stage
    modules (already parallelized; plain modules too). Returns the names loaded here.

    ``expected``: every parameter of the *whole* model with its global shape
    (:func:`parameter_shapes` of the model before it was split); the checkpoint is checked
    against it, so every rank refuses the same checkpoint. Default: the parameters of
    ``modules`` (enough for one process). ``tied``: whether the head shares the token
    embedding (default: the model's ``cfg.tie_word_embeddings``). ``rules``: the name
    rules (default: by the ``model_type`` of ``directory``'s config.json).

    Raises :class:`HFCheckpointError` naming the tensor, its file and the fix for a
    missing tensor, a shape mismatch, an unexpected tensor or a non-float dtype; nothing
    is copied then. Buffers (rotary frequencies, balancing biases) are not loaded.
    """
    directory = Path(directory)
    files = weight_map(directory)
    if rules is None:
        config = directory / CONFIG_FILE
        rules = rules_for(read_config(config, str(config), ConfigError) if config.is_file() else {})
    params = {n: p for m in modules for n, p in m.named_parameters(remove_duplicate=False)}
    shapes = (
        dict(expected) if expected is not None else {n: tuple(p.shape) for n, p in params.items()}
    )
    unknown = sorted(set(params) - set(shapes))
    if unknown:
        raise ValueError(f"load_hf_checkpoint: parameters {unknown[:3]} are not in expected")
    tied = is_tied(modules) if tied is None else tied
    plan = _plan(shapes, files, rules, tied, directory)
    with _readers() as readers:
        _check_tensors(plan, shapes, files, readers, directory)
        # File by file (the file of each parameter's first tensor): each file's pages are
        # touched together.
        order = sorted(params, key=lambda n: (str(files[plan[n].keys[0]]), n))
        for name in order:
            copy_into(params[name], _read(plan[name], files, readers), name)
    return order
