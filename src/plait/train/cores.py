"""This machine's CPU cores as plait's processes use them (torch-free: the planner asks
too): :func:`usable_cores` and :func:`threads_per_worker`, how workers share them;
:func:`freeze_at_exit`, what a process need not spend on them when it ends."""

from __future__ import annotations

import atexit
import functools
import gc
import os

__all__ = ["freeze_at_exit", "threads_per_worker", "usable_cores"]


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def threads_per_worker(local_world: int) -> int:
    """CPU threads each of ``local_world`` workers on this machine gets, so that workers do
    not oversubscribe it: the usable cores divided among them, at least one."""
    return max(1, usable_cores() // local_world)


@functools.cache
def freeze_at_exit() -> None:
    """Have this process skip the interpreter's last garbage collections when it exits:
    after torch's import they traverse every object it made, about a second of CPU for
    nothing (what is left is freed by reference counts, and plait closes its files and
    loggers itself). Registers :func:`gc.freeze` with :mod:`atexit` once: it runs after
    the exit handlers registered later (loggers flush in theirs). Called by the ``plait``
    command, the launcher's fork server (which imports :mod:`plait.train.worker`) and the
    planner's spawned measuring workers; workers forked for training end with
    ``os._exit``, which runs no exit handler."""
    atexit.register(gc.freeze)
