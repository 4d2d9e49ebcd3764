"""fully_shard over tensor-parallel parameters: 2-D (dp x tp) and 3-D (HSDP x tp) training.

The model is tests/tp_models.py's TinyGPT with torch's own TP plan (with and without
sequence parallelism). Every case trains plait's ``fully_shard`` on top of it and compares
with one process training the same model on the global batch, and where torch supports the
combination with torch's ``fully_shard`` on top of the same plan (losses, final parameters,
and how the sharded parameters are described).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from tp_models import TinyGPT, apply_tp, lm_loss, token_batches

from plait.checkpoint import checkpoint
from plait.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    clip_grad_norm_,
    fully_shard,
)
from plait.fsdp.api import FSDPUnsupportedError

from harness import run_on_ranks
from parity import full_value, local_slice

STEPS, BATCH = 3, 4


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _reference(
    steps: int = STEPS, max_norm: float | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the global batches: the losses and final parameters to match."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = _optimizer(model)
    losses = []
    for tokens, targets in token_batches(steps, BATCH):
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _shard(model: TinyGPT, dp_mesh: DeviceMesh, impl: str, **kwargs: Any) -> None:
    """fully_shard each block, then the root, with plait's or torch's implementation."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as shard
    else:
        shard = fully_shard
    for block in model.blocks:
        shard(block, mesh=dp_mesh, **kwargs)
    shard(model, mesh=dp_mesh, **kwargs)


def _train(
    mesh: DeviceMesh,
    dp_names: tuple[str, ...],
    impl: str = "plait",
    *,
    sp: bool = True,
    ac: bool = False,
    max_norm: float | None = None,
    steps: int = STEPS,
    **shard_kwargs: Any,
) -> tuple[list[float], dict[str, torch.Tensor], TinyGPT]:
    """Train TP + fully_shard on ``mesh`` (data split over ``dp_names``); returns the global
    losses (mean over dp), the full final parameters and the model."""
    dp_mesh = mesh[dp_names]
    dp_world = dp_mesh.size()
    dp_rank = _flat_rank(dp_mesh)
    torch.manual_seed(0)
    model = apply_tp(TinyGPT(), mesh["tp"], sequence_parallel=sp)
    if ac:
        for block in model.blocks:
            checkpoint(block)
    _shard(model, dp_mesh, impl, **shard_kwargs)
    opt = _optimizer(model)
    losses = []
    for tokens, targets in token_batches(steps, BATCH):
        loss = lm_loss(
            model(local_slice(tokens, dp_rank, dp_world)), local_slice(targets, dp_rank, dp_world)
        )
        loss.backward()
        if max_norm is not None:
            clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every tp rank holds the same loss: the world mean is the dp mean
        losses.append(total.item() / dist.get_world_size())
    params = {k: full_value(v.detach()).float() for k, v in model.named_parameters()}
    return losses, params, model


def _flat_rank(dp_mesh: DeviceMesh) -> int:
    """This rank's index in the (possibly 2-D) data-parallel mesh, row-major."""
    coordinate = dp_mesh.get_coordinate()
    assert coordinate is not None
    rank = 0
    for dim, c in enumerate(coordinate):
        rank = rank * dp_mesh.size(dim) + c
    return rank


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _mesh_2d() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _parity_body(sp: bool, ac: bool) -> tuple[float, float, float]:
    mesh = _mesh_2d()
    want_losses, want = _reference()
    losses, params, _ = _train(mesh, ("dp",), sp=sp, ac=ac)
    torch_losses, torch_params, _ = _train(mesh, ("dp",), "torch", sp=sp, ac=ac)
    loss_diff = max(abs(a - b) for a, b in zip(losses, want_losses, strict=True))
    vs_torch = max(abs(a - b) for a, b in zip(losses, torch_losses, strict=True))
    return loss_diff, _max_diff(params, want), max(vs_torch, _max_diff(params, torch_params))


