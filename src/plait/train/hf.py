"""Hugging Face weights in and out of ``plait train``: safetensors checkpoints of the Llama
family (Llama, Mistral, Qwen2/3, and the mixture-of-experts Mixtral and Qwen3-MoE).

**Names.** A plait parameter and its transformers tensor(s) are related by rules over
module paths (:data:`LLAMA_RULES`, :data:`MIXTRAL_RULES`): a :class:`Rename` maps a module
of plait to a module of transformers and keeps the parameter's suffix, so ``.weight``
and ``.bias`` (Qwen2's q/k/v biases) and the per-head norms ``attn.q_norm`` /
``attn.k_norm`` (Qwen3's ``self_attn.q_norm``) map without a rule of their own. A
:class:`Stack` fills one plait parameter from one transformers tensor per expert: plait's
routed experts are stacked ``(experts, in, out)`` (:class:`plait.experts.GroupedExperts`:
``x @ w``), transformers keeps one ``nn.Linear`` ``(out, in)`` per expert, so each is
transposed. A tied head (``tie_word_embeddings``) is read from ``model.embed_tokens``.

**Loading** (:func:`load_hf_checkpoint`) goes into the stage modules *after*
:func:`~plait.train.parallelize.parallelize`: each rank reads, tensor by tensor with
``safetensors.safe_open`` (memory-mapped; never the whole model, never a pickle), what
its own parameters need, and copies only its local piece into a DTensor (fully_shard,
tensor parallelism: :func:`plait.fsdp.state_dict.shard_full_tensor` slices the full
tensor without communication), or the whole tensor into a plain parameter. Before
anything is copied, every rank checks the checkpoint against the *whole* model (the same
on every rank, so all ranks refuse together rather than leave peers in a collective):
missing tensors, shape mismatches, tensors the model has no place for, and dtypes it
cannot take (floating weights of any width are cast to the parameter's dtype).

**Exporting** (:func:`export_run`, ``plait export``) loads a run's checkpoint into one
process's whole model and writes a directory ``transformers.AutoModelForCausalLM``
reads: ``config.json``, ``model.safetensors`` (or shards and their index) and the run's
tokenizer files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait.train.config import ConfigError
from plait.train.extras import require
from plait.train.presets import config_object, read_config

__all__ = [
    "LLAMA_RULES",
    "MIXTRAL_RULES",
    "HFCheckpointError",
    "Rename",
    "Source",
    "Stack",
    "check_init_from",
    "export_run",
    "export_state",
    "hf_source",
    "load_hf_checkpoint",
    "parameter_shapes",
    "parse_size",
    "rules_for",
    "with_default_model_config",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
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


# ----------------------------------------------------------------------------------------
# Names
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rename:
    """Module ``plait`` of plait is module ``hf`` of transformers; each parameter under it
    keeps its suffix (``weight``, ``bias``). ``{i}`` stands for a block index."""

    plait: str
    hf: str


@dataclass(frozen=True)
class Stack:
    """Parameter ``plait``, ``(experts, ...)``, stacks one transformers tensor ``hf`` per
    expert ``{j}``, each transposed when ``transpose`` (``nn.Linear``'s ``(out, in)`` into
    plait's ``(in, out)``)."""

    plait: str
    hf: str
    transpose: bool = True


Rule = Rename | Stack

_COMMON: tuple[Rule, ...] = (
    Rename("tok_emb", "model.embed_tokens"),
    Rename("ln_f", "model.norm"),
    Rename("head", "lm_head"),
    Rename("blocks.{i}.ln1", "model.layers.{i}.input_layernorm"),
    Rename("blocks.{i}.ln2", "model.layers.{i}.post_attention_layernorm"),
    Rename("blocks.{i}.attn.q", "model.layers.{i}.self_attn.q_proj"),
    Rename("blocks.{i}.attn.k", "model.layers.{i}.self_attn.k_proj"),
    Rename("blocks.{i}.attn.v", "model.layers.{i}.self_attn.v_proj"),
    Rename("blocks.{i}.attn.proj", "model.layers.{i}.self_attn.o_proj"),
    Rename("blocks.{i}.attn.q_norm", "model.layers.{i}.self_attn.q_norm"),
    Rename("blocks.{i}.attn.k_norm", "model.layers.{i}.self_attn.k_norm"),
    # A dense block's SwiGLU.
    Rename("blocks.{i}.mlp.gate", "model.layers.{i}.mlp.gate_proj"),
    Rename("blocks.{i}.mlp.up", "model.layers.{i}.mlp.up_proj"),
    Rename("blocks.{i}.mlp.down", "model.layers.{i}.mlp.down_proj"),
    # A MoE's shared experts (one SwiGLU; DeepSeek's names): w1 gate, w3 up, w2 down.
    Rename("blocks.{i}.mlp.shared_experts.w1", "model.layers.{i}.mlp.shared_experts.gate_proj"),
    Rename("blocks.{i}.mlp.shared_experts.w3", "model.layers.{i}.mlp.shared_experts.up_proj"),
    Rename("blocks.{i}.mlp.shared_experts.w2", "model.layers.{i}.mlp.shared_experts.down_proj"),
)

#: Llama, Mistral, Qwen2, Qwen3, and Qwen3-MoE's router and experts.
LLAMA_RULES: tuple[Rule, ...] = (
    *_COMMON,
    Rename("blocks.{i}.mlp.router.gate", "model.layers.{i}.mlp.gate"),
    Stack("blocks.{i}.mlp.experts.w1", "model.layers.{i}.mlp.experts.{j}.gate_proj.weight"),
    Stack("blocks.{i}.mlp.experts.w3", "model.layers.{i}.mlp.experts.{j}.up_proj.weight"),
    Stack("blocks.{i}.mlp.experts.w2", "model.layers.{i}.mlp.experts.{j}.down_proj.weight"),
)

#: Mixtral: ``block_sparse_moe``, experts' ``w1`` (gate), ``w3`` (up), ``w2`` (down).
MIXTRAL_RULES: tuple[Rule, ...] = (
    *_COMMON,
    Rename("blocks.{i}.mlp.router.gate", "model.layers.{i}.block_sparse_moe.gate"),
    Stack("blocks.{i}.mlp.experts.w1", "model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight"),
    Stack("blocks.{i}.mlp.experts.w3", "model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight"),
    Stack("blocks.{i}.mlp.experts.w2", "model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight"),
)


def rules_for(hf_config: Mapping[str, Any]) -> tuple[Rule, ...]:
    """The rules of the model a Hugging Face ``config.json`` dict describes."""
    kind = str(hf_config.get("model_type", "llama"))
    return MIXTRAL_RULES if kind == "mixtral" else LLAMA_RULES


@dataclass(frozen=True)
class Source:
    """Where a plait parameter comes from: one transformers tensor, or with ``stacked``
    one per expert (in expert order), each transposed when ``transpose``."""

    keys: tuple[str, ...]
    stacked: bool = False
    transpose: bool = False


_PATTERNS: dict[str, re.Pattern[str]] = {}


def _pattern(template: str) -> re.Pattern[str]:
    found = _PATTERNS.get(template)
    if found is None:
        text = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)")
        found = _PATTERNS[template] = re.compile(text)
    return found


