"""The parity oracle accepts a correct data-parallel wrapping and catches a wrong one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import RankError, run_on_ranks
from models import MLPStack
from parity import check_parity, random_batches


def _average_gradients_by_hand(model: nn.Module) -> nn.Module:
    """A minimal, obviously-correct DDP: all-reduce each gradient as it is accumulated."""
    world = dist.get_world_size()

    def hook(param: torch.Tensor) -> None:
        assert param.grad is not None
        dist.all_reduce(param.grad)
        param.grad /= world

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    return model


def _parity_with_hand_ddp() -> tuple[list[float], float]:
    report = check_parity(MLPStack, _average_gradients_by_hand, random_batches(4, 8, 8, 8))
    return report.parallel_losses, report.max_param_diff


@pytest.mark.parametrize("world_size", [2, 4])
def test_correct_wrapping_matches_the_reference(world_size: int) -> None:
    results = run_on_ranks(world_size, _parity_with_hand_ddp)
    losses, diff = results[0]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert diff < 1e-6
    assert all(r[0] == losses for r in results)  # every rank saw the same losses


def _parity_without_gradient_sync() -> None:
    check_parity(MLPStack, lambda m: m, random_batches(3, 8, 8, 8))


def test_missing_gradient_sync_is_caught() -> None:
    with pytest.raises(RankError, match="parallel loss .* != reference"):
        run_on_ranks(2, _parity_without_gradient_sync, timeout=60)
