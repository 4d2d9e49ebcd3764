"""This machine's CPU cores as plait's workers share them (torch-free: the planner asks
too): :func:`usable_cores` and :func:`threads_per_worker`."""

from __future__ import annotations

import os

__all__ = ["threads_per_worker", "usable_cores"]


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def threads_per_worker(local_world: int) -> int:
    """CPU threads each of ``local_world`` workers on this machine gets, so that workers do
    not oversubscribe it: the usable cores divided among them, at least one."""
    return max(1, usable_cores() // local_world)
