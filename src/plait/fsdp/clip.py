"""Gradient-norm clipping for sharded (DTensor) and replicated gradients.

``clip_grad_norm_`` is ``torch.nn.utils.clip_grad_norm_`` for gradients spread over
ranks. A rank sees three kinds of gradient:

* a DTensor: each mesh dimension is either ``Shard`` (the ranks along it hold disjoint
  pieces, which are summed: an all-reduce along that dimension) or ``Replicate`` (they
  hold the same piece, which counts once: no communication). 1-D ``fully_shard`` grads
  are ``(Shard(0),)``; HSDP grads are ``(Replicate(), Shard(0))``; over tensor-parallel
  parameters they add the TP placements (``_StridedShard`` when dp and tp split one dim);
* a plain tensor: replicated on every rank (``replicate``, or parameters no API shards),
  counted once;
* with ``group``: the ranks of ``group`` hold disjoint sets of parameters (pipeline
  stages), so the per-rank totals are summed over it as well.

Each rank sums ``|g|^p`` over its local pieces, one partial sum per distinct set of mesh
dimensions to reduce over, so there is one all-reduce per distinct process group, not one
per parameter (for the inf-norm: the maximum and ``MAX`` reductions). Every rank then holds
the same total norm, and scales its local gradients in place by torch's factor
``min(1, max_norm / (total + 1e-6))``. Gradients may live on CPU (offloaded) while the
mesh communicates on an accelerator: the partial sums travel on the group's device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from plait import spmd
from plait.mesh import collective_device

__all__ = ["clip_grad_norm_"]

# The process groups one partial sum is all-reduced over, in mesh-dimension order.
_Groups = tuple[dist.ProcessGroup, ...]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place so their global norm is at most ``max_norm``.

    A collective: every rank of the gradients' meshes (and of ``group``) must call it with
    parameters of the same kinds (meshes and placements) in the same order. Returns the
    total norm of all gradients, before clipping, as a plain tensor (the same on every
    rank), on the device of the first gradient. ``norm_type`` may be ``inf``.
    ``error_if_nonfinite`` raises on every rank alike if the norm is nan or inf;
    ``foreach`` is accepted for torch compatibility (the foreach kernels are always used
    where the device supports them).
    """
    del foreach
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]  # a rank may have none (stages)
    norm_type = float(norm_type)
    infinite = math.isinf(norm_type)
    by_groups: dict[_Groups, list[torch.Tensor]] = {}
    pieces: list[torch.Tensor] = []
    for grad in grads:
        local, groups = _local_and_groups(grad)
        # What is scaled is the gradient's own local tensor: for a pending sum (Partial) the
        # norm needs the finished sum, but scaling every rank's part scales the sum.
        pieces.append(grad._local_tensor if isinstance(grad, DTensor) else grad)
        by_groups.setdefault(groups, []).append(local)
    device = pieces[0].device if pieces else torch.device("cpu")
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in pieces) else torch.float32

    # Per set of groups: sum |g|^p (max |g|) over every rank holding a piece.
    partials = [torch.zeros((), dtype=dtype, device=device)]
    for groups, tensors in by_groups.items():
        partial = _partial(tensors, norm_type, dtype, device)
        for pg in groups:
            partial = _all_reduce(partial, pg, infinite)
        partials.append(partial.to(device))
    total = _combine(torch.stack(partials), infinite)
    if group is not None:
        total = _all_reduce(total, group, infinite).to(device)
    if not infinite:
        total = total ** (1.0 / norm_type)

    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    _scale_(pieces, coef)
    return total


def _local_and_groups(grad: torch.Tensor) -> tuple[torch.Tensor, _Groups]:
    """``grad``'s local piece and the groups over which its pieces are disjoint."""
    if not isinstance(grad, DTensor):
        return grad, ()
    if any(isinstance(p, Partial) for p in grad.placements):  # pending sums: finish them
        placements = [Replicate() if isinstance(p, Partial) else p for p in grad.placements]
        grad = grad.redistribute(grad.device_mesh, placements)
    mesh = grad.device_mesh
    groups = []
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, (Shard, _StridedShard)):  # strided: dp over tp shards
            pg = mesh.get_group(dim)
            assert isinstance(pg, dist.ProcessGroup)
            groups.append(pg)
        elif not isinstance(placement, Replicate):
            raise NotImplementedError(f"clip_grad_norm_: unsupported placement {placement}")
    return grad.to_local(), tuple(groups)


def _partial(
    tensors: list[torch.Tensor], norm_type: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """sum |g|^p (max |g| for the inf-norm) over this rank's ``tensors``: a scalar."""
    infinite = math.isinf(norm_type)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() > 0:  # a rank may own no rows of a small parameter
            by_kind.setdefault((t.device, t.dtype), []).append(t)
    norms = [torch.zeros((), dtype=dtype, device=device)]
    for ts in by_kind.values():
        norms += [n.to(device=device, dtype=dtype) for n in torch._foreach_norm(ts, norm_type)]
    stacked = torch.stack(norms)
    return _combine(stacked if infinite else stacked**norm_type, infinite)


def _combine(values: torch.Tensor, maximum: bool) -> torch.Tensor:
    return values.max() if maximum else values.sum()


def _all_reduce(value: torch.Tensor, group: dist.ProcessGroup, maximum: bool) -> torch.Tensor:
    device = collective_device(group)
    buffer = value.detach().to(device).clone()
    op = dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM
    spmd.record("all_reduce", buffer, group, "clip_grad_norm_")
    spmd.wait(dist.all_reduce(buffer, op=op, group=group, async_op=True), "clip_grad_norm_")
    return buffer


def _scale_(tensors: list[torch.Tensor], coef: torch.Tensor) -> None:
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    with torch.no_grad():
        for device, ts in by_device.items():
            torch._foreach_mul_(ts, coef.to(device))
