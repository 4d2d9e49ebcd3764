"""Divergence detection: every rank must issue the same collectives, in the same order.

When one rank takes a different branch (a module skipped, a different number of
microbatches), collectives stop matching: they pair up wrongly (silently wrong data) or
wait forever. With checking on (``PLAIT_CHECK_SPMD=1`` in the environment, or
:func:`enable`), every collective plait issues is recorded on each rank as (op, group,
dtype, element count, owning module) and folded into a running fingerprint of its group
(ranks of one group must agree; ranks of different groups, such as two pipeline stages
with different parameters, need not), and:

* every wait for a collective has a deadline (``timeout`` seconds);
* at the end of each backward (the APIs call :func:`check`), at the end of each step
  (call :func:`check` after ``optimizer.step()``), and when a wait misses its deadline,
  the ranks compare fingerprints through the job's key-value store (not a collective,
  so it works however the collectives are tangled up). On a mismatch every
  rank raises :class:`DivergenceError` naming the first collective that differs on each
  side; a rank that never reports (dead, or stuck outside plait) is named as lost.

Point-to-point operations (pipeline sends and receives) differ between ranks by nature,
so :func:`record_p2p` keeps them out of the fingerprints: they are named in reports (the
last one each rank posted) and their waits have the same deadline. What the ranks of a
pipeline must agree on is recorded with :func:`agree` instead (the schedule and its
number of microbatches, once per step). Code whose ranks reach the APIs' per-backward
checks at different times (a pipeline: the last stage finishes a backward before the
first can start it) runs them inside :func:`deferred_checks` and checks once afterwards.

Off (the default), :func:`record`, :func:`record_p2p`, :func:`agree` and :func:`check`
return at once and :func:`wait` is a plain ``work.wait()``.

On GPUs (NCCL), whose ``work.wait()`` only makes the current stream wait, a checked wait
also waits on the host until the collective has finished, so its deadline means
something: checking then synchronizes the host with every collective (no overlap; a
debugging mode). A peer that dies there is usually reported first by NCCL's own watchdog
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``), which ends the process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

__all__ = [
    "CollectiveRecord",
    "DivergenceError",
    "PointToPointRecord",
    "RankLostError",
    "agree",
    "check",
    "deferred_checks",
    "enable",
    "enabled",
    "record",
    "record_p2p",
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
        if not self.dtype:  # a value the group agrees on (agree()), nothing communicated
            return f"{self.op} over ranks [{self.group}] for {self.module}"
        return (
            f"{self.op} of {self.numel} x {self.dtype} over ranks [{self.group}] for {self.module}"
        )


@dataclass(frozen=True)
class PointToPointRecord:
    op: str  # "send" or "recv"
    peer: int  # global rank
    dtype: str
    numel: int
    owner: str  # e.g. "gradients of pipeline stage 1 microbatch 3"

    def describe(self) -> str:
        direction = "to" if self.op == "send" else "from"
        what = f"{self.op} of {self.numel} x {self.dtype}"
        return f"{what} {direction} rank {self.peer} for {self.owner}"


@dataclass
class _Checker:
    timeout: float
    generation: int  # which enable() call: keys of earlier runs in the same store differ
    records: list[CollectiveRecord]
    p2p: list[PointToPointRecord] = field(default_factory=list)
    fingerprints: dict[str, int] = field(default_factory=dict)  # per group
    round: int = 0


_checker: _Checker | None = None
_generation = 0  # enable() calls so far; every rank makes the same calls
_deferred = 0  # depth of deferred_checks() blocks
# id(group) -> (weak reference to the group, name): a destroyed group's id may be reused
_group_names: dict[int, tuple[Callable[[], dist.ProcessGroup | None], str]] = {}
_P2P_KEPT = 64  # point-to-point records kept per rank between checks (for reports)


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
    """The group's global ranks, e.g. ``"0,2"``."""
    cached = _group_names.get(id(group))
    if cached is None or cached[0]() is not group:
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        if ranks is None:
            ranks = list(range(dist.get_world_size()))
        ref = weakref.ref(group) if group is not None else lambda: None
        cached = _group_names[id(group)] = (ref, ",".join(map(str, ranks)))
    return cached[1]


def record(op: str, tensor: torch.Tensor, group: dist.ProcessGroup | None, module: str) -> None:
    """Note a collective this rank is about to issue (free when checking is off)."""
    checker = _checker
    if checker is None:
        return
    entry = CollectiveRecord(op, _group_name(group), str(tensor.dtype), tensor.numel(), module)
    _add(checker, entry)


def agree(op: str, value: int, group: dist.ProcessGroup | None, owner: str) -> None:
    """Note something every rank of ``group`` must agree on at this point, such as a
    pipeline step's number of microbatches: compared like a collective, though nothing is
    communicated. ``owner`` says what it is, for reports."""
    checker = _checker
    if checker is None:
        return
    _add(checker, CollectiveRecord(op, _group_name(group), "", value, owner))


