"""Starting the workers: torch's elastic launcher locally, nothing under torchrun.

* Under torchrun (``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` set), this process *is* one
  worker: it trains and returns. Multi-node runs go this way::

      torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
          --rdzv-endpoint HOST:29500 -m plait train --device cuda ...

* Otherwise ``plait train`` starts ``--nproc`` local workers through
  ``torch.distributed.launcher.api.elastic_launch`` (what torchrun uses inside, in its
  ``--standalone`` configuration: a c10d rendezvous on a free local port) and waits for
  them. One process trains in this process, without launching anything.

On CPU the workers are forked from a fork server that has imported plait's worker module
(torch included) once, so starting ``--nproc`` workers costs one import of torch, not one
each (seconds per worker on a small machine); on CUDA they are spawned, each a fresh
process, so no CUDA state can be inherited through a fork.

When a worker fails (an exception, a signal such as SIGKILL, or a peer's
``--fault-timeout`` running out while it hangs), the launcher stops the others and
:class:`WorkerFailed` names the first failed worker's rank, with its traceback. With
``--max-restarts N`` the launcher first restarts every worker, up to ``N`` times, and they
continue from the latest intact checkpoint (:mod:`plait.train.restart`); one process
alone is launched too then (there is no restart without a launcher). The workers die with
the launcher, even when it is SIGKILLed (Linux), so none is orphaned.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import uuid
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from plait.train.config import ConfigError, TrainConfig
from plait.train.replicas import ReplicasFailed, launch_replicas
from plait.train.restart import UNSHARED_STORE
from plait.train.worker import LAUNCHER_PID, worker_main

__all__ = ["WorkerFailed", "launch", "under_torchrun"]

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class WorkerFailed(RuntimeError):
    """A worker process failed; the message holds its error."""


def under_torchrun() -> bool:
    """Whether this process was started as a worker by torchrun (or another launcher)."""
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


def launch(cfg: TrainConfig) -> None:
    """Run training with ``cfg`` (resolved) as the module docstring describes. Takes the
    whole configuration: each worker trains all of it. ``--replica-groups``: see
    :mod:`plait.train.replicas`."""
    if cfg.replica_groups > 1 and not under_torchrun():
        try:
            launch_replicas(cfg)
        except ReplicasFailed as err:
            raise WorkerFailed(str(err)) from None
        return
    if under_torchrun() or (cfg.nproc == 1 and not cfg.max_restarts):
        worker_main(cfg)
        return
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone
        max_restarts=cfg.max_restarts,
        monitor_interval=0.1,
        start_method=_start_method(cfg.device),
    )
    # The agent logs its progress, and every failed worker's traceback: too much to read.
    # WorkerFailed carries the first failure's traceback, which is what one needs.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # The workers' parent (this process, or the fork server it started): they die with it.
    os.environ[LAUNCHER_PID] = str(_workers_parent(config.start_method))
    # Each attempt's workers get a store of their own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE):
    # restarted ones handed the agent's store would read the failed ones' addresses, left
    # in it, and fail to connect (pytorch/pytorch#135712). Read by the agent, in-process.
    unshared = {UNSHARED_STORE: "1"} if cfg.max_restarts else {}
    saved = {name: os.environ.get(name) for name in unshared}
    os.environ.update(unshared)
    try:
        elastic_launch(config, worker_main)(cfg)
    except ChildFailedError as err:
        restarts = f" (after {cfg.max_restarts} restarts)" if cfg.max_restarts else ""
        raise WorkerFailed(_first_failure(err, restarts)) from None
    except SignalException as err:  # Ctrl-C or a kill: the agent has stopped the workers
        raise KeyboardInterrupt(str(err)) from None
    finally:
        del os.environ[LAUNCHER_PID]
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _start_method(device: str) -> str:
    """How the workers start: forked from a preloaded fork server on CPU, spawned on CUDA
    (module docstring)."""
    return "spawn" if device == "cuda" else "forkserver"


def _workers_parent(start_method: str) -> int:
    """The pid of the process the workers will be children of: this one when spawned, else
    the fork server, started here (once per process) with plait's worker module imported.
    The fork server exits as soon as this process dies (it reads the end of a pipe this
    process holds), so a worker that dies with its parent dies with the launcher."""
    if start_method != "forkserver":
        return os.getpid()
    multiprocessing.get_context("forkserver").set_forkserver_preload(["plait.train.worker"])
    multiprocessing.forkserver.ensure_running()
    server = multiprocessing.forkserver._forkserver  # the module's one fork server
    pid = getattr(server, "_forkserver_pid", None)
    return pid if isinstance(pid, int) else os.getpid()


def _first_failure(err: ChildFailedError, restarts: str = "") -> str:
    """The first failure's error and, unless it is a configuration error, its traceback;
    ``restarts`` says after how many restarts it failed for good."""
    rank, failure = err.get_first_failure()
    message: Any = failure.message
    stack = ""
    if isinstance(message, dict):  # the error file's {"message": ..., "extraInfo": {...}}
        stack = message.get("extraInfo", {}).get("py_callstack", "")
        message = message.get("message", "")
    if str(message).startswith(ConfigError.__name__):
        stack = ""
    if failure.exitcode < 0:  # killed by a signal: no traceback, say which signal
        message = f"killed by {_signal_name(-failure.exitcode)} (pid {failure.pid})"
    head = f"worker {rank} failed{restarts} (exit code {failure.exitcode}): {message}"
    return f"{head}\n{stack}" if stack else head


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
