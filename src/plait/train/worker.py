"""What one worker process does: join the process group, agree on a run directory, train.

The elastic launcher (``plait train`` on one machine) and torchrun (any number of
machines) both start workers with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; a single process without
them trains without a process group.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from plait.train.config import TrainConfig
from plait.train.loop import TrainResult, train

__all__ = ["default_run_dir", "worker_main"]

# Long enough for a slow checkpoint on a loaded machine; a dead peer still fails the run.
_TIMEOUT = timedelta(minutes=10)
_MAX_PATH = 4096


def default_run_dir() -> str:
    return time.strftime("runs/%Y%m%d-%H%M%S")


def _threads_per_worker() -> int:
    """CPU cores per local worker, so that workers do not oversubscribe the machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (cores or 1) // local_world)


def _join_process_group(cfg: TrainConfig) -> None:
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=_TIMEOUT)
    else:
        torch.set_num_threads(_threads_per_worker())
        dist.init_process_group("gloo", timeout=_TIMEOUT)


def _agree_on_run_dir(cfg: TrainConfig) -> str:
    """``cfg.run_dir``, or rank 0's default, sent to every rank (machines' clocks and
    start times differ, so each cannot pick its own)."""
    if cfg.run_dir or not dist.is_initialized():
        return cfg.run_dir or default_run_dir()
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else None
    buffer = torch.zeros(_MAX_PATH, dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        encoded = default_run_dir().encode()
        buffer[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    dist.broadcast(buffer, src=0)
    return bytes(buffer.cpu().tolist()).rstrip(b"\0").decode()


@record  # a failing worker's traceback reaches the launcher's error report
def worker_main(cfg: TrainConfig) -> TrainResult:
    """Train ``cfg`` (resolved: see :func:`plait.train.layout.resolve`) in this process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _join_process_group(cfg)
    try:
        return train(cfg.replace(run_dir=_agree_on_run_dir(cfg)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
