"""DTensors crossing pipeline stage boundaries: local tensors on the wire, layouts in the
metadata.

A tensor-parallel stage may return DTensors (a plan whose styles keep
``use_local_output=False``, e.g. activations sharded on the sequence dimension between
blocks). Only a DTensor's local tensor travels; its :class:`DTensorLayout` (placements,
global shape, the mesh's dimension names and shape) travels in the transfer's metadata
(:mod:`plait.pipeline.p2p`), and the receiving stage rebuilds a DTensor with that layout on
*its own* mesh of those dimensions. This is exact because all ranks of a tp group run the
same stage and each talks to the rank with the same tp coordinate on the neighbouring
stage, so local shards line up.

Autograd: the sending stage's graph root is ``dtensor.to_local()`` and the receiving
stage's input is a leaf local tensor wrapped by ``DTensor.from_local``. Both assume the
gradient has the forward's placements (``Partial`` normalised to ``Replicate``, torch's
rule for both functions), so the gradient that travels back is the local tensor of the
DTensor gradient, and its buffer takes the shape of the local output, like any gradient.

The receiver finds its mesh by dimension names and shape, in order: meshes it has already
seen, the meshes of the stage module's DTensor parameters and buffers (a TP stage holds
its weights on its tp mesh), then ``get_mesh(mesh_dim_names, None)``, torch's callback
(plait sends no mesh layout, so the second argument is ``None``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from plait.mesh import contiguous_strides

__all__ = ["DTensorLayout", "MeshResolver", "decode_layout", "encode_layout", "to_local"]

MeshKey = tuple[tuple[str, ...], tuple[int, ...]]  # (mesh_dim_names, mesh shape)

# Partial reduce ops <-> small integers on the wire; the order is part of the protocol.
_REDUCE_OPS = ("sum", "avg", "product", "min", "max")
_SHARD, _REPLICATE, _PARTIAL = 0, 1, 2


@dataclass(frozen=True)
class DTensorLayout:
    """What a receiver needs to rebuild a DTensor around a received local tensor."""

    mesh_dim_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]  # global

    @property
    def mesh_key(self) -> MeshKey:
        return self.mesh_dim_names, self.mesh_shape

    def __str__(self) -> str:
        names = self.mesh_dim_names or tuple(f"dim {i}" for i in range(len(self.mesh_shape)))
        dims = ", ".join(f"{n}={s}" for n, s in zip(names, self.mesh_shape, strict=True))
        return f"DTensor{list(self.shape)} {list(self.placements)} on mesh ({dims})"


def _mesh_key(mesh: DeviceMesh) -> MeshKey:
    return tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape)


def to_local(
    tensors: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[DTensorLayout | None]]:
    """Each DTensor replaced by its local tensor (differentiably: the local tensor is the
    graph root whose gradient travels back), with its layout; ``None`` for plain tensors."""
    local: list[torch.Tensor] = []
    layouts: list[DTensorLayout | None] = []
    for t in tensors:
        if isinstance(t, DTensor):
            mesh = t.device_mesh
            names, shape = _mesh_key(mesh)
            layouts.append(DTensorLayout(names, shape, tuple(t.placements), tuple(t.shape)))
            local.append(t.to_local())
        else:
            layouts.append(None)
            local.append(t)
    return local, layouts


def encode_layout(layout: DTensorLayout) -> list[int]:
    """``[ndim, *shape, mesh ndim, *mesh shape, (kind, arg) per placement, n names,
    (length, *utf-8 bytes) per name]`` (an unnamed mesh has no names)."""
    values = [len(layout.shape), *layout.shape, len(layout.mesh_shape), *layout.mesh_shape]
    for p in layout.placements:
        values += _encode_placement(p)
    values.append(len(layout.mesh_dim_names))
    for name in layout.mesh_dim_names:
        raw = name.encode()
        values += [len(raw), *raw]
    return values


def decode_layout(values: Sequence[int], pos: int) -> tuple[DTensorLayout, int]:
    """The layout encoded at ``values[pos:]`` and the position after it."""
    shape, pos = _ints(values, pos)
    mesh_shape, pos = _ints(values, pos)
    placements = []
    for _ in mesh_shape:
        placements.append(_decode_placement(values[pos], values[pos + 1]))
        pos += 2
    n_names, pos = values[pos], pos + 1
    names = []
    for _ in range(n_names):
        raw, pos = _ints(values, pos)
        names.append(bytes(raw).decode())
    return DTensorLayout(tuple(names), mesh_shape, tuple(placements), shape), pos


def _ints(values: Sequence[int], pos: int) -> tuple[tuple[int, ...], int]:
    """A length-prefixed run of integers at ``values[pos:]`` and the position after it."""
    n = values[pos]
    return tuple(values[pos + 1 : pos + 1 + n]), pos + 1 + n


def _encode_placement(p: Placement) -> tuple[int, int]:
    # Exact types: subclasses (torch's _StridedShard, MaskPartial) carry more than this.
    if type(p) is Shard:
        return _SHARD, p.dim
    if type(p) is Replicate:
        return _REPLICATE, 0
    if type(p) is Partial and p.reduce_op in _REDUCE_OPS:
        return _PARTIAL, _REDUCE_OPS.index(p.reduce_op)
    raise TypeError(
        f"a DTensor with placement {p!r} cannot cross a pipeline stage boundary (plait sends "
        "Shard, Replicate and Partial sum/avg/product/min/max); redistribute the stage "
        "output, or return its local tensor (use_local_output=True)"
    )


def _decode_placement(kind: int, arg: int) -> Placement:
    if kind == _SHARD:
        return Shard(arg)
    if kind == _REPLICATE:
        return Replicate()
    return Partial(_REDUCE_OPS[arg])


class MeshResolver:
    """Finds the device mesh on which a stage rebuilds received DTensors (see the module
    docstring for the order)."""

    def __init__(self, module: nn.Module, get_mesh: Callable[..., Any] | None) -> None:
        self._module = module
        self._get_mesh = get_mesh
        self._known: dict[MeshKey, DeviceMesh] = {}
        self._scanned = False

    def remember(self, tensors: Sequence[torch.Tensor]) -> None:
        """Learn the meshes of the DTensors among ``tensors``."""
        for t in tensors:
            if isinstance(t, DTensor):
                self._known.setdefault(_mesh_key(t.device_mesh), t.device_mesh)

    def resolve(self, layout: DTensorLayout, where: str) -> DeviceMesh:
        key = layout.mesh_key
        if key not in self._known and not self._scanned:
            self._scanned = True  # a module's meshes do not change during training
            self.remember(list(chain(self._module.parameters(), self._module.buffers())))
        if key not in self._known and self._get_mesh is not None:
            mesh = self._get_mesh(layout.mesh_dim_names, None)
            if not isinstance(mesh, DeviceMesh) or _mesh_key(mesh) != key:
                raise RuntimeError(
                    f"{where}: received a {layout}, but get_mesh({layout.mesh_dim_names}, "
                    f"None) returned {mesh!r}: return the DeviceMesh with those dimension "
                    "names and shape"
                )
            self._known[key] = mesh
        if key not in self._known:
            raise RuntimeError(
                f"{where}: received a {layout}, but this stage knows no mesh with those "
                "dimensions (none of its parameters or buffers is a DTensor on one): pass "
                "PipelineStage(..., get_mesh=lambda names, layout: <that mesh>)"
            )
        return self._known[key]

    def rebuild(
        self, tensors: Sequence[torch.Tensor], layouts: Sequence[Any], where: str
    ) -> list[torch.Tensor]:
        """``tensors`` with each one that has a layout wrapped as that DTensor
        (differentiably: gradients reach the local tensor)."""
        out: list[torch.Tensor] = []
        for t, layout in zip(tensors, layouts, strict=True):
            if layout is None:
                out.append(t)
                continue
            out.append(
                DTensor.from_local(
                    t,
                    self.resolve(layout, where),
                    layout.placements,
                    run_check=False,
                    shape=torch.Size(layout.shape),
                    stride=contiguous_strides(layout.shape),  # received: contiguous
                )
            )
        return out
