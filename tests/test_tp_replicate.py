"""``replicate`` over tensor-parallel modules (DP x TP) on a ``(dp 2, tp 2)`` mesh.

The model is tests/tp_models.py's TinyGPT with torch's own TP plan over ``mesh["tp"]``
(with and without sequence parallelism), then ``plait.replicate`` over ``mesh["dp"]``. It
must train exactly like one process on the global batch, keep its parameters DTensors on
the tp mesh, and match torch's ``DistributedDataParallel(device_mesh=...)`` over the same
plan. torch's composable ``replicate`` is not compared: on CPU gloo (torch 2.13) it trains
this layout differently from one process from the second step on.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from tp_models import TinyGPT, apply_tp, lm_loss, token_batches

from plait.checkpoint import checkpoint
from plait.replicate import ReplicateModule, replicate

from harness import run_on_ranks
from parity import LossFn, check_parity, default_step, full_value, local_slice

STEPS, BATCH = 3, 4


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _tp_then_replicate(mesh: DeviceMesh, sp: bool, ac: bool) -> Callable[[nn.Module], nn.Module]:
    """TP over ``mesh["tp"]``, optionally checkpoint each block, then replicate over dp."""

    def parallelize(model: nn.Module) -> nn.Module:
        assert isinstance(model, TinyGPT)
        apply_tp(model, mesh["tp"], sequence_parallel=sp)
        if ac:
            for block in model.blocks:
                checkpoint(block)
        return replicate(model, device_mesh=mesh["dp"])

    return parallelize


def _clipped_step(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn
) -> torch.Tensor:
    """Forward, backward, then torch's ``clip_grad_norm_`` (active at this small norm)."""
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm=0.5)
    return loss.detach()


def _parity(sp: bool, ac: bool, clip: bool) -> dict[str, str]:
    mesh = _mesh()
    dp = mesh["dp"]
    parallel: list[nn.Module] = []

    def parallelize(model: nn.Module) -> nn.Module:
        parallel.append(_tp_then_replicate(mesh, sp, ac)(model))
        return parallel[0]

    check_parity(
        TinyGPT,
        parallelize,
        token_batches(STEPS, BATCH),
        loss_fn=lm_loss,
        data_rank=dp.get_local_rank(),
        data_world=2,
        loss_group=dp.get_group(),
        step=_clipped_step if clip else default_step,
    )
    model = parallel[0]
    # The parameters and the state dict are still the TP code's DTensors on mesh["tp"].
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            assert param.device_mesh == mesh["tp"], name
    state = model.state_dict()
    return {name: type(value).__name__ for name, value in state.items()}


@pytest.mark.parametrize(
    ("sp", "ac", "clip"),
    [(False, False, False), (True, False, True), (True, True, False)],
    ids=["tp", "sp+clip", "sp+checkpoint"],
)
def test_dp_x_tp_trains_like_one_process(sp: bool, ac: bool, clip: bool) -> None:
    kinds = run_on_ranks(4, _parity, sp, ac, clip)[0]
    assert kinds["blocks.0.attn.q.weight"] == "DTensor"
    # sequence parallelism makes the norms replicated DTensors; without it they stay plain
    assert kinds["blocks.0.attn_norm.weight"] == ("DTensor" if sp else "Tensor")


def _grad_layouts() -> dict[str, str]:
    """After one synced backward: each parameter's and its gradient's placements."""
    mesh = _mesh()
    torch.manual_seed(0)
    model = replicate(apply_tp(TinyGPT(), mesh["tp"]), device_mesh=mesh["dp"])
    tokens, targets = token_batches(1, BATCH)[0]
    rank = mesh["dp"].get_local_rank()
    lm_loss(model(local_slice(tokens, rank, 2)), local_slice(targets, rank, 2)).backward()
    layouts = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
        assert p.grad.to_local().shape == p.to_local().shape, name
        layouts[name] = f"{p.placements} {p.grad.placements}"
    return layouts


def test_gradients_are_laid_out_as_their_parameters() -> None:
    # TP alone leaves Partial gradients on the sequence-parallel norms and a Replicate one
    # on the vocabulary-sharded embedding; replicate resolves them before reducing.
    layouts = run_on_ranks(4, _grad_layouts)[0]
    assert layouts["blocks.0.attn_norm.weight"] == "(Replicate(),) (Replicate(),)"
    assert layouts["embed.weight"] == "(Shard(dim=0),) (Shard(dim=0),)"
    assert layouts["blocks.0.mlp.fc2.weight"] == "(Shard(dim=1),) (Shard(dim=1),)"


