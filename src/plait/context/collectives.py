"""The collectives of context parallelism, stateless: the cp group of a mesh, a gather
along a sequence dim (differentiable: its backward is a reduce-scatter), the Ulysses
all-to-all between sequence and heads (each direction the other's backward), and one
step of a ring (send to the next rank, receive from the previous one).

c10d functions are looked up at call time (tests patch them to count calls) and always
given an explicit group. All of them run on gloo (CPU) and NCCL alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait import spmd
from plait.hooks import traced

__all__ = [
    "cp_group",
    "gather_sequence",
    "heads_to_sequence",
    "ring_shift",
    "sequence_to_heads",
]

#: What the cp ranks may be given as: a 1-D mesh (``mesh["cp"]``) or its process group.
CPMesh = DeviceMesh | dist.ProcessGroup


def cp_group(mesh: object, api: str = "context parallelism") -> dist.ProcessGroup:
    """The process group of the cp ranks: ``mesh`` itself, or the group of a 1-D mesh."""
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{api}: mesh must be a 1-D DeviceMesh (the cp ranks) or a ProcessGroup, "
            f"got {type(mesh).__name__}"
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"{api} needs a 1-D mesh (the cp ranks) but got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)} with dims {mesh.mesh_dim_names}: pass one dimension, "
            'e.g. mesh["cp"]'
        )
    group = mesh.get_group()
    assert isinstance(group, dist.ProcessGroup)
    return group


# -- gather along a dim ------------------------------------------------------------------


def _gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, rank after rank."""
    world = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()  # c10d gathers along dim 0
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))
    spmd.record("all_gather", front, group, "plait.context")
    with traced("plait.context.all_gather"):
        dist.all_gather_single(out, front, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ranks of ``x``, of which this rank keeps its slice along ``dim``."""
    world = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    spmd.record("reduce_scatter", front, group, "plait.context")
    with traced("plait.context.reduce_scatter"):
        dist.reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather along a dim; each rank's gradient is the sum of every rank's gradient
    of its slice (the gathered tensor was used on every rank): a reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


def gather_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every cp rank's ``x`` concatenated along ``dim`` in rank order (differentiable when
    ``x`` needs grad; integer tensors such as document ids are gathered plainly)."""
    if dist.get_world_size(group) == 1:
        return x
    if x.requires_grad:
        out: torch.Tensor = _GatherSequence.apply(x, dim, group)
        return out
    return _gather(x, dim, group)


# -- Ulysses: sequence <-> heads ---------------------------------------------------------


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, label: str) -> torch.Tensor:
    """Block ``j`` of dim 0 of ``x`` to rank ``j``; block ``i`` of the result from rank ``i``."""
    x = x.contiguous()
    out = torch.empty_like(x)
    spmd.record("all_to_all", x, group, "plait.context")
    with traced(label):
        dist.all_to_all_single(out, x, group=group)
    return out


def _to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # (*, H, Tl, D) -> (*, H/cp, cp*Tl, D): head group j goes to rank j, and the sequence
    # chunks that arrive are concatenated in rank order.
    cp = dist.get_world_size(group)
    blocks = x.unflatten(-3, (cp, x.shape[-3] // cp)).movedim(-4, 0)  # (cp, *, H/cp, Tl, D)
    got = _exchange(blocks, group, "plait.context.all_to_all")  # got[i]: rank i's chunk
    return got.movedim(0, -3).flatten(-3, -2)


def _to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # (*, H/cp, cp*Tl, D) -> (*, H, Tl, D): the inverse of _to_heads.
    cp = dist.get_world_size(group)
    blocks = x.unflatten(-2, (cp, x.shape[-2] // cp)).movedim(-3, 0)  # (cp, *, H/cp, Tl, D)
    got = _exchange(blocks, group, "plait.context.all_to_all")  # got[i]: head group i
    return got.movedim(0, -4).flatten(-4, -3)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _to_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _to_heads(grad, ctx.group), None


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all ``(*, H, T_local, D) -> (*, H/cp, cp*T_local, D)``: this
    rank keeps head group ``rank`` of the whole sequence (chunks in rank order). ``H`` must
    divide by cp (the caller checks)."""
    out: torch.Tensor = _SequenceToHeads.apply(x, group)
    return out


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`, differentiable."""
    out: torch.Tensor = _HeadsToSequence.apply(x, group)
    return out


# -- ring --------------------------------------------------------------------------------


def ring_shift(
    x: torch.Tensor, group: dist.ProcessGroup, label: str, tag: int = 0
) -> tuple[torch.Tensor, list[dist.Work]]:
    """Start sending ``x`` to the next cp rank and receiving the previous rank's into a new
    buffer; returns the buffer and the works to wait for before reading it (or reusing
    ``x``). Shifts in flight together need distinct ``tag`` s (gloo matches by tag; NCCL
    by order, which is the same on every rank). Not differentiable: the ring attention
    passes gradients back itself."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    received = torch.empty_like(x)
    peers = ((rank + 1) % cp, (rank - 1) % cp)
    for op, peer in zip(("send", "recv"), peers, strict=True):
        spmd.record_p2p(op, x, dist.get_global_rank(group, peer), "plait.context")
    with traced(label):
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, x, group=group, tag=tag, group_peer=peers[0]),
                dist.P2POp(dist.irecv, received, group=group, tag=tag, group_peer=peers[1]),
            ]
        )
    return received, works
