"""What one worker process does: join the process group, agree on a run directory, train.

The elastic launcher (``plait train`` on one machine) and torchrun (any number of
machines) both start workers with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; a single process without
them trains without a process group.

``--fault-timeout`` bounds every wait for a peer: it is the process group's timeout (a
collective that a hung peer never joins fails after it) and ``PLAIT_FAULT_TIMEOUT`` (how
long the survivors of a failed collective wait for each other before naming the ranks
that did not answer, :mod:`plait.spmd`). Checkpoint collectives have their own, longer
timeout (:func:`plait.train.checkpointing.checkpoint_group`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from plait import spmd
from plait.mesh import collective_device
from plait.train.config import ExecutionConfig, RunConfig, TrainConfig, from_mapping
from plait.train.cores import freeze_at_exit, threads_per_worker, usable_cores
from plait.train.loop import TrainResult, train

__all__ = ["LAUNCHER_PID", "default_run_dir", "threads_per_worker", "usable_cores", "worker_main"]

#: Set by plait's local launcher for its workers: the pid of their parent (the launcher, or
#: the fork server it started, which lives exactly as long as it).
LAUNCHER_PID = "PLAIT_LAUNCHER_PID"
_MAX_PATH = 4096
_PR_SET_PDEATHSIG = 1  # prctl(2)

# The launcher's fork server imports this module before forking any worker
# (plait.train.launch) and exits after the launcher.
freeze_at_exit()


def default_run_dir() -> str:
    return time.strftime("runs/%Y%m%d-%H%M%S")


def _die_with_the_launcher() -> None:
    """On Linux, under plait's launcher: have the kernel SIGKILL this worker when the
    launcher dies (even by SIGKILL, which it cannot pass on), so none is left orphaned: the
    signal comes when the worker's parent dies (:data:`LAUNCHER_PID`), which dies with the
    launcher."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before prctl took effect
        os._exit(1)


SETUP_TIMEOUT = 600.0
"""Seconds a collective may wait for a peer until the first step is done (loading,
compiling, ranks starting apart: skews far beyond ``--fault-timeout`` are normal then)."""


def _join_process_group(execution: ExecutionConfig) -> None:
    """Join the default process group: NCCL on CUDA, gloo (with this worker's share of
    the cores) on the CPU. Its collectives' timeout is :data:`SETUP_TIMEOUT` (or
    ``--fault-timeout`` if longer) until the training loop shortens it to
    ``--fault-timeout`` after the first step (``plait.train.loop``)."""
    timeout = timedelta(seconds=max(execution.fault_timeout, SETUP_TIMEOUT))
    # This worker's share of the host's cores, on GPUs too (host-side work of several
    # workers would otherwise oversubscribe them; torchrun sets OMP_NUM_THREADS=1 itself).
    torch.set_num_threads(threads_per_worker(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if execution.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def _agree_on_run_dir(run: RunConfig) -> str:
    """``run.run_dir``, or rank 0's default, sent to every rank (machines' clocks and
    start times differ, so each cannot pick its own)."""
    if run.run_dir or not dist.is_initialized():
        return run.run_dir or default_run_dir()
    world = dist.group.WORLD
    buffer = torch.zeros(_MAX_PATH, dtype=torch.uint8, device=collective_device(world))
    if dist.get_rank() == 0:
        encoded = default_run_dir().encode()
        buffer[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    spmd.record("broadcast", buffer, world, "the run directory's name")
    spmd.wait(dist.broadcast(buffer, src=0, group=world, async_op=True), "broadcast of run_dir")
    return bytes(buffer.cpu().tolist()).rstrip(b"\0").decode()


@record  # a failing worker's traceback reaches the launcher's error report
def worker_main(cfg: TrainConfig) -> TrainResult:
    """Train ``cfg`` (resolved: see :func:`plait.train.resolve.resolve`) in this process.
    Takes the whole configuration: it is what the training loop runs."""
    _die_with_the_launcher()
    os.environ["PLAIT_FAULT_TIMEOUT"] = f"{cfg.fault_timeout:g}"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _join_process_group(cfg.execution)
    cfg = cfg.replace(run_dir=_agree_on_run_dir(cfg.run))
    if cfg.replica_groups > 1:  # torchft's fault-tolerant groups (the ft extra)
        from plait.train.replica_worker import train_replica

        result = train_replica(cfg)
    else:
        result = train(cfg)
    # Only after success: on NCCL, destroying the group waits for the collectives in
    # flight, which after a failure peers may never join, and the watchdog's abort would
    # then replace this worker's error in the launcher's report.
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def main() -> None:
    """``python -m plait.train.worker CONFIG.json``: one worker of the configuration in the
    JSON file (``TrainConfig.to_dict()``, resolved), its environment set by the launcher
    (the replica groups' launcher, :mod:`plait.train.replicas`)."""
    worker_main(from_mapping(json.loads(Path(sys.argv[1]).read_text())))


if __name__ == "__main__":
    main()