def hf_source(
    rules: Sequence[Rule], name: str, shape: Sequence[int], *, tied: bool = False
) -> Source | None:
    """The transformers tensor(s) of plait parameter ``name`` of shape ``shape`` (the
    global one), or None when no rule names it. ``tied``: the head shares the embedding."""
    if tied and name == "head.weight":
        return Source(("model.embed_tokens.weight",))
    module, _, suffix = name.rpartition(".")
    for rule in rules:
        if isinstance(rule, Rename):
            match = _pattern(rule.plait).fullmatch(module)
            if match:
                return Source((f"{rule.hf.format(**match.groupdict())}.{suffix}",))
        else:
            match = _pattern(rule.plait).fullmatch(name)
            if match and len(shape) == 3:
                keys = tuple(rule.hf.format(j=j, **match.groupdict()) for j in range(shape[0]))
                return Source(keys, stacked=True, transpose=rule.transpose)
    return None


def _hf_shape(source: Source, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape each of ``source``'s tensors must have for a parameter of ``shape``."""
    if not source.stacked:
        return tuple(shape)
    inner = tuple(shape[1:])
    return inner[::-1] if source.transpose else inner


def parameter_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``model`` by name (a tied head included), with its global shape:
    what :func:`load_hf_checkpoint` checks a checkpoint against."""
    return {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}


def _is_tied(modules: Iterable[nn.Module]) -> bool:
    for m in modules:
        cfg = getattr(m, "cfg", None)
        if getattr(cfg, "tie_word_embeddings", False):
            return True
        head, emb = getattr(m, "head", None), getattr(m, "tok_emb", None)
        if head and emb and head.weight is emb.weight:
            return True
    return False


# ----------------------------------------------------------------------------------------
# Reading a checkpoint directory
# ----------------------------------------------------------------------------------------


def _safetensors() -> Any:
    return require("safetensors", "reading or writing Hugging Face checkpoints")


def _weight_map(directory: Path) -> dict[str, Path]:
    """Each tensor's file in checkpoint ``directory``: the index's map, or every tensor of
    the one ``model.safetensors``."""
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


@torch.no_grad()
def _copy_into(param: torch.Tensor, full: torch.Tensor, name: str) -> None:
    """``full`` (the global value) into ``param``: this rank's piece of a DTensor, else all
    of it; cast to the parameter's dtype and moved to its device."""
    if isinstance(param, DTensor):
        from plait.fsdp.state_dict import shard_full_tensor

        local = param.to_local()
        piece = shard_full_tensor(full, param).to_local()
        if local.shape != piece.shape:  # a layout this function does not know
            raise RuntimeError(
                f"{name}: this rank's shard is {tuple(local.shape)} but its piece of the "
                f"checkpoint tensor is {tuple(piece.shape)} (placements {param.placements})"
            )
        local.copy_(piece)
    else:
        param.copy_(full)


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
    files = _weight_map(directory)
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
    tied = _is_tied(modules) if tied is None else tied
    plan = _plan(shapes, files, rules, tied, directory)
    with _readers() as readers:
        _check_tensors(plan, shapes, files, readers, directory)
        # File by file (the file of each parameter's first tensor): each file's pages are
        # touched together.
        order = sorted(params, key=lambda n: (str(files[plan[n].keys[0]]), n))
        for name in order:
            _copy_into(params[name], _read(plan[name], files, readers), name)
    return order


# ----------------------------------------------------------------------------------------
# plait train --init-from
# ----------------------------------------------------------------------------------------

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


def with_default_model_config(cfg: Any) -> Any:
    """``cfg`` (a TrainConfig) with ``--model-config`` defaulting to ``--init-from``'s
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


def check_init_from(cfg: Any) -> list[str]:
    """Refuse an ``--init-from`` that cannot load into ``cfg``'s model (a TrainConfig):
    the GPT (no ``--model-config``), or a directory whose ``config.json`` describes other
    shapes. Returns warnings about settings that differ without changing a shape (rope
    theta, norm epsilon). Nothing to check when resuming: the run's checkpoint wins."""
    if not cfg.init_from or cfg.resume:
        return []
    from plait.train.layout import llama_config
    from plait.train.llama import LlamaConfig, LlamaConfigError

    if not cfg.model_config:
        raise ConfigError(
            f"--init-from {cfg.init_from} loads a Hugging Face model, but this run trains "
            "plait's GPT (no --model-config): give --model-config, or leave it out on the "
            "command line to use the directory's config.json"
        )
    directory = Path(cfg.init_from)
    if not directory.is_dir():
        raise ConfigError(f"--init-from {directory}: no such directory")
    _weight_map(directory)  # refuses a directory without safetensors weights
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


# ----------------------------------------------------------------------------------------
# plait export
# ----------------------------------------------------------------------------------------

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
    tied = _is_tied([model])
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


def _write_weights(directory: Path, tensors: Mapping[str, torch.Tensor], limit: int) -> None:
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


def _checkpoint_of(run_dir: Path, step: int | None) -> Path:
    from plait.train.checkpointing import list_checkpoints

    found = list_checkpoints(run_dir)
    if not found:
        raise ConfigError(f"--run-dir {run_dir} holds no checkpoint; train first (plait train)")
    if step is None:
        return found[-1]
    for path in found:
        if int(path.name.split("_")[1]) == step:
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
    from plait.train.layout import model_config_bytes
    from plait.train.presets import RUN_FILE

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
    from plait.train.llama import FAMILIES

    kind = str(config.setdefault("model_type", "llama"))
    config.setdefault("architectures", [FAMILIES.get(kind, "LlamaForCausalLM")])
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if "dtype" in config:  # transformers 5's name for it: the two must agree
        config["dtype"] = config["torch_dtype"]
    config["tie_word_embeddings"] = _is_tied([model])
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
    from plait.train.checkpointing import load_weights, read_info, verify_checkpoint
    from plait.train.config import from_mapping
    from plait.train.loop import build_model

    run_dir, out = Path(run_dir), Path(out_dir)
    limit = parse_size(max_shard_size)
    checkpoint = _checkpoint_of(run_dir, step)
    config = read_info(checkpoint).config
    if not config.get("model_config"):
        raise ConfigError(
            f"--run-dir {run_dir} trained plait's GPT, which transformers has no class for: "
            "plait export writes Llama-family runs (plait train --model-config)"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not empty: choose a new directory")
    model_config = _source_config(config, run_dir)
    verify_checkpoint(checkpoint)
    model = build_model(from_mapping(config))
    load_weights(checkpoint, model, verify=False)
    hf_config = _hf_config(model_config, model, next(model.parameters()).dtype)
    tensors = export_state(model, rules_for(hf_config))
    tokenizer = str(config.get("tokenizer", "") or "")
    copies = _tokenizer_files(tokenizer) if tokenizer else []

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_weights(tmp, tensors, limit)
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
