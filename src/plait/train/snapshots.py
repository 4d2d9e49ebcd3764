"""Snapshots (``--snapshot-every N``): each rank's state every ``N`` steps in its machine's
memory, and a copy on the next machine, for a restart to continue from with at most ``N``
steps redone.

A checkpoint to the run directory (``--ckpt-every``) is durable and reshardable, but costs
a write to shared storage, so runs take one every few hundred steps, and a failed worker
then costs every step since. A snapshot is what a restart needs and no more: each rank
writes the tensors it holds of the checkpoint's state (its parameter shards, optimizer
state and RNG states: :func:`~plait.train.checkpointing.checkpoint_state`) with
``torch.save`` into one file of its own, in a directory in shared memory on its machine
(:func:`snapshot_root`: ``/dev/shm``, a RAM file system, or ``PLAIT_SNAPSHOT_DIR``),
synchronously or, with ``--async-checkpoint``, from the staged copy in the background.
On a job over several machines (torchrun's ``LOCAL_WORLD_SIZE`` below the world) each rank
also sends its file to the rank of the same local rank on the next machine, which keeps it
beside its own (FT-FSDP's replication, over the checkpoint group). A snapshot is written
into a ``.tmp-`` directory that each machine's first rank renames into place once every
rank's files are written (:func:`write_snapshot`), and only the newest is kept.

It outlives the workers (a killed or failed process, a restart by ``--max-restarts``, on
every machine of the job), and one machine: a restart, or ``--resume`` on the same
machines, continues from the newest of the run's checkpoints and the snapshots any machine
holds (:func:`plait.train.restart.resumable`). Each rank loads its own file, or, if its
machine lost it (replaced), the copy the next machine keeps, sent to it; a snapshot is
loaded only when every rank has its file, of the same world size, model and shapes
(:func:`load_snapshot`, collective: all load, or none and the previous is tried), so two
lost neighbours, or another layout, fall back to the newest checkpoint. A step due for
both gets the checkpoint. Snapshots hold up to two copies of each rank's state in memory
(the newest is kept while the next is written; on several machines twice that, with the
copies kept): a file system without room for them is refused before the first
(:class:`~plait.train.checkpointer.Checkpointer`). The run removes its snapshots when it
ends (its last checkpoint is newer); a new run in a run directory that holds one is
refused, as over a checkpoint. Replica groups (``--replica-groups``) heal a restarted group
from a live one, which redoes only the step it died in: snapshots are refused there
(:func:`check_snapshots`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait.train.checkpointing import (
    CheckpointDamaged,
    CheckpointInfo,
    check_settings,
    checkpoints_dir,
    latest_checkpoint,
    load_state,
    publishing,
)
from plait.train.config import ConfigError, TrainConfig
from plait.train.faults import strike_in_checkpoint
from plait.train.manifest import from_every_rank

__all__ = [
    "SHARED_MEMORY",
    "SNAPSHOT_DIR",
    "check_snapshots",
    "clear_snapshots",
    "first_on_machine",
    "latest_snapshot",
    "load_snapshot",
    "snapshot_root",
    "write_snapshot",
]

#: Where snapshots go when the machine has it: a file system in memory (Linux).
SHARED_MEMORY = Path("/dev/shm")
#: The environment variable naming another directory for them (a machine-local disk, say).
SNAPSHOT_DIR = "PLAIT_SNAPSHOT_DIR"
_INFO = "plait.json"  # as a checkpoint's: read_info and check_settings read it


def snapshot_root(run_dir: str | Path) -> Path:
    """The directory of ``run_dir``'s snapshots on this machine (its ``checkpoints/`` holds
    them, as a run directory's does): named by the run directory's absolute path, under
    ``$PLAIT_SNAPSHOT_DIR``, else :data:`SHARED_MEMORY`, else the temporary directory."""
    if configured := os.environ.get(SNAPSHOT_DIR):
        base = Path(configured)
    else:
        base = SHARED_MEMORY if SHARED_MEMORY.is_dir() else Path(tempfile.gettempdir())
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return base / "plait-snapshots" / digest


def latest_snapshot(run_dir: str | Path) -> Path | None:
    """The newest published snapshot of ``run_dir`` on this machine (None if none)."""
    return latest_checkpoint(snapshot_root(run_dir))


def clear_snapshots(run_dir: str | Path) -> None:
    """Remove ``run_dir``'s snapshots from this machine (the memory they hold)."""
    shutil.rmtree(snapshot_root(run_dir), ignore_errors=True)


