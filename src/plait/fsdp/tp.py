"""``fully_shard`` over tensor-parallel parameters (2-D and 3-D layouts).

Tensor parallelism (torch's ``torch.distributed.tensor.parallel``) leaves each parameter a
DTensor on a ``tp`` mesh: rank ``t`` of that mesh holds its TP-local tensor. ``fully_shard``
on a data-parallel mesh of the same parent mesh treats that TP-local tensor exactly as it
treats a plain parameter (it is what the dp ranks of one tp coordinate share): it is cut
into dp shards, all-gathered before use, and its gradient reduce-scattered over the dp ranks
only. What changes is how the tensors are described:

* the **sharded parameter** is a DTensor on the combined mesh ``(*dp dims, *tp dims)`` with
  the parameter's global shape: ``Shard(d)`` (or ``Replicate()`` on an HSDP replicate dim)
  on the dp dims, then the TP placements. When dp and tp shard the same dim ``d``, the dp
  shard is a shard *of the tp shard*, which DTensor spells ``_StridedShard(d,
  split_factor=tp shards on d)`` (torch's FSDP describes it the same way), so
  ``full_tensor()``, state dicts and DCP see the true layout;
* the **unsharded parameter** is a DTensor on the tp mesh again, the TP code's own view,
  whose local tensor is the all-gathered TP-local tensor;
* its **gradient**, a DTensor on the tp mesh, is brought to the parameter's TP placements
  (a ``Partial`` gradient of a replicated parameter, e.g. a sequence-parallel norm weight,
  is summed over tp) before its local tensor is reduce-scattered.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._python_dispatch import _disable_current_modes

from plait.mesh import contiguous_strides, local_in_layout

__all__ = [
    "combined_mesh",
    "local_grad",
    "sharded_tp_spec",
    "unsharded_tp_spec",
]


def combined_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``(*dp_mesh dims, *tp_mesh dims)`` the sharded parameters live on.

    Computed outside any active tensor mode: the mesh's rank table is bookkeeping, not the
    model's computation, and a fake-tensor mode (``plait.plan``'s dry runs) cannot run it.
    """
    with _disable_current_modes():
        return DeviceMesh._concatenate([dp_mesh, tp_mesh])


def sharded_tp_spec(
    mesh: DeviceMesh, dp_ndim: int, tp_spec: DTensorSpec, dtype: torch.dtype, dim: int
) -> DTensorSpec:
    """The spec of a parameter whose TP-local tensor is sharded on ``dim`` over the last of
    the ``dp_ndim`` data-parallel dims of ``mesh`` (the others replicate: HSDP)."""
    tp_placements = tuple(tp_spec.placements)
    split = 1
    for mesh_dim, placement in enumerate(tp_placements):
        if isinstance(placement, Shard) and placement.dim == dim:
            split *= tp_spec.mesh.size(mesh_dim)
    dp_shard: Placement = Shard(dim) if split == 1 else _StridedShard(dim, split_factor=split)
    placements = (*([Replicate()] * (dp_ndim - 1)), dp_shard, *tp_placements)
    shape = tp_spec.shape
    return DTensorSpec(
        mesh, placements, tensor_meta=TensorMeta(shape, contiguous_strides(shape), dtype)
    )


def unsharded_tp_spec(tp_spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    """The TP code's view of the unsharded parameter, in the all-gather dtype."""
    shape = tp_spec.shape
    meta = TensorMeta(shape, contiguous_strides(shape), dtype)
    return DTensorSpec(tp_spec.mesh, tuple(tp_spec.placements), tensor_meta=meta)


def local_grad(grad: torch.Tensor, tp_spec: DTensorSpec) -> torch.Tensor:
    """The TP-local gradient of an unsharded TP parameter, laid out as the parameter
    (``plait.mesh.local_in_layout``: a ``Partial`` gradient is summed over tp)."""
    return local_in_layout(grad, tp_spec.mesh, tuple(tp_spec.placements))
