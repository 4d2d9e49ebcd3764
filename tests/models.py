"""Small models shared by the tests, and the usual way to shard them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plait.fsdp import fully_shard
from plait.pipeline import PipelineStage, ScheduleDualPipeV, split_model, stages_of_rank


class MLP(nn.Module):
    """Linear-ReLU-Linear: the smallest model with more than one layer to wrap."""

    def __init__(self, dim: int = 8, hidden: int = 16, out: int | None = None) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden)
        self.out_proj = nn.Linear(hidden, dim if out is None else out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


class MLPStack(nn.Module):
    """``n`` residual MLP blocks: the shape most parallel wrappings are applied to."""

    def __init__(self, n: int = 3, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP(dim, hidden) for _ in range(n))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def hsdp_mesh() -> DeviceMesh:
    """A 2 x 2 (dp_replicate, dp_shard) mesh over 4 ranks: HSDP."""
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))


def shard_blocks(
    model: nn.Module, *, root_kwargs: dict[str, Any] | None = None, **kwargs: Any
) -> nn.Module:
    """plait's ``fully_shard`` on each of ``model.blocks``, then on the root (the usual
    recipe); ``kwargs`` go to every call, ``root_kwargs`` to the root's only."""
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs, **(root_kwargs or {}))
    return model


def layer_stack(n: int = 8, dim: int = 6) -> nn.Sequential:
    """``n`` Linear-Tanh layers on the last dimension: works on (B, C) and (B, T, C)."""
    return nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(n)))


def dualpipe_v_stages(
    model: nn.Module, m: int, rank: int, world: int
) -> tuple[ScheduleDualPipeV, list[nn.Module], list[int]]:
    """This rank's two stages of ``model`` (``2 * world`` stages in a V) under DualPipeV
    with ``m`` microbatches and an MSE loss: (schedule, stage modules, stage ids)."""
    n_stages = 2 * world
    ids = stages_of_rank(rank, world, n_stages, "v")
    modules = split_model(model, n_stages, stages=ids)
    stages = [PipelineStage(mod, s, n_stages, "cpu") for mod, s in zip(modules, ids, strict=True)]
    schedule = ScheduleDualPipeV(stages, m, loss_fn=nn.functional.mse_loss)
    return schedule, modules, ids
