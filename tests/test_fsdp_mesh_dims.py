"""``fully_shard(..., mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``.

torch 2.13's full-mesh form (torchtitan's default ``spmd_types`` path): the mesh is the
whole device mesh and ``dp_mesh_dims`` names its data-parallel dims. torch 2.13 itself
fails on this path on CPU; plait shards over the named dims and trains like one process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import plait
from plait.fsdp import DataParallelMeshDims, fully_shard

from harness import run_on_ranks
from models import MLPStack
from parity import check_parity


def _batches(n: int = 3, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(rows, 8, generator=g), torch.randn(rows, 8, generator=g)) for _ in range(n)
    ]


def _shard_with_dims(mesh: DeviceMesh, dims: DataParallelMeshDims, as_dtensor: bool):
    def parallelize(model: nn.Module) -> nn.Module:
        if as_dtensor:  # parameters replicated on the whole mesh, as spmd-typed code has them
            for sub in model.modules():
                for name, p in list(sub._parameters.items()):
                    assert p is not None
                    replicated = distribute_tensor(p.detach(), mesh, [Replicate()] * mesh.ndim)
                    sub._parameters[name] = nn.Parameter(replicated)
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
        return model

    return parallelize


def _one_dim_body(as_dtensor: bool) -> list[str]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    dims = DataParallelMeshDims(shard="fsdp")
    check_parity(MLPStack, _shard_with_dims(mesh, dims, as_dtensor), _batches())
    model = _shard_with_dims(mesh, dims, as_dtensor)(MLPStack())
    return [str(p.placements) for p in model.parameters() if isinstance(p, DTensor)][:1]


@pytest.mark.parametrize("as_dtensor", [False, True])
def test_one_dim_full_mesh_matches_one_process(as_dtensor: bool) -> None:
    assert run_on_ranks(2, _one_dim_body, as_dtensor) == [[str((Shard(0),))]] * 2


def _hsdp_body() -> tuple[object, ...]:
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp_replicate", "fsdp", "tp"))
    dims = DataParallelMeshDims(shard="fsdp", replicate="dp_replicate")
    check_parity(MLPStack, _shard_with_dims(mesh, dims, as_dtensor=True), _batches())
    model = _shard_with_dims(mesh, dims, as_dtensor=True)(MLPStack())
    head = model.head.weight  # type: ignore[union-attr]
    assert isinstance(head, DTensor)
    return (head.device_mesh.mesh_dim_names or ()) + tuple(head.placements)


def test_hsdp_on_a_three_dim_mesh_with_a_unit_tp_dim() -> None:
    expected = ("dp_replicate", "fsdp", Replicate(), Shard(0))
    assert run_on_ranks(4, _hsdp_body) == [expected] * 4


def _flattened_body() -> int:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dims = DataParallelMeshDims(shard=("dp", "cp"))
    check_parity(MLPStack, _shard_with_dims(mesh, dims, as_dtensor=False), _batches())
    model = _shard_with_dims(mesh, dims, as_dtensor=False)(MLPStack())
    head = model.head.weight  # type: ignore[union-attr]
    assert isinstance(head, DTensor)
    return head.device_mesh.size()


def test_several_shard_dims_are_flattened() -> None:
    assert run_on_ranks(4, _flattened_body) == [4] * 4


def _refusals_body() -> list[str]:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("fsdp", "tp"))
    seen = []
    # (a tp dim of size > 1 composes: tests/test_fsdp_tp.py)
    with pytest.raises(ValueError) as info:
        fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    seen.append(str(info.value).split(":")[0])
    with pytest.raises(ValueError, match="no mesh was given"):
        fully_shard(nn.Linear(4, 4), dp_mesh_dims=DataParallelMeshDims(shard="fsdp"))
    return seen


def test_bad_dp_mesh_dims_are_refused_naming_the_fix() -> None:
    assert run_on_ranks(2, _refusals_body) == [["fully_shard"]] * 2


def test_data_parallel_mesh_dims_needs_a_field() -> None:
    with pytest.raises(ValueError, match="set shard=, replicate= or both"):
        DataParallelMeshDims()
    assert DataParallelMeshDims(shard=("a", "b")).shard_names == ("a", "b")
    assert plait.DataParallelMeshDims is DataParallelMeshDims
