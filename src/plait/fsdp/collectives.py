"""The two collectives of a ``fully_shard`` unit, as stateless functions.

Every rank's contribution to a unit is one *segment* row: its padded chunk of each
parameter, back to back, in the parameters' dtype when they share one and need no padding,
else as bytes (``FSDPParam.gather_offset`` says where). All-gather turns segments into a
(world, segment) matrix; reduce-scatter turns a (world, width +
counts) matrix of gradients back into this rank's reduced row; HSDP then all-reduces that
row across replicas. Each function issues exactly one
collective, looked up on ``torch.distributed`` at call time (tests count calls by patching
it), and returns the async work for the caller to wait on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait import spmd
from plait.hooks import traced


def all_gather_segments(
    rows: torch.Tensor, group: dist.ProcessGroup, world: int, owner: str
) -> tuple[torch.Tensor, dist.Work | None]:
    """Start gathering every rank's ``rows`` (r, n); returns the (world * r, n) output
    (rank after rank) and the work; ``world`` is the size of ``group``.

    ``owner`` names the unit, for divergence reports (:mod:`plait.spmd`).
    """
    spmd.record("all_gather", rows, group, owner)
    with traced("plait.fsdp.all_gather"):
        out = rows.new_empty((world * rows.shape[0], rows.shape[1]))
        work = dist.all_gather_single(out, rows, group=group, async_op=True)
    return out, work


def reduce_scatter_segments(
    matrix: torch.Tensor, group: dist.ProcessGroup, owner: str
) -> tuple[torch.Tensor, dist.Work | None]:
    """Start summing ``matrix`` (world, n) over ranks; this rank receives its row."""
    spmd.record("reduce_scatter", matrix, group, owner)
    with traced("plait.fsdp.reduce_scatter"):
        out = matrix.new_empty(matrix.shape[1])
        work = dist.reduce_scatter_single(out, matrix.view(-1), group=group, async_op=True)
    return out, work


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup, owner: str) -> None:
    """Sum ``tensor`` in place over ``group`` (HSDP: across the replicas of a shard)."""
    spmd.record("all_reduce", tensor, group, owner)
    with traced("plait.fsdp.all_reduce"):
        spmd.wait(dist.all_reduce(tensor, group=group, async_op=True), "all_reduce", owner)