def check_snapshots(cfg: TrainConfig) -> None:
    """Refuse ``--snapshot-every`` with ``--replica-groups`` (module docstring)."""
    if cfg.snapshot_every and cfg.replica_groups > 1:
        raise ConfigError(
            f"--snapshot-every {cfg.snapshot_every} with --replica-groups "
            f"{cfg.replica_groups}: a restarted replica group heals from a live one and "
            "redoes only the step it died in, so snapshots add nothing: drop --snapshot-every"
        )


def first_on_machine() -> bool:
    """Whether this process is its machine's first rank (torchrun's ``LOCAL_RANK`` 0, or
    the only process): the one that publishes and removes the machine's snapshots."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _rank() -> tuple[int, int, bool]:
    """This rank, the world size, and whether it is its machine's first rank."""
    if not dist.is_initialized():
        return 0, 1, True
    return dist.get_rank(), dist.get_world_size(), first_on_machine()


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank:05d}.pt"


def _replica_file(directory: Path, rank: int) -> Path:
    """Where the next machine keeps rank ``rank``'s file."""
    return directory / f"replica_{rank:05d}.pt"


def _peers(rank: int, world: int) -> tuple[int, int]:
    """The rank of the same local rank on the next machine, which keeps a copy of this
    rank's snapshot file, and the one on the previous machine, whose copy this rank keeps
    (both ``rank`` itself on one machine). Machines of ``LOCAL_WORLD_SIZE`` ranks each, in
    rank order, as torchrun numbers them."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local >= world or world % local:
        return rank, rank
    return (rank + local) % world, (rank - local) % world


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _local(value: Any) -> Any:
    """``value`` (nested dicts of tensors) with each DTensor's local shard in its place."""
    if isinstance(value, dict):
        return {key: _local(item) for key, item in value.items()}
    return value.to_local() if isinstance(value, DTensor) else value


def _as_bytes(value: Any) -> Any:
    """``value`` (nested dicts of tensors) with each tensor as ``(bytes, dtype, shape)``:
    ``torch.save`` refuses tensors that view one storage as different dtypes (a staged
    copy's arena, :class:`~plait.train.checkpointer.Stager`), and saves byte views of it
    once."""
    if isinstance(value, dict):
        return {key: _as_bytes(item) for key, item in value.items()}
    return (value.reshape(-1).view(torch.uint8), str(value.dtype), list(value.shape))


def _from_bytes(value: Any) -> Any:
    """The inverse of :func:`_as_bytes` (tensors viewing what was loaded)."""
    if isinstance(value, dict):
        return {key: _from_bytes(item) for key, item in value.items()}
    data, dtype, shape = value
    return data.view(getattr(torch, dtype.removeprefix("torch."))).view(shape)


def write_snapshot(
    root: Path,
    step: int,
    state: dict[str, Any],
    config: dict[str, Any],
    group: dist.ProcessGroup | None,
    *,
    background: bool = False,
) -> Path:
    """Write this rank's ``state`` (:func:`~plait.train.checkpointing.checkpoint_state`, or
    a staged copy of it) as the snapshot of ``step`` under ``root`` (:func:`snapshot_root`);
    collective over ``group``, every rank's checkpoint group (``background``: off the
    training thread). Each machine's first rank publishes its machine's directory and keeps
    only the newest (:func:`~plait.train.checkpointing.publishing`)."""
    rank, world, first = _rank()
    with publishing(root, step, config, group, first, 1, background) as tmp:
        _write_files(tmp, rank, world, state, group)
        strike_in_checkpoint(step)  # test-only (plait.train.faults): a kill mid-write
    return checkpoints_dir(root) / f"step_{step:06d}"