def _add(checker: _Checker, entry: CollectiveRecord) -> None:
    checker.records.append(entry)
    previous = checker.fingerprints.get(entry.group, 0)
    checker.fingerprints[entry.group] = zlib.crc32(repr(entry).encode(), previous)


def record_p2p(op: str, tensor: torch.Tensor, peer: int, owner: str) -> None:
    """Note a point-to-point ``op`` ("send" / "recv") with global rank ``peer``.

    Not compared across ranks (their sends and receives differ by nature); the last ones
    are named in divergence reports.
    """
    checker = _checker
    if checker is None:
        return
    checker.p2p.append(PointToPointRecord(op, peer, str(tensor.dtype), tensor.numel(), owner))
    if len(checker.p2p) > 2 * _P2P_KEPT:
        del checker.p2p[:-_P2P_KEPT]


@contextlib.contextmanager
def deferred_checks() -> Iterator[None]:
    """Inside, :func:`check` does nothing; the caller checks once after the block.

    For code whose ranks reach the APIs' end-of-backward checks at different times, such
    as a pipeline step: comparing there would make the last stage wait for the first,
    which is itself waiting for the last stage's gradients. Deadlines still hold.
    """
    global _deferred
    _deferred += 1
    try:
        yield
    finally:
        _deferred -= 1


def wait(work: dist.Work | None, what: str, owner: str = "") -> None:
    """Wait for ``work``; with checking on, past the deadline compare ranks and raise.

    ``what`` (and ``owner``, when given: "``what`` of ``owner``") names the operation in
    errors; the two are joined only when an error needs them. Checking on or off, a
    collective that fails (a peer died) raises :class:`RankLostError` naming the ranks
    that no longer answer.
    """
    if work is None:
        return
    checker = _checker
    if checker is None:
        try:
            work.wait()
        except RuntimeError as error:
            _name_lost_ranks(_describe(what, owner), error)
            raise
        return
    what = _describe(what, owner)
    # Waited on a helper thread: ``work.wait(timeout)`` is not honoured by every backend's
    # collective (gloo's reduce-scatter waits forever, and only progresses inside wait()).
    done = _waiter().submit(_wait_on, work, _current_stream())
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


