"""Automatic restarts (``--max-restarts N``): a failed worker restarts every worker, and the
run continues from its latest intact checkpoint.

The restarting is torch's elastic agent's: ``plait train`` gives it ``N`` (its local
launcher's ``LaunchConfig.max_restarts``; under torchrun, torchrun's own ``--max-restarts``,
which plait reads back from ``TORCHELASTIC_MAX_RESTARTS``; torchrun needs
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in its environment, which plait's launcher sets
for itself, so that each attempt's workers rendezvous in a store of their own rather than
the failed attempt's: pytorch/pytorch#135712). When a worker fails (raises,
is killed, or its peers' ``--fault-timeout`` runs out), the agent stops the others and
starts them all again, up to ``N`` times, with ``TORCHELASTIC_RESTART_COUNT`` set to the
restart's number. A restarted worker (:func:`restart_count` > 0) continues the run as
``--resume`` would (:func:`restarted`): from the newest intact checkpoint of the same run
directory, or this machine's newer snapshot (``--snapshot-every``, :func:`resumable`; the
step 0 of a fresh start if neither was written yet), with the same data
positions, RNG states and learning-rate schedule, so the run ends with the weights and
losses of an uninterrupted one. Only after the ``N``-th restart fails does the run fail.

Metrics, TensorBoard and W&B continue as after a ``--resume``: the records the failed
attempt wrote past the checkpoint are dropped (they are written again as the steps are
redone), and one ``restart`` row at the step the attempt resumes from says what was redone
(:func:`restart_record`)::

    {"step": 40, "event": "restart", "restart": 1, "redone": [41, 47], "redone_steps": 7,
     "lost_step_time": 3.2}

``redone``: the first and last step the failed attempt had completed past the checkpoint
(``[]``: none); ``lost_step_time``: their step times, in seconds. The summary adds them up
(:func:`restart_summary`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from plait.train.checkpointing import (
    Loader,
    checkpoint_step,
    checkpoints_dir,
    list_checkpoints,
    load_checkpoint,
)
from plait.train.config import ConfigError, TrainConfig
from plait.train.faults import lose_snapshots
from plait.train.manifest import from_every_rank
from plait.train.metrics import read_metrics
from plait.train.snapshots import load_snapshot, snapshot_root

__all__ = [
    "RESTART_EVENT",
    "UNSHARED_STORE",
    "agreed_checkpoints",
    "agreed_restart_count",
    "check_torchrun_restarts",
    "loader_of",
    "mark_torchrun_job",
    "redone_steps",
    "restart_count",
    "restart_record",
    "restart_summary",
    "restarted",
    "resumable",
]

RESTART_EVENT = "restart"
_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # set by the elastic agent for its workers
_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
_RUN_ID = "TORCHELASTIC_RUN_ID"  # set by torchrun: its --rdzv-id (a fresh uuid standalone)
_JOB_FILE = "torchrun_job"  # in a run directory: the id of the torchrun job running it
_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # "True": the workers share the agent's store
#: Set for the elastic agent, each attempt's workers get a store of their own.
UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def agreed_checkpoints(run_dir: str | Path, group: dist.ProcessGroup | None = None) -> list[Path]:
    """:func:`list_checkpoints` as rank 0 of ``group`` sees it, on every rank (collective
    when a process group is up). Machines sharing the run directory over a network file
    system may list it differently for a while (cached directory entries): ranks that each
    chose for themselves could resume from different steps."""
    found = list_checkpoints(run_dir)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return found
    names = [[p.name for p in found]]
    dist.broadcast_object_list(names, group=group, group_src=0)
    root = checkpoints_dir(run_dir)
    return [root / name for name in names[0]]


def resumable(run_dir: str | Path, group: dist.ProcessGroup | None = None) -> list[Path]:
    """What a session can resume ``run_dir`` from, oldest first: its checkpoints and this
    machine's snapshots of it (:mod:`plait.train.snapshots`), as rank 0 of ``group`` sees
    them (collective when a process group is up, as :func:`agreed_checkpoints`). Of a
    checkpoint and a snapshot of the same step the checkpoint comes last (tried first)."""
    found = [*_any_machines_snapshots(run_dir, group), *agreed_checkpoints(run_dir, group)]
    return sorted(found, key=checkpoint_step)  # stable: a tie keeps the snapshot first


def _any_machines_snapshots(run_dir: str | Path, group: dist.ProcessGroup | None) -> list[Path]:
    """The snapshots of ``run_dir`` that any rank's machine holds (collective when a
    process group is up), named under this machine's snapshot root: a machine that lost
    them (replaced) still takes part, and :func:`~plait.train.snapshots.load_snapshot`
    fetches its ranks' files from the machine that keeps a copy."""
    root = snapshot_root(run_dir)
    lose_snapshots(root)  # test-only (plait.train.faults): a replaced machine's empty memory
    found = [p.name for p in list_checkpoints(root)]
    if dist.is_initialized():
        found = sorted(set().union(*from_every_rank(found, group or dist.group.WORLD)))
    return [checkpoints_dir(root) / name for name in found]


