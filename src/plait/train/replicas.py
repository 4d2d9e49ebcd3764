"""Fault-tolerant replica groups (``--replica-groups R``): the checks and the launcher.

With ``--replica-groups R`` the run trains ``R`` copies of the model, the *replica groups*,
each on ``--nproc`` processes that shard it with ``fully_shard`` over their ``--dp-shard``
x ``--cp`` ranks (at least 2), any other parallelism inside the group but
``--dp-replicate``. The groups are tied together by torchft (the ``ft`` extra, ``pip
install "plait[ft]"``), not by a process group: at every step the groups that are alive
form a quorum at torchft's *lighthouse*, and each group's reduce-scattered gradient shards
are averaged over that quorum, and the token counts that balance a model's experts summed
over it (:mod:`plait.train.replica_worker`). A group that dies drops out: the others redo
the step it died in without it and go on. A group that comes back heals: it receives the
model and optimizer state of a live group (torchft's checkpoint transport) and trains the
next step with them, its weights bitwise those of the live group.

The global batch (``--batch-size``) is split into ``R`` equal shares, one per group, and
each group's share over its ``--dp-shard`` ranks (its cp and tp ranks share their dp
rank's rows): dp rank ``r`` of group ``g`` reads part ``g * dp_shard + r`` of ``R *
dp_shard`` of every global batch. A step that a group misses
averages the gradients of the groups that took part: it sees fewer samples (``(R - m) /
R`` of the global batch with ``m`` groups missing), and its gradient is their mean.

On one machine ``plait train --replica-groups R`` does it all (:func:`launch_replicas`):
it starts the lighthouse (``torchft_lighthouse``, shipped in torchft's wheel) on
127.0.0.1, then ``R`` groups of ``--nproc`` workers, each group its own store (port) and
gloo / NCCL process group; when a group fails it stops the group's processes and, up to
``--max-restarts`` times per group, starts the group again (a new set of processes) while
the others train on. A group out of restarts stays out; the run succeeds if one group
finishes. Each group writes its metrics and checkpoints in ``<run-dir>/group<g>``;
``<run-dir>/replicas/`` holds the lighthouse's log.

On several machines, start the lighthouse yourself, and each group with torchrun, telling
its workers their group and the lighthouse::

    torchft_lighthouse --bind [::]:29510 --min_replicas 1 --join_timeout_ms 10000
    PLAIT_REPLICA_GROUP=0 TORCHFT_LIGHTHOUSE=http://HOST:29510 torchrun --nproc-per-node 8 \\
        -m plait train --replica-groups 2 --dp-shard 8 --run-dir /shared/run ...
    PLAIT_REPLICA_GROUP=1 TORCHFT_LIGHTHOUSE=http://HOST:29510 torchrun ... (on another host)

(a group that fails is restarted by whoever started it, e.g. torchrun's ``--max-restarts``
or the cluster's scheduler; it heals from a live group when it comes back).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from plait.train.config import ConfigError, TrainConfig

__all__ = [
    "GROUP_VARIABLE",
    "LIGHTHOUSE_VARIABLE",
    "ReplicasFailed",
    "check_replica_groups",
    "group_run_dir",
    "launch_replicas",
    "lighthouse_status",
    "metrics_run_dir",
    "replica_group",
    "replicas_config",
]

#: The replica group of a worker (0 to R - 1), set by the launcher (or by hand under torchrun).
GROUP_VARIABLE = "PLAIT_REPLICA_GROUP"
#: torchft's own variable for the lighthouse's address (``http://HOST:PORT``).
LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"
#: The address a worker advertises to other groups (its manager, its checkpoint server).
HOST_VARIABLE = "PLAIT_REPLICA_HOST"
#: Set by the local launcher for a group's first life: wait, before the first step, until
#: this many groups heartbeat at the lighthouse (so the first quorum holds them all).
START_VARIABLE = "PLAIT_REPLICA_START"
_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # the group's life: faults and resumes read it
#: A group that stopped heartbeating for this long is out of the next quorum. torchft's
#: default: a group busy healing on a loaded host (2 cores, 4 workers) went 1 s without a
#: heartbeat and was dropped from the quorum it was about to join. A dead group's peers
#: notice at once (their collectives fail); the lighthouse then waits out this timeout before
#: the survivors' quorum forms, so each failure costs up to this much more.
HEARTBEAT_TIMEOUT_MS = 5000
JOIN_TIMEOUT_MS = 10000


class ReplicasFailed(RuntimeError):
    """Every replica group failed (for good); the message says how each life ended."""


def _gpu_count() -> int:
    import torch  # the launcher imports torch only for CUDA runs

    return torch.cuda.device_count()


def check_replica_groups(cfg: TrainConfig) -> None:
    """ConfigError unless ``cfg`` (resolved) is a layout replica groups support."""
    if cfg.replica_groups < 2:
        return
    flag = f"--replica-groups {cfg.replica_groups}"
    if cfg.dp_replicate > 1:
        raise ConfigError(
            f"{flag} with --dp-replicate {cfg.dp_replicate}: the groups are the data-parallel "
            "replicas; inside a group fully_shard shards over --dp-shard x --cp ranks: drop "
            "--dp-replicate (or use more groups)"
        )
    if cfg.dp_shard * cfg.cp < 2:
        raise ConfigError(
            f"{flag} with --dp-shard {cfg.dp_shard} --cp {cfg.cp}: each group must shard the "
            "model over at least 2 ranks (fully_shard shards over --dp-shard x --cp, and the "
            "groups' gradients are averaged by its all-reduce hook): use --dp-shard 2 or more"
        )
    parts = cfg.replica_groups * cfg.dp
    if cfg.batch_size % parts:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} does not split into {cfg.replica_groups} groups "
            f"x {cfg.dp} ranks: use a multiple of {parts}"
        )


def replica_group() -> int:
    """This worker's replica group (:data:`GROUP_VARIABLE`), or ConfigError without one."""
    value = os.environ.get(GROUP_VARIABLE)
    if value is None or not value.isdigit():
        raise ConfigError(
            f"--replica-groups under torchrun: set {GROUP_VARIABLE} (this group's number, 0 "
            f"to R - 1) and {LIGHTHOUSE_VARIABLE} (the lighthouse, http://HOST:PORT) in "
            "torchrun's environment"
        )
    return int(value)