def _current_stream() -> Any:
    """The calling thread's current CUDA stream (None without CUDA in use)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_stream()
    return None


def _wait_on(work: dist.Work, stream: Any) -> None:
    """``work.wait()`` with ``stream`` current: a device backend's wait (NCCL's) makes the
    current stream wait, and on a helper thread that must be the caller's, not the
    helper's own; then, with a stream, until the collective has finished (checking on
    synchronizes the host with every collective: a debugging mode)."""
    if stream is None:
        work.wait()
        return
    # The helper thread's current device starts as 0: make it the stream's first, or
    # leaving the stream context would restore device 0 and create a context there on
    # every rank.
    torch.cuda.set_device(stream.device)
    with torch.cuda.stream(stream):
        work.wait()
    # A device backend's wait (NCCL's) only orders the stream and returns at once: the
    # deadline holds only if the host sees the collective finish.
    while not work.is_completed():
        time.sleep(1e-4)


def check(where: str = "end of step") -> None:
    """Raise :class:`DivergenceError` if ranks issued different collectives since the last
    check, or reached different checks (``where`` names this one).

    plait's APIs check at the end of each backward; call it once per training step (after
    ``optimizer.step()``) so that a rank running more or fewer backwards is caught too.
    """
    checker = _checker
    if checker is not None and not _deferred and dist.is_initialized():
        _compare(checker, where)


def _describe(what: str, owner: str) -> str:
    return f"{what} of {owner}" if owner else what


@functools.cache
def _waiter() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plait-spmd-wait")


def _fault_timeout() -> float:
    return float(os.environ.get("PLAIT_FAULT_TIMEOUT", "10"))


def _name_lost_ranks(what: str, error: BaseException) -> None:
    """After a failed collective: every survivor reports in; raise naming who did not."""
    try:
        _exchange(f"plait/alive/{_generation}", "1", _fault_timeout())
    except _Missing as missing:
        raise RankLostError(
            f"plait: {what} failed ({error}); rank(s) {missing.ranks} did not answer within "
            f"{_fault_timeout():g} s (PLAIT_FAULT_TIMEOUT): they were lost (the process died "
            "or hung). Restart the job, e.g. plait train --resume."
        ) from error


class _Missing(Exception):
    def __init__(self, ranks: list[int]) -> None:
        super().__init__(ranks)
        self.ranks = ranks


def _exchange(prefix: str, mine: str, timeout: float) -> list[str]:
    """Publish ``mine`` under ``prefix`` and read every rank's value, through the store.

    Not a collective, so it works whatever state the process groups are in; raises
    :class:`_Missing` naming the ranks that did not publish within ``timeout`` seconds.
    """
    store, world = default_store(), dist.get_world_size()
    keys = [f"{prefix}/{r}" for r in range(world)]
    store.set(keys[dist.get_rank()], mine)
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError as error:
        raise _Missing([r for r, key in enumerate(keys) if not store.check([key])]) from error
    return [store.get(key).decode() for key in keys]


def default_store() -> Store:
    """The job's key-value store (the one ``init_process_group`` rendezvoused through).

    plait talks through it where a collective cannot be trusted: divergence checks here,
    schedule agreement and abort reasons in the pipeline. Looked up at call time, so it
    follows the current default process group.
    """
    # torch exposes the default group's store only through this private accessor; one
    # definition keeps that reach into c10d in one place.
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _compare(checker: _Checker, where: str) -> None:
    """Publish this rank's fingerprint, read everyone's, raise on a difference."""
    prefix = f"plait/spmd/{checker.generation}/{checker.round}"
    checker.round += 1
    mine = {"fingerprints": checker.fingerprints, "where": where}
    summaries = _read_all(f"{prefix}/fp", mine, 2 * checker.timeout, where)
    records, p2p = checker.records, checker.p2p[-_P2P_KEPT:]
    checker.records, checker.p2p, checker.fingerprints = [], [], {}
    differing = _differing_groups(summaries)
    if not differing and all(s["where"] == where for s in summaries):
        return
    # Every rank sees the same mismatch, so every rank takes part in this second round.
    log = {"collectives": [asdict(r) for r in records], "p2p": [asdict(r) for r in p2p]}
    logs = _read_all(f"{prefix}/log", log, 2 * checker.timeout, where)
    raise DivergenceError(_explain(logs, summaries, differing))


def _differing_groups(summaries: list[dict[str, Any]]) -> list[str]:
    """The groups whose member ranks recorded different collectives, in first-seen order."""
    groups = list(dict.fromkeys(g for s in summaries for g in s["fingerprints"]))
    differing = []
    for group in groups:
        members = [int(r) for r in group.split(",") if int(r) < len(summaries)]
        if len({summaries[m]["fingerprints"].get(group) for m in members}) > 1:
            differing.append(group)
    return differing


def _read_all(prefix: str, mine: Any, timeout: float, where: str) -> list[Any]:
    """Every rank's JSON value published under ``prefix`` (this rank's is ``mine``)."""
    try:
        return [json.loads(v) for v in _exchange(prefix, json.dumps(mine), timeout)]
    except _Missing as missing:
        raise DivergenceError(
            f"plait: rank(s) {missing.ranks} did not reach the collective check ({where}) "
            f"within {timeout:g} s: they were lost (died or hung outside plait's collectives)"
        ) from missing


def _explain(
    logs: list[dict[str, Any]], summaries: list[dict[str, Any]], differing: list[str]
) -> str:
    """Name, per group that differs, the first collective at which its ranks' logs differ."""
    entries = [[CollectiveRecord(**e) for e in log["collectives"]] for log in logs]
    lines = []
    for group in differing[:3]:
        members = [int(r) for r in group.split(",") if int(r) < len(entries)]
        issued = {m: [e for e in entries[m] if e.group == group] for m in members}
        index = 0
        while all(index < len(e) for e in issued.values()) and (
            len({e[index] for e in issued.values()}) == 1
        ):
            index += 1
        lines.append(
            f"plait: ranks issued different collectives over ranks [{group}] (collective "
            f"#{index} of this step on that group differs; every rank of a group must issue "
            "the same collectives in the same order):"
        )
        for rank, rank_entries in issued.items():
            what = (
                rank_entries[index].describe()
                if index < len(rank_entries)
                else f"nothing (it issued only {len(rank_entries)})"
            )
            lines.append(f"  rank {rank} ({summaries[rank]['where']}): {what}")
    if not differing:
        lines.append(
            "plait: ranks reached different checks although every group issued the same "
            "collectives (a rank ran more or fewer steps or backwards, or is stuck):"
        )
        lines += [f"  rank {rank}: {s['where']}" for rank, s in enumerate(summaries)]
    for rank, log in enumerate(logs):
        if log["p2p"]:
            last = PointToPointRecord(**log["p2p"][-1]).describe()
            lines.append(f"  rank {rank}'s last point-to-point operation: {last}")
    lines.append(
        "A module that runs on some ranks only, a different number of microbatches per "
        "rank, or a rank that runs more steps than the others causes this. For modules "
        "that may not run everywhere, pass conditional=True to fully_shard so their "
        "collectives always run (replicate already reduces the gradients of modules that "
        "did not run)."
    )
    return "\n".join(lines)
