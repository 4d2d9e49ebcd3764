"""Routed rows split over a group of ranks that hold the same tokens (tensor parallelism).

Tensor-parallel ranks see the same tokens. Their routed experts need not all compute the
same rows: :func:`split_rows` gives each rank one contiguous chunk of the expert-sorted
rows (and the per-expert counts of that chunk), :func:`gather_rows` puts the chunks' outputs
back together on every rank. Both are differentiable and mirror each other: a chunk taken
in forward is all-gathered in backward (each rank's input-row gradients cover its chunk
only, and the model outside the experts needs them whole and alike on every rank), and an
all-gather in forward is a chunk taken in backward (the gradient of the gathered rows is
already whole and alike). The experts' weight gradients then cover only each rank's
chunk: their sum over the group is the gradient of the whole batch, which the experts'
``fully_shard`` group (spanning the group's ranks) makes by averaging gradients that
:func:`scale_grad` multiplied by the group's size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.hooks import traced

__all__ = ["gather_rows", "scale_grad", "split_rows"]


class _ScaleGrad(torch.autograd.Function):
    """The identity in forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x``, whose gradient is multiplied by ``scale`` (nothing recorded for 1)."""
    if scale == 1.0 or not x.requires_grad:
        return x
    out: torch.Tensor = _ScaleGrad.apply(x, scale)
    return out


def _all_gather(chunk: torch.Tensor, group: dist.ProcessGroup, label: str) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = chunk.new_empty((chunk.shape[0] * size, *chunk.shape[1:]))
    with traced(label):
        dist.all_gather_single(out, chunk.contiguous(), group=group)
    return out


def _chunk(rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    return rows.chunk(size)[dist.get_rank(group)]


class _Split(torch.autograd.Function):
    """This rank's chunk of the rows; backward all-gathers the chunks' gradients."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _chunk(rows, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group, "experts.split_rows.backward"), None


class _Gather(torch.autograd.Function):
    """Every rank's chunk, concatenated in rank order; backward takes this rank's."""

    @staticmethod
    def forward(ctx: Any, chunk: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather(chunk, group, "experts.gather_rows")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _chunk(grad, ctx.group).contiguous(), None


def split_rows(
    rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous chunk of the expert-sorted ``rows`` ``(n, dim)`` (``n``
    divisible by the group's size) and its rows per expert, from ``counts`` ``(E,)`` of all
    the rows. Differentiable (module docstring)."""
    size = dist.get_world_size(group)
    chunk = rows.shape[0] // size
    low = dist.get_rank(group) * chunk
    ends = counts.cumsum(0)
    starts = ends - counts
    # Each expert's run of rows, [start, end), cut to this rank's [low, low + chunk).
    mine = (ends.clamp(max=low + chunk) - starts.clamp(min=low)).clamp(min=0)
    part: torch.Tensor = _Split.apply(rows, group)
    return part, mine


def gather_rows(chunk: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``chunk`` ``(n / size, dim)``, concatenated in rank order: ``(n, dim)``.
    Differentiable (module docstring)."""
    out: torch.Tensor = _Gather.apply(chunk, group)
    return out
