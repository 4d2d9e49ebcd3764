"""Where ``shard_placement_fn`` puts a parameter: a shard dim and, optionally, a mesh.

A unit's parameters may live on different meshes (torchtitan's mixture-of-experts recipe:
routed experts sharded over ``efsdp`` beside ``ep``, everything else over ``dp``). A
``shard_placement_fn`` says so by returning, for a parameter:

* ``None`` or ``Shard(d)``: the dim, on the unit's own mesh (``fully_shard``'s ``mesh``);
* :class:`ShardPlacement` ``(placement, mesh)`` (plait's form), or a plain tuple
  ``(placement, mesh)``: the dim (``None`` for ``Shard(0)``) and the mesh (1-D to shard, or
  2-D ``(replicate, shard)`` for HSDP);
* torch's ``ShardPlacementResult(placement=..., mesh_info=...)``, read duck-typed: its
  ``mesh_info`` gives ``mesh``, ``shard_mesh_dim`` and ``replicate_mesh_dim`` (plait does not
  import torch's FSDP).

The unit then holds one parameter group per distinct mesh (``mesh_groups.MeshGroups``):
one all-gather and one reduce-scatter per group, each over its own ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from plait.fsdp.param import ShardPlacementError, resolve_shard_dim

__all__ = ["ShardPlacement", "resolve_placement"]


@dataclass(frozen=True)
class ShardPlacement:
    """A ``shard_placement_fn`` result that names the mesh too: shard the parameter on
    ``placement`` (``None``: ``Shard(0)``) over ``mesh`` (1-D, or 2-D ``(replicate, shard)``
    for HSDP), in a parameter group of its own mesh inside the unit."""

    placement: Shard | None
    mesh: DeviceMesh


def resolve_placement(
    result: object, param: torch.Tensor, fqn: str, default_mesh: DeviceMesh
) -> tuple[int, DeviceMesh]:
    """``(shard dim, mesh)`` for a ``shard_placement_fn`` result (see the module docstring)."""
    placement: object = result
    mesh: object = default_mesh
    if isinstance(result, ShardPlacement):
        placement, mesh = result.placement, result.mesh
    elif isinstance(result, tuple) and len(result) == 2:
        placement, mesh = result
    elif hasattr(result, "mesh_info") and hasattr(result, "placement"):
        placement, mesh = result.placement, _mesh_of_info(result.mesh_info, fqn)
    if not isinstance(mesh, DeviceMesh):
        raise ShardPlacementError(
            f"fully_shard: shard_placement_fn returned mesh {mesh!r} for parameter {fqn!r}; "
            "expected a DeviceMesh, e.g. ShardPlacement(Shard(0), mesh['efsdp'])"
        )
    if mesh.ndim not in (1, 2) or (mesh.ndim == 2 and mesh.mesh_dim_names is None):
        raise ShardPlacementError(
            f"fully_shard: shard_placement_fn put parameter {fqn!r} on mesh {mesh}; a "
            "parameter group's mesh must be 1-D (sharding) or a named 2-D (replicate, shard)"
        )
    return resolve_shard_dim(placement, param, fqn), mesh


def _mesh_of_info(info: object, fqn: str) -> DeviceMesh:
    """The mesh an ``FSDPMeshInfo``-like object describes, in the layout plait shards over:
    1-D, or 2-D with the replicate dim first and the shard dim last."""
    mesh = getattr(info, "mesh", None)
    shard_dim = getattr(info, "shard_mesh_dim", None)
    replicate_dim = getattr(info, "replicate_mesh_dim", None)
    if getattr(info, "dp_mesh_dims", None) is not None:
        raise ShardPlacementError(
            f"fully_shard: shard_placement_fn's mesh_info for parameter {fqn!r} names "
            "dp_mesh_dims of a full mesh; pass the data-parallel sub-mesh itself"
        )
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim == 1 and shard_dim == 0 and replicate_dim is None:
            return mesh
        if mesh.ndim == 2 and shard_dim == 1 and replicate_dim == 0:
            return mesh
    raise ShardPlacementError(
        f"fully_shard: shard_placement_fn returned mesh_info {info!r} for parameter {fqn!r}; "
        "plait reads a 1-D mesh with shard_mesh_dim=0, or a 2-D mesh with "
        "replicate_mesh_dim=0 and shard_mesh_dim=1"
    )
