"""``replicate`` on ``fully_shard``'s machinery: torch's FSDP-based ``replicate``
(``torch.distributed._composable.replicate_with_fsdp``) and plait's, side by side.

Programs written for torch's new ``replicate`` pass ``mp_policy=`` / ``offload_policy=``,
call ``FSDPModule`` methods on replicated modules and select them with
``isinstance(m, FSDPModule)``. plait's ``replicate`` is a ``fully_shard`` unit whose shard
group has one rank, so it takes the same arguments, is an ``FSDPModule``, and trains bit
for bit like torch's (compared on each rank's local values: torch's parameters are
``Replicate()`` DTensors).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from plait.fsdp import FSDPModule, MixedPrecisionPolicy
from plait.replicate import ReplicateModule, replicate

from harness import run_on_ranks
from models import MLPStack
from parity import local_slice, random_batches


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _torch_api() -> tuple[Callable[..., nn.Module], Any, type]:
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    return torch_replicate, TorchPolicy, TorchFSDPModule


def _apply(
    model: MLPStack, apply: Callable[..., nn.Module], per_block: bool, **kwargs: Any
) -> None:
    if per_block:
        for block in model.blocks:
            apply(block, **kwargs)
    apply(model, **kwargs)


def _train(
    model: nn.Module, steps: int, configure: Callable[[nn.Module, int], None] | None = None
) -> list[float]:
    """AdamW steps on this rank's slice of fixed global batches; the local losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step, (x, y) in enumerate(random_batches(steps, 8, 16, 16)):
        if configure is not None:
            configure(model, step)
        loss = nn.functional.mse_loss(
            model(local_slice(x, rank, world)), local_slice(y, rank, world)
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _side_by_side(
    per_block: bool,
    param_dtype: torch.dtype | None,
    configure: Callable[[nn.Module, int], None] | None = None,
) -> None:
    """plait's and torch's FSDP-based replicate train the same model on the same batches:
    losses and every rank's parameters equal bit for bit."""
    torch_replicate, TorchPolicy, TorchFSDPModule = _torch_api()
    torch.manual_seed(0)
    base = MLPStack(3, dim=16, hidden=32)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("replicate",))
    _apply(ours, replicate, per_block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype))
    _apply(theirs, torch_replicate, per_block, mesh=mesh, mp_policy=TorchPolicy(param_dtype))
    assert isinstance(ours, FSDPModule) and isinstance(ours, ReplicateModule)
    assert isinstance(theirs, TorchFSDPModule)
    ours_units = [n for n, m in ours.named_modules() if isinstance(m, FSDPModule)]
    theirs_units = [n for n, m in theirs.named_modules() if isinstance(m, TorchFSDPModule)]
    assert ours_units == theirs_units
    our_losses = _train(ours, 4, configure)
    their_losses = _train(theirs, 4, configure)
    assert our_losses == their_losses
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert torch.equal(_local(p), _local(q)), f"{name} differs from torch's replicate"


@pytest.mark.parametrize("per_block", [True, False], ids=["per_block", "root_only"])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_trains_bitwise_like_torchs_fsdp_based_replicate(
    per_block: bool, param_dtype: torch.dtype | None
) -> None:
    run_on_ranks(2, _side_by_side, per_block, param_dtype)


def _divide_by_one(model: nn.Module, step: int) -> None:
    del step
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)  # sum the replicas' gradients


def _accumulate_every_other(model: nn.Module, step: int) -> None:
    model.set_requires_gradient_sync(step % 2 == 1)  # type: ignore[operator]


@pytest.mark.parametrize("configure", [_divide_by_one, _accumulate_every_other])
def test_fsdp_module_methods_on_replicated_modules_match_torch(
    configure: Callable[[nn.Module, int], None],
) -> None:
    """``set_gradient_divide_factor`` and ``set_requires_gradient_sync``, called as programs
    written for torch's new replicate call them, act as they do there."""
    run_on_ranks(2, _side_by_side, True, torch.bfloat16, configure)


def _todays_keywords_still_work() -> bool:
    torch.manual_seed(0)
    model = MLPStack(2)
    replicate(model, bucket_cap_mb=1, reduce_dtype=torch.float32, gradient_as_bucket_view=True)
    model(torch.randn(4, 8)).sum().backward()
    return isinstance(model, FSDPModule) and all(p.grad is not None for p in model.parameters())


def test_todays_keywords_are_still_accepted() -> None:
    assert run_on_ranks(2, _todays_keywords_still_work) == [True, True]
