"""``fully_shard`` units with a parameter group per mesh (torchtitan's MoE recipe).

One unit per MoE block: its routed experts (``Shard(0)`` DTensors on ``ep`` from
``plait.experts.expert_parallel``) are sharded over ``efsdp``, everything else over the
flattened ``dp`` mesh of the same ``(efsdp, ep)`` world mesh. Trained a few AdamW steps on
4 ranks, it must equal one process on the global batch and torch's own ``fully_shard``
given the same model and torch's ``ShardPlacementResult``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from moe_models import DIM, SEQ_LEN, MoEBlock, MoENet, moe_batches
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from plait.experts import expert_parallel, update_expert_bias
from plait.experts.swiglu import GroupedExperts
from plait.fsdp import CPUOffloadPolicy as PlaitOffload
from plait.fsdp import (
    MixedPrecisionPolicy,
    ShardPlacement,
    clip_grad_norm_,
    fully_shard,
    get_full_state_dict,
    set_full_state_dict,
)
from plait.fsdp.mesh_groups import MeshGroups
from plait.fsdp.state import fsdp_state_of

from collective_spy import spy_collectives
from harness import run_on_ranks

EFSDP, EP = 2, 2
MAX_NORM = 0.5
TIMEOUT = 120.0


def _placement_fn(model: nn.Module, mesh: DeviceMesh, kind: str, dim: int) -> Any:
    """Experts on ``efsdp`` on ``dim``; the rest on the unit's mesh (``None``)."""
    experts = {
        id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
    }
    if kind == "plait":
        chosen: Any = ShardPlacement(Shard(dim), mesh["efsdp"])
    else:  # torch's own objects, as torchtitan passes them
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            FSDPMeshInfo,
            ShardPlacementResult,
        )

        chosen = ShardPlacementResult(Shard(dim), FSDPMeshInfo(mesh["efsdp"], shard_mesh_dim=0))
    return lambda p: chosen if id(p) in experts else None