def _write_files(
    tmp: Path, rank: int, world: int, state: dict[str, Any], group: dist.ProcessGroup | None
) -> None:
    """This rank's file of a snapshot in ``tmp``, and the previous machine's copy."""
    buffer = io.BytesIO()
    torch.save(_as_bytes(_local(state)), buffer)
    _rank_file(tmp, rank).write_bytes(buffer.getbuffer())
    keeper, source = _peers(rank, world)
    if keeper != rank:  # several machines: a copy on the next one, and the previous one's here
        sizes = from_every_rank(buffer.getbuffer().nbytes, group)
        sent = dist.isend(torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8), keeper, group)
        copy = torch.empty(sizes[source], dtype=torch.uint8)
        dist.recv(copy, source, group=group)
        if sent is not None:
            sent.wait()
        with open(_replica_file(tmp, source), "wb") as f:
            copy.numpy().tofile(f)


def load_snapshot(
    path: Path,
    modules: Sequence[nn.Module],
    optimizer: torch.optim.Optimizer,
    device: str,
    *,
    expected: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> CheckpointInfo:
    """Load snapshot ``path`` into ``modules`` and ``optimizer`` (in place; collective over
    ``group``). Every rank reads its own file, or, if its machine lost it (a replaced
    machine), receives the copy the next machine keeps; unless every rank has its file, of
    this world size, of the model settings ``expected`` and of the live tensors' shapes,
    every rank raises :class:`~plait.train.checkpointing.CheckpointDamaged` (nothing
    loaded)."""
    rank, world, _ = _rank()
    mine, info_text = _read(_rank_file(path, rank)), _read(path / _INFO)
    keeper, source = _peers(rank, world)
    if keeper != rank:  # several machines: fetch a lost file from the keeper
        kept = _read(_replica_file(path, source))
        # Per rank: whether it has its file, the size of the copy it keeps, the info it read.
        found = (mine is not None, None if kept is None else len(kept), info_text)
        every = from_every_rank(found, group)
        info_text = info_text or next(filter(None, (text for *_, text in every)), None)
        sent, size = None, every[keeper][1]
        if not every[source][0] and kept is not None:
            sent = dist.isend(torch.frombuffer(bytearray(kept), dtype=torch.uint8), source, group)
        if mine is None and size is not None:
            received = torch.empty(size, dtype=torch.uint8)
            dist.recv(received, keeper, group=group)
            mine = received.numpy().tobytes()
        if sent is not None:
            sent.wait()
    saved: dict[str, Any] | None = None
    info, problem = CheckpointInfo(0, world, {}), ""
    try:
        if info_text is None or mine is None:
            raise FileNotFoundError(f"no file of rank {rank} on its machine or the next")
        raw = json.loads(info_text)
        info = CheckpointInfo(int(raw["step"]), int(raw["world_size"]), dict(raw["config"]))
        check_settings(path, expected or {}, info.config)  # another model's: ConfigError
        if info.world_size != world:
            problem = f"written by {info.world_size} ranks, not {world}"
        else:
            raw_state = torch.load(io.BytesIO(mine), map_location="cpu", weights_only=True)
            saved = _from_bytes(raw_state)
    except Exception as error:  # whatever it is: every rank must reach the agreement
        problem = f"rank {rank}: {type(error).__name__}: {error}"

    def read(state: dict[str, Any]) -> None:
        nonlocal problem
        live = _local(state)
        if saved is not None and not problem:
            problem = _shape_problem(live, saved, rank)
        problems = from_every_rank(problem, group)
        if any(problems):
            found = "; ".join(p for p in problems if p)
            raise CheckpointDamaged(f"snapshot {path} cannot be loaded here ({found})")
        _copy(live, saved)

    return load_state(info, modules, optimizer, device, read)


def _shape_problem(live: Any, saved: Any, rank: int, key: str = "") -> str:
    """What differs between the live state and the saved one ("" if nothing)."""
    if isinstance(live, dict):
        if not isinstance(saved, dict) or set(live) - set(saved):
            return f"rank {rank}: {key or 'the state'} has entries the snapshot lacks"
        for name, item in live.items():
            found = _shape_problem(item, saved[name], rank, f"{key}.{name}".lstrip("."))
            if found:
                return found
        return ""
    if not isinstance(saved, torch.Tensor) or saved.shape != live.shape:
        return f"rank {rank}: {key} is shaped {tuple(live.shape)} here, not as saved"
    return ""


def _copy(live: Any, saved: Any) -> None:
    if isinstance(live, dict):
        for name, item in live.items():
            _copy(item, saved[name])
    else:
        live.copy_(saved)