def _accumulation_step(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn
) -> torch.Tensor:
    """Two micro-batches, the first under ``no_sync`` (when replicated): one reduce."""
    losses = []
    for i, (x, y) in enumerate(zip(inputs.chunk(2), targets.chunk(2), strict=True)):
        skip = i == 0 and isinstance(model, ReplicateModule)
        with model.no_sync() if skip else contextlib.nullcontext():  # type: ignore[operator]
            loss = loss_fn(model(x), y) / 2
            loss.backward()
        losses.append(loss.detach())
    return sum(losses, torch.zeros(()))


def _accumulation(sp: bool) -> None:
    mesh = _mesh()
    dp = mesh["dp"]
    check_parity(
        TinyGPT,
        _tp_then_replicate(mesh, sp, ac=False),
        token_batches(STEPS, 2 * BATCH),
        loss_fn=lm_loss,
        step=_accumulation_step,
        data_rank=dp.get_local_rank(),
        data_world=2,
        loss_group=dp.get_group(),
    )


def test_no_sync_accumulation_with_tp_parameters() -> None:
    run_on_ranks(4, _accumulation, True)


def _train(
    impl: str, sp: bool, dtype: torch.dtype = torch.float32
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train TP + plait's replicate or torch's DDP with ``device_mesh``; losses and params.
    ``dtype``: the model's (bf16: bf16 compute, gradients and all-reduce in both)."""
    mesh = _mesh()
    dp = mesh["dp"]
    torch.manual_seed(0)
    model = apply_tp(TinyGPT().to(dtype), mesh["tp"], sequence_parallel=sp)
    names = [name for name, _ in model.named_parameters()]
    if impl == "torch":
        from torch.nn.parallel import DistributedDataParallel

        wrapped: nn.Module = DistributedDataParallel(model, device_mesh=dp)
    else:
        wrapped = replicate(model, device_mesh=dp)
    # torch's DDP + TP swaps the DTensor parameters for local ones: optimize what it exposes.
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.01)
    rank, losses = dp.get_local_rank(), []
    for tokens, targets in token_batches(STEPS, BATCH):
        loss = lm_loss(wrapped(local_slice(tokens, rank, 2)), local_slice(targets, rank, 2))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp.get_group())
        losses.append(total.item() / 2)
    # ...and after a forward they are attributes, not parameters: look them up by name.
    return losses, {n: full_value(operator.attrgetter(n)(model).detach()) for n in names}


def _compare_with_torch(sp: bool, dtype: torch.dtype) -> None:
    ours, our_params = _train("plait", sp, dtype)
    theirs, their_params = _train("torch", sp, dtype)
    assert ours == pytest.approx(theirs, abs=1e-6)
    for name, value in our_params.items():
        torch.testing.assert_close(value, their_params[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("sp", "dtype"),
    [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)],
    ids=["tp", "sp", "sp-bf16"],
)
def test_matches_torch_ddp_with_device_mesh(sp: bool, dtype: torch.dtype) -> None:
    run_on_ranks(4, _compare_with_torch, sp, dtype)


def _refusals() -> None:
    # TP over the very ranks replicate averages over: their local tensors are different
    # shards, so averaging them would be wrong.
    dp = _mesh()["dp"]
    model = nn.Sequential(nn.Linear(4, 4))
    parallelize_module(model, dp, {"0": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"'0.weight' of Sequential is a DTensor.*shares ranks"):
        replicate(model, device_mesh=dp)

    # A tp mesh per dp rank, but rank 2 sits at tp coordinate 1 while its dp peer rank 0
    # sits at coordinate 0: they hold different shards.
    layout = DeviceMesh("cpu", torch.tensor([[0, 1], [3, 2]]), mesh_dim_names=("dp", "tp"))
    dp_groups = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("r", "dp"))
    model = nn.Sequential(nn.Linear(4, 4))
    parallelize_module(model, layout["tp"], {"0": ColwiseParallel()})
    with pytest.raises(ValueError, match="hold different parts of DTensors"):
        replicate(model, device_mesh=dp_groups["dp"])


def test_refuses_dtensors_the_dp_group_cannot_average() -> None:
    run_on_ranks(4, _refusals)