def _train(impl: str, experts: int, bf16: bool, knob: str = "") -> dict[str, Any] | None:
    """Train ``MoENet`` with ``impl`` ("plait", "plait-torch-result" or "torch"); rank 0
    returns losses, norms, full parameters, the expert placements and the reference's.

    ``knob``: "offload" (CPU offload), "raf2" (``reshard_after_forward=2``), "prefetch"
    (explicit forward and backward prefetching), "hsdp" (the rest on the 2-D (efsdp, ep)
    mesh: replicated over efsdp, sharded over ep), "divide"
    (torchtitan's convention: experts not divided by ep, every group divided by the
    dp size), "no_sync" (each step in two microbatches, the first without gradient sync).
    """
    mesh = init_device_mesh("cpu", (EFSDP, EP), mesh_dim_names=("efsdp", "ep"))
    dp = mesh._flatten("dp")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = MoENet(experts)
    torch.manual_seed(0)
    par = MoENet(experts)
    divide = 1.0 if knob == "divide" else None
    expert_parallel(par, mesh["ep"], load_balance_mesh=mesh, gradient_divide_factor=divide)
    dim = 0 if experts // EP >= EFSDP else 1  # torchtitan: Shard(1) when experts run out
    kind = "plait" if impl == "plait" else "torch"
    mp: dict[str, Any] = {}
    raf: bool | int = 2 if knob == "raf2" else True
    if impl == "torch":
        from torch.distributed.fsdp import CPUOffloadPolicy
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
        from torch.distributed.fsdp import fully_shard as shard

        if bf16:
            mp["mp_policy"] = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        shard = fully_shard
        CPUOffloadPolicy = PlaitOffload
        if bf16:
            mp["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
    if knob == "offload":
        mp["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    unit_mesh = mesh if knob == "hsdp" else dp  # hsdp: the rest replicated over efsdp
    for block in par.blocks:
        fn = _placement_fn(block, mesh, kind, dim)
        shard(block, mesh=unit_mesh, shard_placement_fn=fn, reshard_after_forward=raf, **mp)
    shard(par, mesh=unit_mesh, **mp)
    if knob == "prefetch":  # explicit prefetching, as torchtitan sets it with ep
        par.blocks[0].set_modules_to_forward_prefetch([par.blocks[1]])  # type: ignore[operator]
        par.blocks[1].set_modules_to_backward_prefetch([par.blocks[0]])  # type: ignore[operator]
    if knob == "divide":
        for module in (*par.blocks, par):
            module.set_gradient_divide_factor(float(world))  # type: ignore[operator]
    if impl != "torch":
        unit = fsdp_state_of(par.blocks[0]).unit  # type: ignore[union-attr]
        assert isinstance(unit, MeshGroups) and len(unit.members) == 2
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    par_opt = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.01)
    out: dict[str, Any] = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": []}
    for x, y in moe_batches():
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        if knob == "no_sync":  # half the local batch without sync, then the other half
            par.set_requires_gradient_sync(False)  # type: ignore[operator]
            (F.mse_loss(par(x[:1]), y[:1]) / 2).backward()
            par.set_requires_gradient_sync(True)  # type: ignore[operator]
            x, y = x[1:], y[1:]
        loss = F.mse_loss(par(x), y) / (2 if knob == "no_sync" else 1)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"].append(total.item() / world)
        out["ref_losses"].append(ref_loss.item())
        out["ref_norms"].append(nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        out["norms"].append(clip_grad_norm_(par.parameters(), MAX_NORM).item())
        for model, opt in ((ref, ref_opt), (par, par_opt)):
            opt.step()
            opt.zero_grad()
            update_expert_bias(model)
    w1 = par.blocks[0].moe.experts.w1
    assert isinstance(w1, DTensor)
    out["w1_layout"] = (w1.device_mesh.mesh_dim_names, tuple(map(str, w1.placements)))
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in par.named_parameters()}
    out["params"] = {n: t.detach().clone() for n, t in full.items()}
    out["ref_params"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    if impl == "plait":  # full state dicts across the groups, both ways
        state = get_full_state_dict(par, rank0_only=False)
        assert state.keys() == ref.state_dict().keys()
        for name, value in out["params"].items():
            assert torch.equal(state[name], value), name
        set_full_state_dict(par, ref.state_dict())
        for name, p in par.named_parameters():
            got = p.full_tensor() if isinstance(p, DTensor) else p
            assert torch.equal(got, out["ref_params"][name]), name
    return out if rank == 0 else None


def _run(impl: str, experts: int, bf16: bool = False, knob: str = "") -> dict[str, Any]:
    result = run_on_ranks(EFSDP * EP, _train, impl, experts, bf16, knob, timeout=TIMEOUT)[0]
    assert result is not None
    return result


def _assert_matches_one_process(got: dict[str, Any]) -> None:
    torch.testing.assert_close(got["losses"], got["ref_losses"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got["norms"], got["ref_norms"], atol=1e-6, rtol=1e-5)
    for name, want in got["ref_params"].items():
        torch.testing.assert_close(
            got["params"][name], want, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def _assert_same(a: dict[str, Any], b: dict[str, Any], exact: bool) -> None:
    tol: dict[str, float] = {"atol": 0.0, "rtol": 0.0} if exact else {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(a["losses"], b["losses"], **tol)
    for name, want in b["params"].items():
        torch.testing.assert_close(
            a["params"][name], want, **tol, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("experts", [8, 2], ids=["shard0", "shard1"])
def test_experts_on_efsdp_rest_on_dp_equal_one_process_and_torch(experts: int) -> None:
    ours = _run("plait", experts)
    _assert_matches_one_process(ours)
    theirs = _run("torch", experts)
    _assert_matches_one_process(theirs)
    _assert_same(ours, theirs, exact=True)
    dim = 0 if experts // EP >= EFSDP else 1
    assert ours["w1_layout"] == theirs["w1_layout"], (ours["w1_layout"], theirs["w1_layout"])
    assert ours["w1_layout"][0] == ("efsdp", "ep")
    assert ours["w1_layout"][1][1] == "S(0)" and f"({dim}" in ours["w1_layout"][1][0]


def test_torch_shard_placement_result_is_accepted() -> None:
    got = _run("plait-torch-result", 8)
    _assert_matches_one_process(got)
    _assert_same(got, _run("plait", 8), exact=True)


def test_bf16_mixed_precision_beside_torch() -> None:
    ours, theirs = _run("plait", 8, bf16=True), _run("torch", 8, bf16=True)
    _assert_same(ours, theirs, exact=True)


@pytest.mark.parametrize("knob", ["offload", "raf2", "divide", "no_sync", "prefetch", "hsdp"])
def test_unit_settings_hold_across_the_groups(knob: str) -> None:
    ours = _run("plait", 8, knob=knob)
    if knob != "no_sync":  # microbatch losses are summed differently from one process
        _assert_matches_one_process(ours)
    if knob != "divide":  # torch's divide factor needs PREMUL_SUM, which gloo lacks
        _assert_same(ours, _run("torch", 8, knob=knob), exact=True)


def _refusals() -> None:
    from plait.fsdp.init import FSDPUnsupportedError
    from plait.fsdp.param import ShardPlacementError

    mesh = init_device_mesh("cpu", (EFSDP, EP), mesh_dim_names=("efsdp", "ep"))
    dp = mesh._flatten("dp")

    class Info:  # an FSDPMeshInfo-like object plait cannot read (shard dim 1 of a 1-D mesh)
        def __init__(self, mesh: DeviceMesh) -> None:
            self.mesh, self.shard_mesh_dim, self.replicate_mesh_dim = mesh, 1, None

    class Result:
        def __init__(self, mesh: DeviceMesh) -> None:
            self.placement, self.mesh_info = Shard(0), Info(mesh)

    efsdp = ShardPlacement(None, mesh["efsdp"])
    cases: list[tuple[Any, type[Exception], str, int | bool]] = [
        (ShardPlacement(Shard(0), "efsdp"), ShardPlacementError, "expected a DeviceMesh", True),  # type: ignore[arg-type]
        (Result(mesh["efsdp"]), ShardPlacementError, "shard_mesh_dim=0", True),
        (ShardPlacement(Shard(3), mesh["efsdp"]), ShardPlacementError, "Shard dim 3", True),
        (ShardPlacement(None, mesh["ep"]), FSDPUnsupportedError, "w1", True),  # ep overlaps ep
        (efsdp, ValueError, "must divide the shard group size 2", 4),  # dp: 4, efsdp: 2
    ]
    for result, error, words, raf in cases:
        torch.manual_seed(0)
        model = MoENet(8)
        expert_parallel(model, mesh["ep"], load_balance_mesh=mesh)
        before = {n: id(p) for n, p in model.named_parameters()}
        experts = {id(p) for p in model.blocks[0].moe.experts.parameters()}
        with pytest.raises(error, match=words):
            fully_shard(
                model.blocks[0],
                mesh=dp,
                reshard_after_forward=raf,
                shard_placement_fn=lambda p, r=result, e=experts: r if id(p) in e else None,
            )
        assert before == {n: id(p) for n, p in model.named_parameters()}  # nothing changed


def test_refusals_name_the_parameter_and_change_nothing() -> None:
    run_on_ranks(EFSDP * EP, _refusals, timeout=TIMEOUT)


def _collectives_per_group() -> tuple[int, int, int]:
    mesh = init_device_mesh("cpu", (EFSDP, EP), mesh_dim_names=("efsdp", "ep"))
    dp = mesh._flatten("dp")
    block = MoEBlock(8)
    expert_parallel(block, mesh["ep"], load_balance_mesh=mesh)
    fully_shard(block, mesh=dp, shard_placement_fn=_placement_fn(block, mesh, "plait", 0))
    with spy_collectives("all_gather_single", "reduce_scatter_single") as calls:
        block(torch.randn(2, SEQ_LEN, DIM)).sum().backward()
    sizes = {numel for _, numel in calls["all_gather_single"]}
    return len(calls["all_gather_single"]), len(calls["reduce_scatter_single"]), len(sizes)


def test_one_all_gather_and_one_reduce_scatter_per_group() -> None:
    # the root keeps its parameters from forward to backward: one gather per group
    assert run_on_ranks(EFSDP * EP, _collectives_per_group, timeout=TIMEOUT) == [(2, 2, 2)] * 4
