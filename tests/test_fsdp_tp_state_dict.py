"""State dicts of fully_shard over tensor-parallel parameters (2-D and HSDP x TP).

Written from torch's ``test_fully_shard_state_dict.py`` (``test_2d_state_dict_correctness``,
``test_dp_tp_state_dict_save_load``, ``test_hsdp_tp_state_dict_save_load``): the state dict
holds the sharded DTensors themselves (same storage), their ``full_tensor()`` is the
unsharded model's value, and loading DTensors with other storages writes into the
parameters in place. Widths that split unevenly over dp after tp are included.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from plait.fsdp import fully_shard

from harness import run_on_ranks
from models import MLP

WIDTHS = (4, 6, 8, 10)


def _model(width: int) -> nn.Sequential:
    return nn.Sequential(*[MLP(width, width) for _ in range(3)])


def _two_d(model: nn.Sequential, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> nn.Sequential:
    plan = {}
    for i in range(len(model)):
        plan[f"{i}.in_proj"] = ColwiseParallel()
        plan[f"{i}.out_proj"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)  # type: ignore[arg-type]
    for mlp in model:
        fully_shard(mlp, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _correctness_body() -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    problems = []
    for width in WIDTHS:
        torch.manual_seed(42)
        model = _model(width)
        sharded = _two_d(copy.deepcopy(model), mesh["dp"], mesh["tp"])
        want, got = model.state_dict(), sharded.state_dict()
        if list(want) != list(got):
            problems.append(f"width {width}: keys {list(got)} != {list(want)}")
        for key, value in got.items():
            if not isinstance(value, DTensor):
                problems.append(f"width {width}: {key} is {type(value).__name__}")
            elif not torch.equal(value.full_tensor(), want[key]):
                problems.append(f"width {width}: {key} full_tensor differs")
    return problems


def test_2d_state_dict_is_the_unsharded_models() -> None:
    for problems in run_on_ranks(4, _correctness_body):
        assert not problems, problems


def _save_load(model: nn.Module) -> list[str]:
    """torch's _test_state_dict_save_load, checked by value and by storage."""
    problems = []
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    pointers = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}  # type: ignore[operator]
    state = model.state_dict()
    if set(state) != set(pointers):
        problems.append(f"keys {sorted(state)} != {sorted(pointers)}")
    for name, value in state.items():
        if not isinstance(value, DTensor):
            problems.append(f"{name} is not a DTensor")
        elif value.to_local().numel() and value.to_local().data_ptr() != pointers[name]:
            problems.append(f"{name}: the state dict does not share the parameter's storage")
    fill = 42.0 + dist.get_rank()
    model.load_state_dict({k: v.detach().clone().fill_(fill) for k, v in state.items()})
    for name, p in model.named_parameters():
        local = p.to_local()  # type: ignore[operator]
        if not torch.equal(local, torch.full_like(local, fill)):
            problems.append(f"{name}: not loaded")
        if local.numel() and local.data_ptr() != pointers[name]:
            problems.append(f"{name}: loading replaced the parameter's storage")
    return problems


def _dp_tp_body(hsdp: bool) -> list[str]:
    if hsdp:
        names = ("dp_replicate", "dp_shard", "tp")
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
        dp_mesh = mesh["dp_replicate", "dp_shard"]
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
    problems = []
    for width in WIDTHS:
        torch.manual_seed(42)
        model = _two_d(_model(width), dp_mesh, mesh["tp"])
        problems += [f"width {width}: {p}" for p in _save_load(model)]
    return problems


def test_dp_tp_state_dict_save_load() -> None:
    for problems in run_on_ranks(4, _dp_tp_body, False):
        assert not problems, problems


def test_hsdp_tp_state_dict_save_load() -> None:
    for problems in run_on_ranks(8, _dp_tp_body, True, timeout=240):
        assert not problems, problems
