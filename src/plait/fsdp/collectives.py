"""The collectives of a ``fully_shard`` unit, as stateless functions, and how gradients
are divided around them.

Every rank's contribution to a unit is one *segment* row: its padded chunk of each
parameter, back to back, in the parameters' dtype when they share one and need no padding,
else as bytes (``FSDPParam.gather_offset`` says where). All-gather turns segments into a
(world, segment) matrix; reduce-scatter turns a (world, width + counts) matrix of gradients
back into this rank's reduced row; HSDP then all-reduces that row across replicas. Each
function issues exactly one collective, looked up on ``torch.distributed`` at call time
(tests count calls by patching it), and returns the async work for the caller to wait on.

A user may replace the all-gather or the reduce-scatter by an object following torch's
``AllGather`` / ``ReduceScatter`` protocol (``FSDPModule.set_custom_all_gather``): it
allocates the buffers (``allocate(size, *, dtype, device)``) and runs the collective
(``__call__(output_tensor=, input_tensor=, group=, [op=,] async_op=)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from plait import spmd
from plait.hooks import traced

ReduceOp = dist.ReduceOp


class Comm(Protocol):
    """torch's ``Comm`` protocol: what a custom all-gather or reduce-scatter provides."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...

    def __call__(self, *args: Any, **kwargs: Any) -> dist.Work | None: ...


@dataclass(frozen=True)
class Groups:
    """The process groups a unit communicates over, resolved from its mesh at ``fully_shard``.

    ``shard`` all-gathers and reduce-scatters (``rank`` / ``world`` are this rank's place
    in it); ``None`` for ``replicate``'s units, whose shard "group" is this rank alone and
    never communicates. ``replicate`` all-reduces gradients across shard groups (HSDP, and
    ``replicate``'s data-parallel group), ``None`` for a 1-D ``fully_shard`` mesh;
    ``post_forward`` is the smaller group of ``reshard_after_forward=<int>``.
    """

    shard: dist.ProcessGroup | None
    rank: int
    world: int
    replicate: dist.ProcessGroup | None = None
    replicate_world: int = 1
    post_forward: dist.ProcessGroup | None = None
    post_forward_world: int = 1