def loader_of(path: Path, run_dir: str | Path) -> Loader:
    """How to load ``path``, one of :func:`resumable`'s: as a snapshot of ``run_dir``
    (:func:`~plait.train.snapshots.load_snapshot`) or a checkpoint
    (:func:`~plait.train.checkpointing.load_checkpoint`), told apart by where it is, the
    same on every rank (a rank whose machine lacks the snapshot still takes part)."""
    return load_snapshot if path.is_relative_to(snapshot_root(run_dir)) else load_checkpoint


def restart_count() -> int:
    """How many times the elastic agent has restarted this worker's group (0: the first
    attempt, or no agent)."""
    return int(os.environ.get(_RESTART_COUNT, "0") or 0)


def agreed_restart_count() -> int:
    """:func:`restart_count`, the largest over the ranks (collective when a process group
    is up): torchrun's agents on machines whose workers did not fail restart them for the
    new rendezvous without counting it, so only the failed machine's workers know."""
    if not dist.is_initialized():
        return restart_count()
    return max(from_every_rank(restart_count(), dist.group.WORLD))


def mark_torchrun_job(run_dir: str | Path) -> None:
    """Under torchrun, rank 0 records its job's id (``TORCHELASTIC_RUN_ID``) in
    ``run_dir``: a worker that torchrun's agent restarts for a new rendezvous, which it does
    not count (``TORCHELASTIC_RESTART_COUNT`` stays 0: pytorch's elastic agent), then knows
    from it that it continues this job's run (:func:`restarted`)."""
    job = os.environ.get(_RUN_ID)
    if job and os.environ.get("RANK", "0") == "0":
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / _JOB_FILE).write_text(job)


def _this_job_ran(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` was run by this torchrun job already (:func:`mark_torchrun_job`)."""
    job = os.environ.get(_RUN_ID)
    try:
        return bool(job) and (Path(run_dir) / _JOB_FILE).read_text() == job
    except OSError:
        return False


def restarted(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` for this attempt: a restarted worker (counted, or of a torchrun job that
    ran in ``cfg.run_dir`` before) resumes from the run's latest checkpoint or snapshot (if
    there is one yet); the first attempt runs ``cfg`` as given."""
    if restart_count() == 0 and not _this_job_ran(cfg.run_dir):
        return cfg
    return cfg.replace(resume=bool(resumable(cfg.run_dir)))


def check_torchrun_restarts(cfg: TrainConfig) -> TrainConfig:
    """Under torchrun: ``cfg`` with torchrun's ``--max-restarts``, or ConfigError when
    ``--max-restarts`` asks for other restarts than torchrun makes, or when restarts have
    no ``--run-dir`` to continue in (each attempt would pick a new default)."""
    given = int(os.environ.get(_MAX_RESTARTS, "0") or 0)
    if cfg.max_restarts not in (0, given):
        raise ConfigError(
            f"--max-restarts {cfg.max_restarts} under torchrun, which restarts the workers "
            f"{given} time(s) (its own --max-restarts): give the number to torchrun, "
            f"torchrun --max-restarts {cfg.max_restarts} ..., and drop plait's flag"
        )
    if given and os.environ.get(_AGENT_STORE) == "True":
        raise ConfigError(
            f"torchrun --max-restarts {given} needs {UNSHARED_STORE}=1 in torchrun's "
            "environment: without it torch's elastic agent hands restarted workers the store "
            "of the failed ones, whose stale addresses make the process group's start fail "
            f"(pytorch/pytorch#135712): run {UNSHARED_STORE}=1 torchrun --max-restarts "
            f"{given} ..."
        )
    if given and not cfg.run_dir:
        raise ConfigError(
            f"torchrun --max-restarts {given}: a restarted worker continues the run in its "
            "run directory, so give one: --run-dir DIR (on a file system every node shares)"
        )
    return cfg.replace(max_restarts=given)


def restart_record(run_dir: str | Path, start: int, restart: int) -> dict[str, Any]:
    """The ``restart`` row of restart number ``restart``, resuming at step ``start``: read
    from the failed attempt's metrics.jsonl, before it is rewritten (rank 0 only)."""
    lost = [r for r in read_metrics(run_dir) if "loss" in r and r["step"] > start]
    steps = [r["step"] for r in lost]
    return {
        "step": start,
        "event": RESTART_EVENT,
        "restart": restart,
        "redone": [min(steps), max(steps)] if steps else [],
        "redone_steps": len(steps),
        "lost_step_time": sum((float(r.get("step_time", 0.0)) for r in lost), 0.0),
    }


def redone_steps(redone: list[int]) -> str:
    """A restart row's ``redone`` in words: ``"steps 41-47"``, ``"step 41"``, ``""``."""
    if not redone:
        return ""
    first, last = redone
    return f"step {first}" if first == last else f"steps {first}-{last}"


def restart_summary(records: list[dict[str, Any]]) -> str | None:
    """The summary's line about the run's restarts (None if there were none), e.g.
    ``2: steps 41-47, step 81 redone (8 in all, 3.4 s of step time)``."""
    rows = [r for r in records if r.get("event") == RESTART_EVENT]
    if not rows:
        return None
    spans = [redone_steps(r["redone"]) for r in rows if r["redone"]]
    steps = sum(int(r["redone_steps"]) for r in rows)
    seconds = sum((float(r["lost_step_time"]) for r in rows), 0.0)
    which = f"{', '.join(spans)} redone" if spans else "no completed step redone"
    return f"{len(rows)}: {which} ({steps} in all, {seconds:.1f} s of step time)"
