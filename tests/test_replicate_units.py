"""``replicate`` as a ``fully_shard`` unit: the paths the unit adds beyond DDP's.

Mixed precision with a cast copy and gradient accumulation in the reduce dtype, the user's
all-reduce hook and evaluation forwards (each against torch's FSDP-based ``replicate``, bit
for bit); a module called twice in one forward, unused blocks, ``module.double()`` after
``replicate`` (against one process).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.replicate import replicate

from harness import run_on_ranks
from models import MLPStack
from parity import check_parity, random_batches


def _accumulate_in_fp32(model: nn.Module, step: int) -> None:
    model.set_requires_gradient_sync(step % 2 == 1)  # type: ignore[operator]


def _double_reduced(model: nn.Module, step: int) -> None:
    if step == 0:
        for module in model.modules():  # plait's and torch's FSDPModule alike
            if hasattr(module, "set_all_reduce_hook"):
                module.set_all_reduce_hook(lambda reduced: reduced.mul_(2))


def _eval_first(model: nn.Module, step: int) -> None:
    del step
    with torch.no_grad():
        model(torch.ones(2, 16))  # a forward without backward: casts, then frees the copies


@pytest.mark.parametrize("configure", [_double_reduced, _eval_first])
def test_hooks_and_eval_forwards_match_torch(configure: Callable[[nn.Module, int], None]) -> None:
    from test_replicate_fsdp import _side_by_side  # the acceptance test's comparison

    run_on_ranks(2, _side_by_side, True, torch.bfloat16, configure)


def _fp32_reduce_accumulation() -> None:
    from test_replicate_fsdp import _apply, _local, _torch_api, _train

    from plait.fsdp import MixedPrecisionPolicy

    torch_replicate, TorchPolicy, _ = _torch_api()
    torch.manual_seed(0)
    ours, theirs = MLPStack(3, dim=16, hidden=32), MLPStack(3, dim=16, hidden=32)
    theirs.load_state_dict(ours.state_dict())
    policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    _apply(ours, replicate, True, mp_policy=MixedPrecisionPolicy(**policy))
    _apply(theirs, torch_replicate, True, mp_policy=TorchPolicy(**policy))
    assert _train(ours, 4, _accumulate_in_fp32) == _train(theirs, 4, _accumulate_in_fp32)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(_local(p), _local(q))


def test_bf16_copies_accumulate_in_an_fp32_reduce_dtype_like_torch() -> None:
    run_on_ranks(2, _fp32_reduce_accumulation)


class _FirstBlockTwice(MLPStack):
    """Block 0 runs twice per forward: its backward comes in two parts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.blocks[0](x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class _UnusedBlock(MLPStack):
    """The last block never runs (a unit that runs on some ranks only would issue its
    collectives there only: ``plait.spmd`` reports that)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[:-1]:
            x = x + block(x)
        return self.head(x)


def _per_block(model: nn.Module) -> nn.Module:
    for block in model.blocks:  # type: ignore[union-attr]
        replicate(block, bucket_cap_mb=1e-4)
    return replicate(model)


def _parity(model_class: type[MLPStack]) -> None:
    check_parity(lambda: model_class(3), _per_block, random_batches(3, 8, 8, 8))


@pytest.mark.parametrize("model_class", [_FirstBlockTwice], ids=["block_run_twice"])
def test_per_block_replicate_trains_like_one_process(model_class: type[MLPStack]) -> None:
    run_on_ranks(2, _parity, model_class)


def _unused_blocks() -> list[bool]:
    torch.manual_seed(dist.get_rank())
    model = _per_block(_UnusedBlock(3))
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.blocks[0].parameters()])
    gathered = [torch.empty_like(grads) for _ in range(2)]
    dist.all_gather(gathered, grads)
    assert torch.equal(gathered[0], gathered[1])
    return [p.grad is None for p in model.blocks[2].parameters()]


def test_a_block_no_rank_runs_keeps_no_gradient() -> None:
    assert run_on_ranks(2, _unused_blocks) == [[True] * 4] * 2


def _double_after_replicate() -> None:
    def parallelize(model: nn.Module) -> nn.Module:
        return replicate(model).double()

    check_parity(
        lambda: MLPStack(2),
        parallelize,
        [(x.double(), y.double()) for x, y in random_batches(3, 8, 8, 8)],
        build_reference=lambda: MLPStack(2).double(),
    )


def test_module_apply_after_replicate_follows_the_new_dtype() -> None:
    run_on_ranks(2, _double_after_replicate)


def _tp_with_bf16_copies() -> dict[str, str]:
    """Tensor-parallel parameters under a bf16 ``mp_policy``: forward and backward on bf16
    DTensor copies, fp32 gradients laid out as the parameters, equal across dp ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from tp_models import TinyGPT, apply_tp, lm_loss, token_batches

    from plait.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = replicate(apply_tp(TinyGPT(), mesh["tp"]), mesh=mesh["dp"], mp_policy=policy)
    tokens, targets = token_batches(1, 4)[0]
    rank = mesh["dp"].get_local_rank()
    lm_loss(model(tokens.chunk(2)[rank]), targets.chunk(2)[rank]).backward()
    layouts = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
        assert p.dtype == p.grad.dtype == torch.float32, name
        local = p.grad.to_local().flatten()
        peers = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(peers, local, group=mesh["dp"].get_group())
        assert torch.equal(peers[0], peers[1]), name
        layouts[name] = f"{p.placements} {p.grad.placements}"
    return layouts


def test_tensor_parallel_parameters_with_bf16_copies() -> None:
    layouts = run_on_ranks(4, _tp_with_bf16_copies)[0]
    assert layouts["blocks.0.attn_norm.weight"] == "(Replicate(),) (Replicate(),)"
    assert layouts["blocks.0.mlp.fc2.weight"] == "(Shard(dim=1),) (Shard(dim=1),)"
