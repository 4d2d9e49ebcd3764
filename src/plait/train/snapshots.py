"""Snapshots (``--snapshot-every N``): a checkpoint every ``N`` steps in this machine's
memory, for a restart to continue from with at most ``N`` steps redone.

A checkpoint to the run directory (``--ckpt-every``) is durable but costs a write to
storage, so runs take one every few hundred steps, and a failed worker then costs every
step since. A snapshot is the same checkpoint (:func:`~plait.train.checkpointing.write_checkpoint`:
the same files, manifest and atomic publication; synchronous, or staged and written in the
background with ``--async-checkpoint``) written to a directory in shared memory
(:func:`snapshot_root`: ``/dev/shm``, a RAM file system, when the machine has one), only
the newest kept. It outlives the workers (a killed or failed process, or a restart by
``--max-restarts``), not the machine: a restart, or ``--resume`` on the same machine,
continues from the newest of the run's checkpoints and snapshots
(:func:`plait.train.restart.resumable`), a reboot or a lost machine from the newest
checkpoint. A step due for both gets the checkpoint only. Snapshots hold up to two copies
of each rank's state in memory (the newest is kept while the next is written): a file
system without room for them is refused before the first
(:class:`~plait.train.checkpointer.Checkpointer`). The run removes its snapshots when it
ends (its last checkpoint is newer); a new run in a run directory that holds one is
refused, as over a checkpoint (``--resume`` continues from it).

One machine only: every rank must see every rank's snapshot files (they are one
checkpoint), so a job over several machines (torchrun ``--nnodes``) is refused with the
fix (:func:`check_snapshots`). Replica groups (``--replica-groups``) heal a restarted group
from a live one, which redoes only the step it died in: snapshots are refused there too.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from plait.train.checkpointing import latest_checkpoint
from plait.train.config import ConfigError, TrainConfig

__all__ = [
    "SHARED_MEMORY",
    "check_snapshots",
    "clear_snapshots",
    "latest_snapshot",
    "snapshot_root",
]

#: Where snapshots go when the machine has it: a file system in memory (Linux).
SHARED_MEMORY = Path("/dev/shm")


def snapshot_root(run_dir: str | Path) -> Path:
    """The directory of ``run_dir``'s snapshots (its ``checkpoints/`` holds them, as a run
    directory's does): named by the run directory's absolute path, under
    :data:`SHARED_MEMORY`, or the temporary directory on a machine without one."""
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
    """Refuse ``--snapshot-every`` where snapshots cannot work (module docstring): with
    ``--replica-groups``, and over several machines (torchrun's ``LOCAL_WORLD_SIZE`` below
    its ``WORLD_SIZE``)."""
    if not cfg.snapshot_every:
        return
    if cfg.replica_groups > 1:
        raise ConfigError(
            f"--snapshot-every {cfg.snapshot_every} with --replica-groups "
            f"{cfg.replica_groups}: a restarted replica group heals from a live one and "
            "loses no step, so snapshots add nothing: drop --snapshot-every"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local < world:
        raise ConfigError(
            f"--snapshot-every {cfg.snapshot_every}: snapshots live in one machine's memory, "
            f"and this job's {world} workers run on several machines ({local} on this one), "
            "each of which would hold a part of every snapshot and lose it with the machine: "
            "drop --snapshot-every and checkpoint more often to a shared --run-dir "
            "(--ckpt-every, with --async-checkpoint to keep training going while it writes)"
        )