def group_run_dir(run_dir: str | Path, group: int) -> Path:
    """Where replica group ``group`` writes its metrics and checkpoints."""
    return Path(run_dir) / f"group{group}"


def metrics_run_dir(cfg: TrainConfig) -> Path:
    """The run directory whose metrics this process reports on: the run's, or with replica
    groups its group's (the first group's in the launcher that started them all)."""
    if cfg.replica_groups > 1:
        return group_run_dir(cfg.run_dir, int(os.environ.get(GROUP_VARIABLE, "0")))
    return Path(cfg.run_dir)


def lighthouse_status(url: str) -> tuple[int, int] | None:
    """(groups waiting for a quorum, groups heartbeating) from the lighthouse's status page;
    None when it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/status", timeout=2) as page:
            text = page.read().decode()
    except OSError:
        return None
    found = re.search(r"\[(\d+)/\d+ participants healthy\]\[(\d+) heartbeating\]", text)
    return (int(found[1]), int(found[2])) if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lighthouse_binary() -> str:
    here = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(here) if here.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise ConfigError(
            "--replica-groups needs torchft (its lighthouse): pip install 'plait[ft]'"
        )
    return found


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # its own session: ours only
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()


@dataclass
class _Group:
    """One replica group's current processes and its history."""

    index: int
    life: int = -1
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    finished: bool = False
    out: bool = False  # failed for good

    def gpus(self, per_group: int) -> list[str]:
        """This group's GPUs: the ``index``-th ``per_group`` of the visible ones (every
        group on all of them would put two groups' ranks on one GPU, which NCCL refuses)."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(_gpu_count())]
        return ids[self.index * per_group : (self.index + 1) * per_group]

    def start(self, cfg: TrainConfig, config_file: Path, lighthouse: str) -> None:
        self.life += 1
        port = str(_free_port())
        command = [sys.executable, "-m", "plait.train.worker", str(config_file)]
        self.procs = []
        for rank in range(cfg.nproc):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(cfg.nproc),
                LOCAL_WORLD_SIZE=str(cfg.nproc),
                PLAIT_LAUNCHER_PID=str(os.getpid()),
                **{
                    GROUP_VARIABLE: str(self.index),
                    LIGHTHOUSE_VARIABLE: lighthouse,
                    HOST_VARIABLE: "127.0.0.1",
                    _RESTART_COUNT: str(self.life),
                },
            )
            if self.life == 0:
                env[START_VARIABLE] = str(cfg.replica_groups)
            if cfg.device == "cpu":
                env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            else:  # this group's GPUs only: its LOCAL_RANK r is its r-th
                env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus(cfg.nproc))
            env.setdefault("RUST_LOG", "warn")  # torchft's manager logs every quorum
            self.procs.append(subprocess.Popen(command, env=env, start_new_session=True))

    def failure(self) -> str | None:
        """Why the group failed (a process exited non-zero), or None."""
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None and code != 0:
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
                return f"rank {rank} ({how})"
        return None


def _die_with_parent() -> None:
    """In a child before it runs (Linux): the kernel SIGKILLs it when its parent dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _start_lighthouse(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    command = [
        _lighthouse_binary(), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1",
        "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS),
        "--join_timeout_ms", str(JOIN_TIMEOUT_MS), "--quorum_tick_ms", "50",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # even when the launcher is SIGKILLed
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while lighthouse_status(url) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill([proc])
            raise RuntimeError(f"the torchft lighthouse did not start: see {log}")
        time.sleep(0.05)
    return proc, url


def _say(text: str) -> None:
    print(f"plait train: {text}", file=sys.stderr, flush=True)


def _launched_config(run_dir: str | Path) -> Path:
    """The configuration the launcher writes for its groups, beside the lighthouse's log."""
    return Path(run_dir) / "replicas" / "config.json"


def replicas_config(run_dir: str | Path) -> Path:
    """Where a replica-groups run keeps the configuration it was launched with: the
    launcher's copy on one machine; under torchrun (each group started by hand, no
    launcher) this worker's group's own (:data:`GROUP_VARIABLE`), whose run directory is
    the group's. Either may not exist."""
    launched = _launched_config(run_dir)
    group = os.environ.get(GROUP_VARIABLE, "")
    if launched.is_file() or not group.isdigit():
        return launched
    return group_run_dir(run_dir, int(group)) / "config.json"


def launch_replicas(cfg: TrainConfig) -> None:
    """Train ``cfg`` (resolved, with its run directory) as ``cfg.replica_groups`` replica
    groups on this machine (module docstring). Raises ReplicasFailed when no group finished."""
    config_file = _launched_config(cfg.run_dir)
    scratch = config_file.parent
    scratch.mkdir(parents=True, exist_ok=True)
    config_file.write_text(json.dumps(cfg.to_dict()))
    lighthouse, url = _start_lighthouse(scratch / "lighthouse.log")
    groups = [_Group(g) for g in range(cfg.replica_groups)]
    failures: list[str] = []
    try:
        for group in groups:
            group.start(cfg, config_file, url)
        while not all(g.finished or g.out for g in groups):
            time.sleep(0.1)
            for group in (g for g in groups if not (g.finished or g.out)):
                why = group.failure()
                if why is None:
                    group.finished = all(p.poll() == 0 for p in group.procs)
                    continue
                _kill(group.procs)
                failures.append(f"group {group.index} life {group.life}: {why}")
                if group.life < cfg.max_restarts:
                    _say(f"replica group {group.index} failed ({why}): restarting it")
                    group.start(cfg, config_file, url)
                else:
                    group.out = True
                    _say(f"replica group {group.index} failed ({why}); the others go on")
    finally:
        _kill([p for g in groups for p in g.procs] + [lighthouse])
    if not any(g.finished for g in groups):
        raise ReplicasFailed(f"every replica group failed: {'; '.join(failures)}")
