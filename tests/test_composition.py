"""The APIs compose: checkpoint inside fully_shard / replicate trains exactly like one process."""

from __future__ import annotations

import pytest
from torch import nn

from plait import checkpoint, fully_shard, replicate

from harness import run_on_ranks
from models import MLPStack
from parity import check_parity, random_batches


def _checkpoint_blocks(model: nn.Module) -> nn.Module:
    for block in model.blocks:
        checkpoint(block)
    return model


def _checkpoint_then_fully_shard(model: nn.Module) -> nn.Module:
    _checkpoint_blocks(model)
    for block in model.blocks:
        fully_shard(block)  # recomputation runs inside the unit's backward
    fully_shard(model)
    return model


def _checkpoint_then_replicate(model: nn.Module) -> nn.Module:
    return replicate(_checkpoint_blocks(model), bucket_cap_mb=1e-3)


RECIPES = {
    "fully_shard": _checkpoint_then_fully_shard,
    "replicate": _checkpoint_then_replicate,
}


def _parity(recipe: str) -> None:
    check_parity(lambda: MLPStack(3, dim=7, hidden=13), RECIPES[recipe], random_batches(3, 8, 7, 7))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("world_size", [2, 4])
def test_checkpoint_composes_with_data_parallelism(recipe: str, world_size: int) -> None:
    run_on_ranks(world_size, _parity, recipe)
