"""Ideas of torch's ``test_fully_shard_state_dict.py::test_dp_state_dict_save_load``.

The sharded state dict's values are DTensors sharing storage with the sharded parameters
(a rank with nothing to hold gets DTensor's zero padding), loading a state dict of other
storages writes the values back in place (same data pointer when the sharding is even),
and with ``reshard_after_forward=False`` the state dict taken after a forward (parameters
still unsharded) equals the one before. FSDP and HSDP meshes, uneven sizes, and the
largest-dim ``shard_placement_fn``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from plait.fsdp import fully_shard

from harness import run_on_ranks
from models import MLP, hsdp_mesh


def _largest_dim(param: nn.Parameter) -> Shard:
    return Shard(max(range(param.dim()), key=lambda d: (param.shape[d], -d)))


def _check_save_load(model: nn.Module) -> None:
    rank = dist.get_rank()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(1)
    ptrs = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    sizes = [p.size() for p in model.parameters()]
    state_dict = model.state_dict()
    assert [p.size() for p in model.parameters()] == sizes
    assert set(state_dict) == set(ptrs)
    for name, value in state_dict.items():
        assert isinstance(value, DTensor), name
        if ptrs[name] == 0:  # nothing held here: DTensor's padding, never on rank 0
            assert rank > 0 and torch.count_nonzero(value.to_local()).item() == 0
        else:
            assert value.to_local().data_ptr() == ptrs[name], name
    new = {n: v.detach().clone().fill_(42 + rank) for n, v in state_dict.items()}
    for param in model.parameters():
        assert torch.equal(param.to_local(), torch.ones_like(param.to_local()))
    model.load_state_dict(new)
    for name, param in model.named_parameters():
        local = param.to_local()
        assert torch.equal(local, torch.full_like(local, 42 + rank)), name
        dim = param.placements[-1].dim  # type: ignore[attr-defined]
        if local.size(dim) * param.device_mesh.size(-1) == param.size(dim):
            assert local.data_ptr() == ptrs[name], name


def _save_load(mlp_dim: int, hsdp: bool, placement: bool) -> None:
    mesh: DeviceMesh = hsdp_mesh() if hsdp else init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(42)
    base = nn.Sequential(
        MLP(mlp_dim, 4 * mlp_dim),
        nn.Sequential(MLP(mlp_dim, 4 * mlp_dim), nn.Linear(mlp_dim, mlp_dim)),
        MLP(mlp_dim, 4 * mlp_dim),
    )
    kwargs = {"mesh": mesh, "shard_placement_fn": _largest_dim if placement else None}
    model1 = copy.deepcopy(base)
    for module in model1:
        fully_shard(module, **kwargs)
    fully_shard(model1, **kwargs)
    _check_save_load(model1)

    model2 = copy.deepcopy(base)
    for module in model2:
        fully_shard(module, reshard_after_forward=False, **kwargs)
    fully_shard(model2, reshard_after_forward=False, **kwargs)
    _check_save_load(model2)
    before = model2.state_dict()
    model2(torch.randn(2, mlp_dim))  # parameters stay unsharded after this forward
    after = model2.state_dict()
    assert set(before) == set(after)
    for key, value in before.items():
        assert torch.equal(value.full_tensor(), after[key].full_tensor()), key
        assert isinstance(after[key], DTensor)


@pytest.mark.parametrize("mlp_dim", [2, 3, 5])
def test_dp_state_dict_save_load(mlp_dim: int) -> None:
    run_on_ranks(2, _save_load, mlp_dim, False, False)


def test_dp_state_dict_save_load_shard_placement_fn() -> None:
    run_on_ranks(2, _save_load, 16, False, True)


@pytest.mark.parametrize(("mlp_dim", "placement"), [(3, False), (16, True)])
def test_hsdp_state_dict_save_load(mlp_dim: int, placement: bool) -> None:
    run_on_ranks(4, _save_load, mlp_dim, True, placement)
