"""Run a test body on N gloo ranks in long-lived worker processes.

Spawning a process that imports torch costs seconds, so the harness keeps one pool of
``world_size`` workers per world size alive for the whole pytest session and sends each
test body to it. After warm-up a multi-process test costs milliseconds of overhead. Workers are
forked from a fork server that has imported torch and plait once (``_PRELOAD``), so a new
pool (the first of a world size, or the one replacing a pool a failing test broke) starts in
a fraction of a second rather than importing torch again in every worker: torch's own
distributed tests fork after ``import torch`` too. Each worker takes the test process's
environment as it is when the pool starts, as a spawned process would.

Usage, from a test module (the body must be a module-level function so it pickles)::

    def _body(scale):
        t = torch.ones(1) * dist.get_rank() * scale
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_on_ranks(4, _body, 2.0) == [12.0] * 4

Contract:

* ``run_on_ranks(world_size, fn, *args, timeout=..., **kwargs)`` calls ``fn(*args,
  **kwargs)`` on every rank inside an initialised default process group (gloo, CPU,
  ``torch.set_num_threads(1)``) and returns the per-rank results, indexed by rank.
* Before each body: seeds (torch, random, numpy) are reset to 0, grad mode is on and the
  default dtype is float32. After it, once every rank has finished the body, every process
  group the body created is destroyed (with ``leaves_group_broken`` the workers are
  replaced instead).
* If a rank raises, ``RankError`` is raised here with that rank's traceback (and those of
  any other failing rank); ranks still blocked waiting for it are reported as such.
* If the ranks do not all finish within ``timeout`` seconds, ``RankTimeout`` is raised
  with each stuck rank's Python stack (dumped by faulthandler) so a hang points at the
  collective it is waiting in.
* After any failure the pool is killed and the next test gets fresh, healthy workers
  (a rank that failed may have left unmatched collectives behind).
* Whatever a rank prints goes to a per-rank log file; the part printed by a failing body
  is appended to the error.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from typing import Any

#: What the fork server imports before forking any worker: what every test body needs.
_PRELOAD = ["torch", "torch.distributed", "plait", "plait.train.loop"]
DEFAULT_TIMEOUT = 120.0
_STARTUP_TIMEOUT = 180.0
# After one rank fails, how long the others get to finish (or fail too) before the
# harness stops waiting: they are usually blocked in a collective with the failed rank.
_GRACE_AFTER_FAILURE = 5.0  # time left to the other ranks to report their own error


class RankError(RuntimeError):
    """A test body raised on one or more ranks."""


class RankTimeout(TimeoutError):
    """A test body did not finish on every rank before its deadline."""


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    leaves_group_broken: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; see the module docstring.

    ``leaves_group_broken``: the body abandons collectives on purpose (fault and
    divergence tests), so its workers are replaced afterwards even when it succeeds.
    """
    pool = _POOLS.get(world_size)
    if pool is None or not pool.healthy():
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = _Pool(world_size)
    failed = True
    try:
        result = pool.run(fn, args, kwargs, timeout, settle=not leaves_group_broken)
        failed = False
        return result
    finally:
        if failed or leaves_group_broken:
            pool.close()
            del _POOLS[world_size]


