"""Checkpoints of a run: DCP files written atomically, the last N kept, loaded without pickle.

Layout, under ``<run_dir>/checkpoints/``::

    step_000100/          a complete checkpoint: plait.json, DCP's files, manifest.json
    step_000200/
    .tmp-step_000300/     a save in progress (or one that crashed): never loaded

A save writes into a ``.tmp-`` directory and renames it into place only once every rank's
files are on disk and the manifest (size and SHA-256 of every file, :mod:`.manifest`)
is written last, so a crash at any moment leaves the previous checkpoint intact; older
checkpoints beyond ``keep`` are deleted only after that rename. Loading first checks the
files against the manifest (:class:`~plait.train.manifest.CheckpointDamaged` names what
is wrong) and, given the run's model settings, that the checkpoint holds that model
(``ConfigError`` naming the setting), before anything is loaded.

The collectives of saving and loading run over :func:`checkpoint_group`, a gloo group whose
timeout allows for slow storage, so that the training collectives' short fault timeout
(``--fault-timeout``) does not fail a large checkpoint's save.

What is saved, keyed by parameter name (FQN), so DCP can reshard on load:

* ``model.<fqn>``: parameters as this rank holds them (DTensor shards under
  ``fully_shard`` or tensor parallelism, full tensors under ``replicate``, only its own
  stages with a pipeline). A matrix held under two names (a head tied to the token
  embedding) is saved once, under its first name; so is a pipeline stage's copy of it,
  which its module names with :func:`save_as`: pipelined and one-process runs of a tied
  model read each other's checkpoints;
* ``optim.<fqn>.<key>``: the optimizer's per-parameter state (AdamW's ``step``,
  ``exp_avg``, ``exp_avg_sq``, shaped like the parameter), independent of param order;
* ``rng.rank<r>.<device>``: each rank's RNG state, restored only into the same world size;
* ``plait.json``: the step reached (which is also the data position: batches are a
  function of the step) and the run's configuration, as JSON.

Loading never unpickles arbitrary objects: DCP's own metadata file is read with an
unpickler that admits only DCP's metadata classes, and DCP entries that are not tensors
(which DCP would load with ``torch.load(weights_only=False)``) are refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from plait import spmd
from plait.train.config import DEFAULTS, ConfigError, flag
from plait.train.faults import strike_in_checkpoint
from plait.train.manifest import CheckpointDamaged, verify_manifest, write_manifest
from plait.train.safe_dcp import SafeFileSystemReader, TensorsOnlyPlanner

__all__ = [
    "CheckpointDamaged",
    "CheckpointInfo",
    "Loader",
    "barrier",
    "check_settings",
    "checkpoint_group",
    "checkpoint_state",
    "checkpoint_step",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_weights",
    "publishing",
    "read_info",
    "save_as",
    "saved_names",
    "verify_checkpoint",
    "write_checkpoint",
]

_NAME = re.compile(r"^step_(\d+)$")
_INFO = "plait.json"
_OPTIM_KEYS = ("step", "exp_avg", "exp_avg_sq")  # AdamW's per-parameter state
_SLOW_STORAGE = timedelta(minutes=10)  # the least patience of checkpoint collectives


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``plait.json`` records: where the run was and how it was configured."""

    step: int
    world_size: int
    config: dict[str, Any]


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Published checkpoints of the run, oldest first (temporary directories excluded;
    whether their files are intact is for :func:`verify_checkpoint` to say)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    """The step of checkpoint ``path`` (``step_000040``: 40), read from its name."""
    return int(path.name.split("_")[1])


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def read_info(path: Path) -> CheckpointInfo:
    with open(path / _INFO) as f:
        raw = json.load(f)
    return CheckpointInfo(int(raw["step"]), int(raw["world_size"]), dict(raw["config"]))


