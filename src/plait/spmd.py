"""Divergence detection: every rank must issue the same collectives, in the same order.

When one rank takes a different branch (a module skipped, a different number of
microbatches), collectives stop matching: they pair up wrongly (silently wrong data) or
wait forever. With checking on (``PLAIT_CHECK_SPMD=1`` in the environment, or
:func:`enable`), every collective plait issues is recorded on each rank as (op, group,
dtype, element count, owning module) and folded into a running fingerprint, and:

* every wait for a collective has a deadline (``timeout`` seconds);
* at the end of each backward (the APIs call :func:`check`), at the end of each step
  (call :func:`check` after ``optimizer.step()``), and when a wait misses its deadline,
  the ranks compare fingerprints through the job's key-value store (not a collective,
  so it works however the collectives are tangled up). On a mismatch every
  rank raises :class:`DivergenceError` naming the first collective that differs on each
  side; a rank that never reports (dead, or stuck outside plait) is named as lost.

Off (the default), :func:`record` and :func:`check` return at once and :func:`wait` is a
plain ``work.wait()``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import os
import zlib
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

__all__ = [
    "CollectiveRecord",
    "DivergenceError",
    "RankLostError",
    "check",
    "enable",
    "enabled",
    "record",
    "wait",
]

logger = logging.getLogger(__name__)


class DivergenceError(RuntimeError):
    """Ranks issued different collectives, or a rank stopped answering."""


class RankLostError(DivergenceError):
    """A collective failed because a rank died or stopped answering; names the rank."""


@dataclass(frozen=True)
class CollectiveRecord:
    op: str
    group: str  # the group's global ranks, e.g. "0,1,2,3"
    dtype: str
    numel: int
    module: str  # who issued it, e.g. "fully_shard unit 'blocks.1'"

    def describe(self) -> str:
        return (
            f"{self.op} of {self.numel} x {self.dtype} over ranks [{self.group}] for {self.module}"
        )


@dataclass
class _Checker:
    timeout: float
    generation: int  # which enable() call: keys of earlier runs in the same store differ
    records: list[CollectiveRecord]
    fingerprint: int = 0
    round: int = 0


_checker: _Checker | None = None
_generation = 0  # enable() calls so far; every rank makes the same calls
_group_names: dict[int, str] = {}


def enable(timeout: float = 60.0) -> None:
    """Start checking on this rank (call on every rank, before the step to check)."""
    global _checker, _generation
    if timeout <= 0:
        raise ValueError(f"spmd.enable: timeout must be positive seconds, got {timeout}")
    _generation += 1
    _checker = _Checker(timeout, _generation, [])


def disable() -> None:
    global _checker
    _checker = None


def enabled() -> bool:
    return _checker is not None


if os.environ.get("PLAIT_CHECK_SPMD", "0") not in ("", "0"):
    enable(float(os.environ.get("PLAIT_SPMD_TIMEOUT", "60")))


def _group_name(group: dist.ProcessGroup | None) -> str:
    key = id(group)
    if key not in _group_names:
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        if ranks is None:
            ranks = list(range(dist.get_world_size()))
        _group_names[key] = ",".join(map(str, ranks))
    return _group_names[key]


def record(op: str, tensor: torch.Tensor, group: dist.ProcessGroup | None, module: str) -> None:
    """Note a collective this rank is about to issue (free when checking is off)."""
    checker = _checker
    if checker is None:
        return
    entry = CollectiveRecord(op, _group_name(group), str(tensor.dtype), tensor.numel(), module)
    checker.records.append(entry)
    checker.fingerprint = zlib.crc32(repr(entry).encode(), checker.fingerprint)


def wait(work: dist.Work | None, what: str) -> None:
    """Wait for ``work``; with checking on, past the deadline compare ranks and raise.

    Checking on or off, a collective that fails (a peer died) raises
    :class:`RankLostError` naming the ranks that no longer answer.
    """
    if work is None:
        return
    checker = _checker
    if checker is None:
        try:
            work.wait()
        except RuntimeError as error:
            _name_lost_ranks(what, error)
            raise
        return
    # Waited on a helper thread: ``work.wait(timeout)`` is not honoured by every backend's
    # collective (gloo's reduce-scatter waits forever, and only progresses inside wait()).
    done = _waiter().submit(work.wait)
    try:
        done.result(timeout=checker.timeout)
    except RuntimeError as error:  # the backend gave up: find out who is gone
        _name_lost_ranks(what, error)
        raise
    except concurrent.futures.TimeoutError:
        _compare(checker, f"stuck in {what} for {checker.timeout:g} s")  # raises if diverged
        raise DivergenceError(
            f"plait: {what} did not complete within {checker.timeout:g} s although every "
            "rank issued the same collectives: a rank is slow or its communication failed"
        ) from None


def check(where: str = "end of step") -> None:
    """Raise :class:`DivergenceError` if ranks issued different collectives since the last
    check, or reached different checks (``where`` names this one).

    plait's APIs check at the end of each backward; call it once per training step (after
    ``optimizer.step()``) so that a rank running more or fewer backwards is caught too.
    """
    checker = _checker
    if checker is not None and dist.is_initialized():
        _compare(checker, where)


@functools.cache
def _waiter() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plait-spmd-wait")


def _fault_timeout() -> float:
    return float(os.environ.get("PLAIT_FAULT_TIMEOUT", "10"))


def _name_lost_ranks(what: str, error: BaseException) -> None:
    """After a failed collective: every survivor reports in; raise naming who did not."""
    store, rank, world = _store(), dist.get_rank(), dist.get_world_size()
    keys = [f"plait/alive/{_generation}/{r}" for r in range(world)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, timedelta(seconds=_fault_timeout()))
    except RuntimeError:
        lost = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RankLostError(
            f"plait: {what} failed ({error}); rank(s) {lost} did not answer within "
            f"{_fault_timeout():g} s (PLAIT_FAULT_TIMEOUT): they were lost (the process died "
            "or hung). Restart the job, e.g. plait train --resume."
        ) from error


def _store() -> Store:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _compare(checker: _Checker, where: str) -> None:
    """Publish this rank's fingerprint, read everyone's, raise on a difference."""
    store, rank, world = _store(), dist.get_rank(), dist.get_world_size()
    prefix = f"plait/spmd/{checker.generation}/{checker.round}"
    checker.round += 1
    mine = {"fingerprint": checker.fingerprint, "count": len(checker.records), "where": where}
    store.set(f"{prefix}/fp/{rank}", json.dumps(mine))
    summaries = _read_all(store, f"{prefix}/fp", world, 2 * checker.timeout, where)
    records, checker.records, checker.fingerprint = checker.records, [], 0
    if all((s["fingerprint"], s["where"]) == (mine["fingerprint"], where) for s in summaries):
        return
    # Every rank sees the same mismatch, so every rank takes part in this second round.
    store.set(f"{prefix}/log/{rank}", json.dumps([asdict(r) for r in records]))
    logs = _read_all(store, f"{prefix}/log", world, 2 * checker.timeout, where)
    raise DivergenceError(_explain(logs, summaries))


def _read_all(store: Store, prefix: str, world: int, timeout: float, where: str) -> list[Any]:
    keys = [f"{prefix}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError as error:
        lost = [r for r, key in enumerate(keys) if not store.check([key])]
        raise DivergenceError(
            f"plait: rank(s) {lost} did not reach the collective check ({where}) within "
            f"{timeout:g} s: they were lost (died or hung outside plait's collectives)"
        ) from error
    return [json.loads(store.get(key)) for key in keys]


def _explain(logs: list[list[dict[str, Any]]], summaries: list[dict[str, Any]]) -> str:
    """Name the first collective at which the ranks' logs differ."""
    entries = [[CollectiveRecord(**e) for e in log] for log in logs]
    index = 0
    while all(index < len(e) for e in entries) and len({e[index] for e in entries}) == 1:
        index += 1
    lines = [
        f"plait: ranks issued different collectives (collective #{index} of this step differs; "
        "every rank must issue the same collectives in the same order):"
    ]
    for rank, rank_entries in enumerate(entries):
        what = (
            rank_entries[index].describe()
            if index < len(rank_entries)
            else f"nothing (it issued only {len(rank_entries)})"
        )
        lines.append(f"  rank {rank} ({summaries[rank]['where']}): {what}")
    lines.append(
        "A module that runs on some ranks only, or a different number of microbatches per "
        "rank, causes this. For modules that may not run everywhere, pass "
        "conditional=True to fully_shard so their collectives always run (replicate "
        "already reduces the gradients of modules that did not run)."
    )
    return "\n".join(lines)
