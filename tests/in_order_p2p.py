"""NCCL's point-to-point semantics, emulated on gloo, so that CPU tests catch what would
hang a pipeline on GPUs.

gloo and NCCL differ in three ways that matter to a pipeline runtime:

* **Matching.** gloo matches a receive with the send of the same source *and tag*; NCCL
  ignores tags and matches the messages between two ranks in the order they were posted.
  Emulated by posting every operation with tag 0 (gloo then matches in order too).
* **One stream.** NCCL runs a communicator's operations one group after another on one
  stream: an operation starts only once every earlier one of this rank has completed, so
  a receive posted early holds back every send posted after it. gloo runs each on its own.
  Emulated by one thread per process that posts each batch, waits for all of it, then
  takes the next.
* **Coalescing.** ``batch_isend_irecv`` on NCCL returns one work for the whole batch
  (its group), so whoever waits for one receive of it waits for all of its operations.
  Emulated by returning one work per batch of more than one operation.

The pipeline runtime is told it runs on such a backend
(:func:`plait.pipeline.p2p.matches_in_order`). The compute that waits for a work (the CUDA
stream, on a GPU) is the calling thread here: a wait that would stall the GPU stalls the
test, and a cycle of such waits between ranks hangs it until the harness's deadline, as it
would hang the GPUs. :func:`replay_in_order` runs the same rules on paper, for any order.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist

from plait.pipeline import p2p
from plait.pipeline.actions import Action, ActionKind, Schedule

K = ActionKind


class _BatchWork:
    """The one work NCCL gives for a batch: done when every operation of it is."""

    def __init__(self, future: concurrent.futures.Future[None]) -> None:
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        self._future.result()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None


@contextlib.contextmanager
def in_order_p2p() -> Iterator[None]:
    """Within the block, ``torch.distributed.batch_isend_irecv`` behaves as on NCCL (module
    docstring). Call on every rank; the pipeline group must use gloo."""
    real = dist.batch_isend_irecv
    stream = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="in-order-p2p")

    def run(ops: list[dist.P2POp]) -> None:
        untagged = [
            dist.P2POp(op.op, op.tensor, group=op.group, group_peer=op.group_peer) for op in ops
        ]
        for work in real(untagged):
            work.wait()

    def batch_isend_irecv(ops: list[dist.P2POp]) -> list[Any]:
        return [_BatchWork(stream.submit(run, list(ops)))]

    matches_in_order = p2p.matches_in_order
    dist.batch_isend_irecv = batch_isend_irecv  # type: ignore[assignment]
    p2p.matches_in_order = lambda device: True  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.batch_isend_irecv = real  # type: ignore[assignment]
        p2p.matches_in_order = matches_in_order  # type: ignore[assignment]
        stream.shutdown(wait=False, cancel_futures=True)


def replay_in_order(
    schedule: Schedule, owners: Mapping[int, int], *, first_step: bool = False
) -> str | None:
    """Run a lowered order on paper as NCCL runs it; None if it completes, else where each
    rank is stuck.

    Each rank's consecutive send / receive actions form one batch, posted on its one
    stream when the rank's program reaches it; a batch starts once the rank's earlier
    batches are done, and each of its operations completes once the peer has posted the
    matching one in a started batch. Messages between two ranks match in posting order,
    and the k-th send from a rank to another must be the transfer the k-th receive there
    expects (else the data lands in the wrong buffer: reported as such). A compute
    action waits for the batch holding its receive; sends never hold the program up.
    ``owners``: each stage's rank. ``first_step``: as the runtime's first step, whose
    activation receives have no agreed metadata yet: each ends its batch, and the program
    waits for that batch right there (the receive is settled in place).
    """
    programs: dict[int, list[tuple[str, Any]]] = {}
    for rank, actions in schedule.items():
        items: list[tuple[str, Any]] = []
        for a in actions:
            if a.kind.is_comm:
                if not items or items[-1][0] != "batch":
                    items.append(("batch", []))
                items[-1][1].append(a)
                if first_step and a.kind is K.RECV_F:
                    items.append(("settle", a))
            elif a.kind.is_compute:
                items.append(("compute", a))
        programs[rank] = items
    position = dict.fromkeys(programs, 0)
    streams: dict[int, list[list[tuple[str, tuple[int, int], int, Action]]]] = {
        r: [] for r in programs
    }
    started = dict.fromkeys(programs, 0)  # index of each stream's running batch
    counts: dict[tuple[str, tuple[int, int]], list[Action]] = {}
    batch_of: dict[tuple[int, Action], int] = {}
    complete: set[tuple[str, tuple[int, int], int]] = set()
    mismatches: list[str] = []  # (sending stage, microbatch, forward) at the two ends

    def post(rank: int, actions: list[Action]) -> None:
        ops = []
        for a in actions:
            sends = a.kind in (K.SEND_F, K.SEND_B)
            forward = a.kind in (K.SEND_F, K.RECV_F)
            other = a.stage + (1 if forward else -1) if sends else a.stage - (1 if forward else -1)
            link = (rank, owners[other]) if sends else (owners[other], rank)
            kind = "send" if sends else "recv"
            seen = counts.setdefault((kind, link), [])
            # the transfer both ends name: (sending stage, microbatch, direction)
            transfer = Action(a.stage if sends else other, a.kind, a.microbatch)
            seen.append(transfer)
            mate = counts.get(("recv" if sends else "send", link), [])
            k = len(seen) - 1
            if k < len(mate):
                mine = (transfer.stage, transfer.microbatch, forward)
                theirs = (mate[k].stage, mate[k].microbatch, mate[k].kind in (K.SEND_F, K.RECV_F))
                if mine != theirs:
                    mismatches.append(f"{link[0]} to {link[1]}, message {k}: {mine} / {theirs}")
            ops.append((kind, link, k, a))
            if not sends:
                batch_of[(rank, a)] = len(streams[rank])
        streams[rank].append(ops)

    moved = True
    while moved:
        moved = False
        for rank, items in programs.items():
            while position[rank] < len(items):
                kind, item = items[position[rank]]
                if kind == "compute":
                    needs = [b for (r, a), b in batch_of.items() if r == rank and _feeds(a, item)]
                    if any(started[rank] <= b for b in needs):
                        break
                elif kind == "settle":
                    if started[rank] <= batch_of[(rank, item)]:
                        break
                else:
                    post(rank, item)
                position[rank] += 1
                moved = True
        running = {
            (kind, link, k)
            for r in programs
            if started[r] < len(streams[r])
            for kind, link, k, _ in streams[r][started[r]]
        }
        for rank in programs:
            if started[rank] == len(streams[rank]):
                continue
            ops = streams[rank][started[rank]]
            for kind, link, k, _ in ops:
                mate = ("recv" if kind == "send" else "send", link, k)
                if mate in running and (kind, link, k) not in complete:
                    complete.add((kind, link, k))
                    moved = True
            if all((kind, link, k) in complete for kind, link, k, _ in ops):
                started[rank] += 1
                moved = True
    stuck = []
    for r, items in programs.items():
        if position[r] < len(items) or started[r] < len(streams[r]):
            at = items[position[r]][1] if position[r] < len(items) else "its end"
            head = streams[r][started[r]] if started[r] < len(streams[r]) else []
            stuck.append(f"rank {r} at {at}, its stream at {[str(op[3]) for op in head]}")
    if mismatches:
        return "mismatched messages: " + "; ".join(mismatches)
    return "; ".join(stuck) or None


def _feeds(recv: Action, compute: Action) -> bool:
    """Whether ``recv`` brings ``compute`` its input."""
    if recv.microbatch != compute.microbatch or recv.stage != compute.stage:
        return False
    if recv.kind is K.RECV_F:
        return compute.kind is K.FORWARD
    return compute.kind.produces_input_grad