def shutdown_pools() -> None:
    """Stop every worker; called at the end of the pytest session."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def current_pool_pids(world_size: int) -> list[int]:
    """The worker pids of a live pool (for tests of the harness itself)."""
    pool = _POOLS.get(world_size)
    return [] if pool is None else [p.pid for p in pool.procs if p.pid is not None]


def _context() -> Any:
    """The fork server's multiprocessing context, its preloads set (once per process)."""
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = _context()
        self.world_size = world_size
        self.tmpdir = tempfile.mkdtemp(prefix=f"plait-ranks{world_size}-")
        store = os.path.join(self.tmpdir, "store")
        self.logs = [os.path.join(self.tmpdir, f"rank{r}.log") for r in range(world_size)]
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, store, child, self.logs[rank], dict(os.environ)),
                name=f"plait-rank{rank}of{world_size}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        try:
            self._gather("startup", _STARTUP_TIMEOUT, [0] * world_size)
        except BaseException:
            self.close()
            raise

    def healthy(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
        settle: bool = True,
    ) -> list[Any]:
        payload = pickle.dumps((fn, args, kwargs))
        name = getattr(fn, "__qualname__", repr(fn))
        offsets = [os.path.getsize(log) for log in self.logs]
        for conn in self.conns:
            conn.send((list(sys.path), name, payload, settle))
        return self._gather(name, timeout, offsets)

    def _gather(self, name: str, timeout: float, offsets: list[int]) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            by_handle: dict[Any, int] = {}
            for r in pending:
                by_handle[self.conns[r]] = r
                by_handle[self.procs[r].sentinel] = r
            for handle in wait(list(by_handle), timeout=remaining):
                rank = by_handle[handle]
                if rank not in pending:
                    continue
                pending.discard(rank)
                kind, value = self._receive(rank)
                if kind == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)
        if errors:
            raise RankError(self._failure_report(name, errors, pending, offsets))
        if pending:
            raise RankTimeout(self._timeout_report(name, timeout, pending, offsets))
        return results

    def _receive(self, rank: int) -> tuple[str, Any]:
        conn = self.conns[rank]
        try:
            if conn.poll():
                kind, value = conn.recv()
                return kind, value
        except (EOFError, OSError):
            pass
        proc = self.procs[rank]
        proc.join(timeout=5)
        return "error", f"rank {rank} process died (exit code {proc.exitcode})\n"

    def _log_since(self, rank: int, offset: int, limit: int = 4000) -> str:
        try:
            with open(self.logs[rank], errors="replace") as f:
                f.seek(offset)
                text = f.read()
        except OSError:
            return ""
        return text if len(text) <= limit else "...\n" + text[-limit:]

    def _failure_report(
        self, name: str, errors: dict[int, str], pending: set[int], offsets: list[int]
    ) -> str:
        lines = [f"{name} failed on rank(s) {sorted(errors)} of {self.world_size}."]
        if pending:
            lines.append(
                f"Rank(s) {sorted(pending)} had not finished (probably blocked in a collective "
                "with a failed rank); the worker pool was restarted."
            )
        for rank, tb in sorted(errors.items()):
            lines.append(f"\n--- rank {rank} traceback ---\n{tb.rstrip()}")
            output = self._log_since(rank, offsets[rank]).strip()
            if output:
                lines.append(f"--- rank {rank} output ---\n{output}")
        return "\n".join(lines)

    def _timeout_report(
        self, name: str, timeout: float, pending: set[int], offsets: list[int]
    ) -> str:
        for rank in pending:
            pid = self.procs[rank].pid
            if pid is not None and self.procs[rank].is_alive():
                os.kill(pid, signal.SIGUSR1)  # faulthandler dumps the stacks to the log
        time.sleep(0.5)
        lines = [
            f"{name} did not finish on rank(s) {sorted(pending)} of {self.world_size} within "
            f"its {timeout:g} s deadline (a hung or mismatched collective?). The worker pool "
            "was restarted. Where each stuck rank was:"
        ]
        for rank in sorted(pending):
            lines.append(f"\n--- rank {rank} ---\n{self._log_since(rank, offsets[rank]).strip()}")
        return "\n".join(lines)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


_POOLS: dict[int, _Pool] = {}


# ----------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------


def _worker_main(
    rank: int, world_size: int, store: str, conn: Connection, log: str, env: dict[str, str]
) -> None:
    os.environ.clear()  # the test process's environment now, not the fork server's
    os.environ.update(env)
    log_file = open(log, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log_file.fileno(), 1)
    os.dup2(log_file.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log_file, all_threads=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            # The harness deadline, not gloo's, decides when a test has hung.
            timeout=timedelta(seconds=3600),
        )
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        sys_path, name, payload, settle = message
        for entry in sys_path:
            if entry not in sys.path:
                sys.path.append(entry)
        print(f"=== {name} ===", flush=True)
        groups_before = _live_groups()
        try:
            fn, args, kwargs = pickle.loads(payload)
            _reset_state()
            reply: tuple[str, Any] = ("ok", fn(*args, **kwargs))
            pickle.dumps(reply)  # fail here, with a traceback, if the result cannot travel
            if settle and _live_groups() != groups_before:
                # gloo's connection handshake is asymmetric: one rank may return from
                # new_group while its peer still reads the last handshake bytes. A body
                # that never uses its group would then destroy it under the peer
                # ("Connection closed by peer"); all ranks first leave the body together.
                dist.barrier()
        except BaseException:
            reply = ("error", traceback.format_exc())
        finally:
            if settle:
                _destroy_groups_since(groups_before)
            # else: the pool is replaced after this body; destroying its groups now could
            # cancel sends still in flight that a peer of a deliberately failing rank is
            # waiting for (its error must reach the test, not a hang).
        sys.stdout.flush()
        conn.send(reply)
    dist.destroy_process_group()


def _reset_state() -> None:
    import torch

    torch.manual_seed(0)
    random.seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:
        pass
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)


def _live_groups() -> set[Any]:
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_map)


def _destroy_groups_since(before: set[Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, _redistribute

    new = _live_groups() - before
    for group in new:
        dist.destroy_process_group(group)
    if new:
        # DTensor caches sharding decisions by mesh *value*: an identical mesh built by a
        # later body would otherwise get the destroyed groups back.
        torch._C._clear_DTensor_sharding_propagator_cache()
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        _redistribute._gen_transform_infos.cache_clear()