def allocate(
    comm: Comm | None, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A communication buffer of ``shape``: from ``comm.allocate`` (flat) when given."""
    if comm is None:
        return torch.empty(shape, dtype=dtype, device=device)
    numel = 1
    for size in shape:
        numel *= size
    return comm.allocate((numel,), dtype=dtype, device=device).view(shape)


def all_gather_segments(
    rows: torch.Tensor,
    group: dist.ProcessGroup | None,
    world: int,
    owner: str,
    comm: Comm | None = None,
) -> tuple[torch.Tensor, dist.Work | None]:
    """Start gathering every rank's ``rows`` (r, n); returns the (world * r, n) output
    (rank after rank) and the work; ``world`` is the size of ``group``.

    ``owner`` names the unit, for divergence reports (:mod:`plait.spmd`). Over one rank
    nothing is communicated: ``rows`` is the result (as torch, no collective runs).
    """
    if world == 1 and comm is None:
        return rows, None
    group = _required(group, owner)
    spmd.record("all_gather", rows, group, owner)
    with traced("plait.fsdp.all_gather", owner):
        shape = (world * rows.shape[0], rows.shape[1])
        if comm is None:
            out = rows.new_empty(shape)
            work = dist.all_gather_single(out, rows, group=group, async_op=True)
        else:  # in place, as torch: the input is this rank's block of the output, which
            # the caller keeps until the wait (a comm need not hold its input itself)
            out = allocate(comm, shape, rows.dtype, rows.device)
            start = dist.get_group_rank(group, dist.get_rank()) * rows.shape[0]
            mine = out[start : start + rows.shape[0]]
            mine.copy_(rows)
            work = comm(
                output_tensor=out.view(-1), input_tensor=mine.view(-1), group=group, async_op=True
            )
    return out, work


def reduce_scatter_segments(
    matrix: torch.Tensor,
    group: dist.ProcessGroup | None,
    owner: str,
    op: Any = ReduceOp.SUM,
    comm: Comm | None = None,
) -> tuple[torch.Tensor, dist.Work | None]:
    """Start reducing ``matrix`` (world, n) over ranks with ``op``; this rank receives its row.

    Over one rank a sum or an average is the row itself: nothing is communicated.
    """
    if matrix.shape[0] == 1 and comm is None and op in (ReduceOp.SUM, ReduceOp.AVG):
        return matrix.view(-1), None
    group = _required(group, owner)
    spmd.record("reduce_scatter", matrix, group, owner)
    with traced("plait.fsdp.reduce_scatter", owner):
        out = allocate(comm, (matrix.shape[1],), matrix.dtype, matrix.device)
        if comm is None:
            work = dist.reduce_scatter_single(
                out, matrix.view(-1), op=op, group=group, async_op=True
            )
        else:
            work = comm(
                output_tensor=out, input_tensor=matrix.view(-1), group=group, op=op, async_op=True
            )
    return out, work


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup, owner: str, op: Any = ReduceOp.SUM
) -> dist.Work | None:
    """Start reducing ``tensor`` in place over ``group`` (across the replicas of a shard:
    HSDP, ``replicate``); returns the work."""
    spmd.record("all_reduce", tensor, group, owner)
    with traced("plait.fsdp.all_reduce", owner):
        return dist.all_reduce(tensor, op=op, group=group, async_op=True)


def _required(group: dist.ProcessGroup | None, owner: str) -> dist.ProcessGroup:
    """``group``, which a collective over more than one rank needs."""
    if group is None:
        raise RuntimeError(f"{owner}: its shard group has one rank and no process group")
    return group


# --- dividing the gradient sum ---------------------------------------------------------------


@dataclass(frozen=True)
class Division:
    """How a unit turns the sum of its ranks' gradients into the gradient it keeps.

    ``pre`` divides the reduce-scatter input, ``between`` its output (before any
    all-reduce), ``post`` the final output (after the all-reduce hook); ``scatter_op`` /
    ``all_reduce_op`` are the collectives' reduce ops (``AVG`` divides inside the
    collective). ``scale`` (plait only) multiplies the input before a ``SUM`` where torch
    would ask for ``PREMUL_SUM``, which only NCCL implements.
    """

    pre: float | None
    post: float | None
    scatter_op: Any
    all_reduce_op: Any
    scale: float | None = None
    between: float | None = None


def gradient_division(
    shard_world: int,
    replicate_world: int,
    reduce_dtype: torch.dtype,
    factor: float | None = None,
    force_sum: bool = False,
    premul_sum: bool = False,
) -> Division:
    """torch's choice of divisions, so that gradients match its ``fully_shard`` bit for bit.

    The default divides the sum by the number of data-parallel ranks (an average);
    ``factor`` replaces that number (``1.0``: a plain sum, for callers that normalise
    themselves). fp32 and bf16 divide inside the collectives (``AVG``, or a pre-multiplied
    sum for a custom factor); other dtypes (fp16), whose range is small, split the
    division into a power of two before the reduction and the rest after it, so neither
    the addends nor the sum overflow or underflow. ``force_sum`` keeps the collectives
    to ``SUM`` and divides outside them. ``premul_sum``: the backend has ``PREMUL_SUM``
    (NCCL); elsewhere the input is scaled by ``1 / factor`` before a ``SUM`` instead.
    """
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    ranks = shard_world * replicate_world
    if shard_world == 1 and factor is not None and not overflow_risk and not force_sum:
        # torch reduces nothing over one shard rank: it divides the copy by the factor.
        # (Where it also pre/post-divides, below, it would divide twice; plait once.)
        return Division(None, None, ReduceOp.SUM, ReduceOp.SUM, between=factor)
    if not overflow_risk and not force_sum:
        if factor is None:
            if ranks == 1:
                return Division(None, None, ReduceOp.SUM, ReduceOp.SUM)
            return Division(None, None, ReduceOp.AVG, ReduceOp.AVG)
        if factor == shard_world:
            return Division(None, None, ReduceOp.AVG, ReduceOp.SUM)
        if premul_sum:
            return Division(None, None, ReduceOp.PREMUL_SUM(1 / factor), ReduceOp.SUM)
        return Division(None, None, ReduceOp.SUM, ReduceOp.SUM, scale=1 / factor)
    if factor is None:
        factor = float(ranks)
    if not overflow_risk:  # forced sums: divide once, after (less data than before)
        return Division(None, factor, ReduceOp.SUM, ReduceOp.SUM)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return Division(pre, factor / pre, ReduceOp.SUM, ReduceOp.SUM)


def divide_(tensor: torch.Tensor, divisor: float | None) -> None:
    if divisor is not None and divisor != 1:
        tensor.div_(divisor)