def verify_checkpoint(path: Path, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`CheckpointDamaged` if a file of ``path`` is missing, truncated or
    corrupted (collective over ``group``)."""
    verify_manifest(path, group)


def check_settings(
    path: Path, expected: Mapping[str, Any], config: Mapping[str, Any] | None = None
) -> None:
    """Raise ``ConfigError`` naming each setting in ``expected`` (e.g. the model's
    ``d_model``) that checkpoint ``path`` was saved with a different value of (its
    configuration ``config``, by default read from it)."""
    config = read_info(path).config if config is None else config
    # A setting newer than the checkpoint had, when it was saved, its default value.
    saved = {k: config.get(k, getattr(DEFAULTS, k, None)) for k in expected}
    wrong = [(k, saved[k], v) for k, v in expected.items() if saved[k] != v]
    if not wrong:
        return
    described = ", ".join(f"{k} {s} (this run: {_option(k)} {v})" for k, s, v in wrong)
    raise ConfigError(
        f"checkpoint {path} was saved from a different model: {described}. A checkpoint "
        "loads only into the model it was saved from: drop those flags to continue the run "
        "as it was saved, or start a new run in another --run-dir"
    )


def _option(setting: str) -> str:
    """The flag that sets ``setting`` (the model file's hash: its ``--model-config``)."""
    return "--model-config with content" if setting == "model_hash" else flag(setting)


def checkpoint_group(fault_timeout: float) -> dist.ProcessGroup | None:
    """A gloo group of every rank for checkpoint collectives (None without a process
    group), waiting at least ten minutes: storage may be slower than any training step.
    Collective: every rank calls it."""
    if not dist.is_initialized():
        return None
    timeout = max(_SLOW_STORAGE, timedelta(seconds=fault_timeout))
    return dist.new_group(backend="gloo", timeout=timeout)


# ----------------------------------------------------------------------------------------
# What goes into a checkpoint
# ----------------------------------------------------------------------------------------


_SAVED_AS = "_plait_saved_as"  # a module's {state-dict name: key it is saved under}


def save_as(module: nn.Module, name: str, key: str) -> None:
    """Save (and load) ``module``'s tensor ``name`` under ``key``: a pipeline stage's copy
    of a matrix that the whole model holds under ``key`` (a head tied to the embedding)."""
    setattr(module, _SAVED_AS, {**getattr(module, _SAVED_AS, {}), name: key})


def saved_names(module: nn.Module) -> dict[str, str]:
    """What :func:`save_as` set on ``module``: {its name of a tensor: the whole model's}."""
    return dict(getattr(module, _SAVED_AS, {}))


def _keys(module: nn.Module) -> dict[str, str]:
    """Each state-dict name of ``module`` -> the key it is saved under: the first name of
    its tensor (a tied head: the embedding's), or what :func:`save_as` set."""
    saved_as = saved_names(module)
    first: dict[int, str] = {}
    keys: dict[str, str] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        shared = first.setdefault(id(tensor), name) if isinstance(tensor, nn.Parameter) else name
        keys[name] = saved_as.get(name, shared)
    return keys


def _optim_params(modules: Sequence[nn.Module]) -> dict[str, list[nn.Parameter]]:
    """Each optimizer key -> this rank's parameters saved under it (two for a tied
    matrix's copies when both pipeline stages are on this rank)."""
    found: dict[str, list[nn.Parameter]] = {}
    for m in modules:
        keys = _keys(m)
        for name, p in m.named_parameters():
            found.setdefault(keys[name], []).append(p)
    return found


def _model_state(modules: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for m in modules:
        tensors = m.state_dict()
        state.update({key: tensors[name] for name, key in _keys(m).items()})
    return state


def _optim_state(
    modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer, create: bool
) -> dict[str, dict[str, torch.Tensor]]:
    """Per-parameter optimizer state keyed by FQN; with ``create``, zeros where the
    optimizer has none yet (a fresh optimizer being loaded into)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, params in _optim_params(modules).items():
        # A second copy's entry is made too; the first's is what is saved and loaded.
        entries = [_optim_entry(optimizer, param, create) for param in params]
        entry = entries[0]
        if entry:
            state[name] = {key: entry[key] for key in _OPTIM_KEYS}
    return state


def _optim_entry(
    optimizer: torch.optim.Optimizer, param: nn.Parameter, create: bool
) -> dict[str, torch.Tensor] | None:
    entry = optimizer.state.get(param)
    if not entry and create:
        entry = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(param.detach()),
            "exp_avg_sq": torch.zeros_like(param.detach()),
        }
        optimizer.state[param] = entry
    return entry or None


def _copy_optim_state(modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer) -> None:
    """After a load: a second copy of a tied matrix on this rank takes the first's state."""
    for params in _optim_params(modules).values():
        for param in params[1:]:
            for key in _OPTIM_KEYS:
                optimizer.state[param][key].copy_(optimizer.state[params[0]][key])


def _rng_state(device: str) -> dict[str, torch.Tensor]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = {f"rank{rank}.cpu": torch.get_rng_state()}
    if device == "cuda":
        state[f"rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return state


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@contextmanager
def _single_process_is_fine() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process, which is the case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def barrier(group: dist.ProcessGroup | None, what: str, background: bool = False) -> None:
    """Wait for every rank of ``group`` (a checkpoint group) at ``what``; ``background``:
    off the training thread (its barriers wait plainly, without the divergence checker)."""
    if group is None:
        return
    work = dist.barrier(group=group, async_op=True)
    if background:  # spmd's one waiter thread serves the training thread's collectives
        work.wait()
    else:
        spmd.wait(work, f"barrier at {what}")


# ----------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------


def checkpoint_state(
    modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer, device: str
) -> dict[str, Any]:
    """What a checkpoint of this rank holds (module docstring): its parameters and
    optimizer state (the live tensors, not copies) and its RNG states."""
    return {
        "model": _model_state(modules),
        "optim": _optim_state(modules, optimizer, create=False),
        "rng": _rng_state(device),
    }


def write_checkpoint(
    run_dir: str | Path,
    step: int,
    state: dict[str, Any],
    config: dict[str, Any],
    keep: int,
    group: dist.ProcessGroup | None = None,
    *,
    background: bool = False,
) -> Path:
    """Write ``state`` (:func:`checkpoint_state`, or a staged copy of it) as the checkpoint
    of step ``step``: into ``.tmp-step_N``, the manifest last, then renamed into place and
    the checkpoints beyond the newest ``keep`` deleted. Collective over ``group``.
    ``background``: called off the training thread (``--async-checkpoint``), whose
    divergence checker it must not share, so its barriers wait plainly."""
    with publishing(run_dir, step, config, group, _is_rank0(), keep, background) as tmp:
        with _single_process_is_fine():  # returns on every rank once all files are written
            dcp_save(state, checkpoint_id=str(tmp), process_group=group)
        strike_in_checkpoint(step)  # test-only (plait.train.faults): a kill mid-write
        write_manifest(tmp, group)  # the last file: it describes all the others
    return checkpoints_dir(run_dir) / f"step_{step:06d}"


@contextmanager
def publishing(
    root: str | Path,
    step: int,
    config: dict[str, Any],
    group: dist.ProcessGroup | None,
    leader: bool,
    keep: int,
    background: bool,
) -> Iterator[Path]:
    """Save step ``step`` under ``root`` atomically (a checkpoint, or a machine's snapshot):
    the ``leader`` (rank 0; a machine's first rank for a snapshot) prepares the ``.tmp-``
    directory with ``plait.json``; every rank writes its files into the directory it is
    given; then, once every rank is done, the leader renames it into place and deletes all
    but the newest ``keep``. Collective over ``group`` (``background``: as
    :func:`barrier`). A body that raises leaves the ``.tmp-`` directory unpublished."""
    final = checkpoints_dir(root) / f"step_{step:06d}"
    tmp = final.with_name(f".tmp-{final.name}")
    if leader:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save
        tmp.mkdir(parents=True)
        _write_json(tmp / _INFO, {"step": step, "world_size": _world_size(), "config": config})
    barrier(group, f"the start of {final}", background)
    yield tmp
    barrier(group, f"every rank's files of {final}", background)
    if leader:
        _publish(tmp, final)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(group, f"the end of {final}", background)


def _write_json(path: Path, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``; an existing ``final`` is replaced only
    after the new one is in place."""
    stale = final.with_name(f".old-{final.name}")
    if final.exists():
        final.rename(stale)
    tmp.rename(final)
    directory = os.open(final.parent, os.O_RDONLY)
    try:  # make the rename itself durable
        os.fsync(directory)
    finally:
        os.close(directory)
    shutil.rmtree(stale, ignore_errors=True)


# ----------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------


def load_checkpoint(
    path: Path,
    modules: Sequence[nn.Module],
    optimizer: torch.optim.Optimizer,
    device: str,
    *,
    expected: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> CheckpointInfo:
    """Load ``path`` into ``modules`` and ``optimizer`` (in place; collective over
    ``group``).

    First, before anything is loaded: the files are checked against the manifest
    (:class:`CheckpointDamaged`), and the settings in ``expected`` (the model's, such as
    ``d_model``) against the checkpoint's (``ConfigError``). RNG states are restored only
    when the world size matches the saving run's; parameters and optimizer state load into
    any layout (DCP reshards).
    """
    verify_checkpoint(path, group)
    check_settings(path, expected or {})
    return load_state(read_info(path), modules, optimizer, device, partial(_dcp_load, path, group))


class Loader(Protocol):
    """What loads a saved state into a session: :func:`load_checkpoint`, and
    :func:`~plait.train.snapshots.load_snapshot` with the same contract."""

    def __call__(
        self,
        path: Path,
        modules: Sequence[nn.Module],
        optimizer: torch.optim.Optimizer,
        device: str,
        *,
        expected: Mapping[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> CheckpointInfo: ...


def load_state(
    info: CheckpointInfo,
    modules: Sequence[nn.Module],
    optimizer: torch.optim.Optimizer,
    device: str,
    read: Callable[[dict[str, Any]], None],
) -> CheckpointInfo:
    """Fill ``modules`` and ``optimizer`` from a saved state (``info``: what was saved):
    ``read`` loads it, in place, into the live state it is given (the model's tensors, the
    optimizer's, created where missing, and with the saving run's world size the RNG
    states: the shape :func:`checkpoint_state` saves); then tied copies and RNGs follow."""
    state: dict[str, Any] = {
        "model": _model_state(modules),
        "optim": _optim_state(modules, optimizer, create=True),
    }
    same_world = info.world_size == _world_size()
    if same_world:
        state["rng"] = _rng_state(device)
    read(state)
    for m in modules:
        m.load_state_dict({name: state["model"][key] for name, key in _keys(m).items()})
    _copy_optim_state(modules, optimizer)
    if same_world:
        for key, value in state["rng"].items():
            if key.endswith(".cpu"):
                torch.set_rng_state(value)
            else:
                torch.cuda.set_rng_state(value)
    return info


def _dcp_load(path: Path, group: dist.ProcessGroup | None, state: dict[str, Any]) -> None:
    reader = SafeFileSystemReader(str(path))
    # Read once up front, so a refused metadata file raises its own clear error here
    # rather than inside DCP's collective plan (which wraps it in a rank report).
    reader.read_metadata()
    with _single_process_is_fine():
        planner = TensorsOnlyPlanner()
        dcp_load(state, storage_reader=reader, planner=planner, process_group=group)


def load_weights(path: Path, module: nn.Module, *, verify: bool = True) -> None:
    """Load only the parameters of checkpoint ``path`` into ``module`` (any layout, e.g. a
    plain single-process model from a sharded run's checkpoint), in this process alone.
    ``verify=False``: the caller has already called :func:`verify_checkpoint`."""
    if verify:
        verify_checkpoint(path)
    state = {"model": _model_state([module])}
    _dcp_load(path, None, state)
    module.load_state_dict({name: state["model"][key] for name, key in _keys(module).items()})
