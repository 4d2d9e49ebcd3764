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
would hang the GPUs. :func:`plait.pipeline.in_order.check_in_order` runs the same rules on
paper, for any order.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from plait.pipeline import p2p


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