@pytest.mark.parametrize("ac", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_dp2_tp2_trains_like_one_process_and_like_torch(sp: bool, ac: bool) -> None:
    for loss_diff, param_diff, vs_torch in run_on_ranks(4, _parity_body, sp, ac):
        assert loss_diff < 1e-6 and param_diff < 1e-5, (loss_diff, param_diff)
        assert vs_torch < 1e-6, vs_torch


def _placements_body() -> list[str]:
    mesh = _mesh_2d()
    _, _, ours = _train(mesh, ("dp",), steps=0)
    _, _, theirs = _train(mesh, ("dp",), "torch", steps=0)
    problems = []
    for (name, mine), (_, other) in zip(
        ours.named_parameters(), theirs.named_parameters(), strict=True
    ):
        assert isinstance(mine, DTensor) and isinstance(other, DTensor), name
        if mine.device_mesh.mesh_dim_names != ("dp", "tp") or mine.placements != other.placements:
            problems.append(f"{name}: {mine.device_mesh} {mine.placements} vs {other.placements}")
        if mine.to_local().shape != other.to_local().shape:
            problems.append(f"{name}: local {mine.to_local().shape} vs {other.to_local().shape}")
    return problems


def test_sharded_tp_parameters_are_described_like_torchs() -> None:
    """Same mesh, same placements (``_StridedShard`` where dp and tp split one dim), same
    local shapes as torch's fully_shard over the same TP plan."""
    for problems in run_on_ranks(4, _placements_body):
        assert not problems, problems


def _bf16_body(sp: bool) -> tuple[float, float]:
    mesh = _mesh_2d()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    losses, params, _ = _train(mesh, ("dp",), sp=sp, mp_policy=mp)
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    torch_mp = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch_losses, torch_params, _ = _train(mesh, ("dp",), "torch", sp=sp, mp_policy=torch_mp)
    return max(abs(a - b) for a, b in zip(losses, torch_losses, strict=True)), _max_diff(
        params, torch_params
    )


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_bf16_mixed_precision_matches_torch(sp: bool) -> None:
    """bf16 compute against a reference doing the same casts: torch's fully_shard with the
    same policy over the same TP plan."""
    for loss_diff, param_diff in run_on_ranks(4, _bf16_body, sp):
        assert loss_diff < 1e-6 and param_diff < 1e-6, (loss_diff, param_diff)


def _features_body() -> tuple[float, float, float, float]:
    mesh = _mesh_2d()
    want_losses, want = _reference(max_norm=0.5)
    losses, params, model = _train(
        mesh,
        ("dp",),
        max_norm=0.5,
        reshard_after_forward=False,
        offload_policy=CPUOffloadPolicy(pin_memory=False),
    )
    from plait.fsdp import memory_report

    report = memory_report(model)
    loss_diff = max(abs(a - b) for a, b in zip(losses, want_losses, strict=True))
    return (
        loss_diff,
        _max_diff(params, want),
        float(report.sharded_params),
        float(
            sum(
                p.to_local().numel() * 4
                for p in model.parameters()  # type: ignore[attr-defined]
            )
        ),
    )


def test_offload_no_reshard_clipping_and_memory_report() -> None:
    """CPU offload, reshard_after_forward=False and clip_grad_norm_ over mixed placements
    (one norm over the whole model: it actually clips here) train like one process that
    clips the same way; memory_report counts the TP-local shards."""
    for loss_diff, param_diff, reported, local_bytes in run_on_ranks(4, _features_body):
        assert loss_diff < 1e-6 and param_diff < 1e-5, (loss_diff, param_diff)
        assert reported >= local_bytes > 0, (reported, local_bytes)


def _meta_init_body() -> float:
    mesh = _mesh_2d()
    torch.manual_seed(0)
    full = TinyGPT().state_dict()
    with torch.device("meta"):
        model = apply_tp(TinyGPT(), mesh["tp"])
    _shard(model, mesh["dp"], "plait")
    model.to_empty(device="cpu")
    model.load_state_dict(full)  # full tensors: each rank keeps its dp shard of its tp shard
    got = {k: full_value(v.detach()) for k, v in model.named_parameters()}
    return max((got[k] - full[k]).abs().max().item() for k in got)


def test_meta_init_then_full_state_dict_load() -> None:
    assert run_on_ranks(4, _meta_init_body) == [0.0] * 4


def _overlap_body() -> str:
    mesh = _mesh_2d()
    model = apply_tp(TinyGPT(), mesh["tp"])
    try:
        fully_shard(model, mesh=mesh["tp"])
    except FSDPUnsupportedError as e:
        return str(e)
    return "accepted"


def test_tp_parameters_on_the_sharding_mesh_are_refused_with_the_fix() -> None:
    message = run_on_ranks(4, _overlap_body)[0]
    assert "embed.weight" in message and 'mesh["dp_shard"]' in message, message


def _hsdp_body() -> list[tuple[str, float, float]]:
    """Every 8-rank variant in one call (starting 8 processes is the expensive part)."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    dp = ("dp_replicate", "dp_shard")
    want_losses, want = _reference(steps=2)
    results = []
    for label, kwargs in (("sp", {}), ("no sp + ac", {"sp": False, "ac": True})):
        losses, params, model = _train(mesh, dp, steps=2, **kwargs)  # type: ignore[arg-type]
        names = {p.device_mesh.mesh_dim_names for p in model.parameters()}  # type: ignore[attr-defined]
        assert ("dp_replicate", "dp_shard", "tp") in names, names
        loss_diff = max(abs(a - b) for a, b in zip(losses, want_losses, strict=True))
        results.append((label, loss_diff, _max_diff(params, want)))
    # bf16: against torch's fully_shard with the same policy on the same 3-D layout
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    ours = _train(mesh, dp, steps=2, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    theirs = _train(
        mesh, dp, "torch", steps=2, mp_policy=TorchPolicy(torch.bfloat16, torch.float32)
    )
    loss_diff = max(abs(a - b) for a, b in zip(ours[0], theirs[0], strict=True))
    results.append(("bf16 vs torch", loss_diff, _max_diff(ours[1], theirs[1])))
    # partial resharding (ZeRO++'s hpZ) needs a shard group of more than 2: dp_shard 4 x tp 2
    flat = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp_shard", "tp"))
    losses, params, _ = _train(flat, ("dp_shard",), steps=2, reshard_after_forward=2)
    loss_diff = max(abs(a - b) for a, b in zip(losses, want_losses, strict=True))
    results.append(("dp_shard 4, reshard_after_forward=2", loss_diff, _max_diff(params, want)))
    return results


def test_hsdp_x_tp_on_8_ranks_trains_like_one_process() -> None:
    """dp_replicate 2 x dp_shard 2 x tp 2: with sequence parallelism; without it and with
    checkpointing; in bf16 against torch's fully_shard on the same layout. And dp_shard 4 x
    tp 2 with partial resharding after forward."""
    for results in run_on_ranks(8, _hsdp_body, timeout=300):
        for label, loss_diff, param_diff in results:
            assert loss_diff < 1e-6 and param_diff < 1e-5, (label, loss_diff, param_diff)


def _mesh_dims_body(full_mesh_params: bool) -> tuple[float, float]:
    """torch 2.13's full-mesh form, torchtitan's default: ``fully_shard(mesh=whole mesh,
    dp_mesh_dims=...)`` over TP parameters, given on the tp sub-mesh or (torch's form) as
    DTensors on the whole mesh, replicated over dp."""
    from torch.distributed.tensor import Replicate

    from plait.fsdp import DataParallelMeshDims

    mesh = _mesh_2d()
    want_losses, want = _reference(steps=2)
    torch.manual_seed(0)
    model = apply_tp(TinyGPT(), mesh["tp"])
    for sub in model.modules():  # sharded TP parameters in torch's full-mesh form
        for name, p in list(sub._parameters.items()):
            if full_mesh_params and isinstance(p, DTensor) and p.placements != (Replicate(),):
                whole = DTensor.from_local(p.to_local(), mesh, [Replicate(), *p.placements])
                sub._parameters[name] = nn.Parameter(whole)
    dims = DataParallelMeshDims(shard="dp")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    opt = _optimizer(model)
    losses = []
    dp_rank = mesh["dp"].get_local_rank()
    for tokens, targets in token_batches(2, BATCH):
        loss = lm_loss(model(local_slice(tokens, dp_rank, 2)), local_slice(targets, dp_rank, 2))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / 4)
    params = {k: full_value(v.detach()) for k, v in model.named_parameters()}
    return max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)), _max_diff(
        params, want
    )


@pytest.mark.parametrize("full_mesh_params", [False, True], ids=["tp-submesh", "full-mesh"])
def test_dp_mesh_dims_over_tensor_parallel_parameters(full_mesh_params: bool) -> None:
    for loss_diff, param_diff in run_on_ranks(4, _mesh_dims_body, full_mesh_params):
        assert loss_diff < 1e-6 and param_diff < 1e-5, (loss_diff, param_diff)


def _clip_partial_body() -> float:
    """Tensor parallelism alone leaves the sequence-parallel norms' gradients Partial (a
    pending sum over tp): clipping must scale the gradients themselves, not a finished copy."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = TinyGPT()
    torch.manual_seed(0)
    model = apply_tp(TinyGPT(), mesh)
    tokens, targets = token_batches(1, BATCH)[0]
    for m in (reference, model):
        lm_loss(m(tokens), targets).backward()
    assert any(
        isinstance(p.grad, DTensor) and p.grad.placements[0].is_partial()
        for p in model.parameters()
    )
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    got = clip_grad_norm_(model.parameters(), 0.1)
    assert abs(got.item() - want.item()) < 1e-5, (got, want)
    grads = dict(model.named_parameters())
    return max(
        (full_value(grads[n].grad) - p.grad).abs().max().item()  # type: ignore[arg-type]
        for n, p in reference.named_parameters()
    )


def test_clipping_scales_pending_tensor_parallel_sums() -> None:
    for diff in run_on_ranks(2, _clip_partial_body):
        assert diff < 1e-6, diff
