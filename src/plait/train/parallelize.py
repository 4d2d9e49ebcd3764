"""The composition recipe: how ``plait train`` puts the parallelisms together, in order.

1. **Pipeline split** (``--pp``): this rank keeps its stages of the model, each a copy of
   the model without the other stages' blocks, embeddings or head
   (:func:`plait.pipeline.split_model`); parameter names stay those of the whole model.
2. **Activation checkpointing** (``--ac``) per block: ``full`` recomputes a block in
   backward, ``selective`` keeps its matmul outputs and recomputes the rest, ``offload``
   parks what backward needs in host memory.
3. **Data parallelism** per block, then the stage's root: ``fully_shard`` over the
   ``dp_shard`` mesh dimension, or over the 2-D ``(dp_replicate, dp_shard)`` mesh (HSDP:
   sharded inside a group, replicated across groups); ``replicate`` over ``dp_replicate``
   when nothing is sharded. Mixed precision and CPU offload are ``fully_shard`` policies;
   without ``fully_shard``, bf16 runs the forward under autocast (:func:`forward_context`).

The order matters: checkpointing wraps the block's forward first, so ``fully_shard``'s
hooks run outside it and a recomputation in backward finds the block already unsharded.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plait.checkpoint import checkpoint
from plait.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from plait.pipeline import schedule_spec, split_model, stage_layers, stages_of_rank
from plait.replicate import replicate
from plait.train.config import TrainConfig
from plait.train.model import GPT, Block

__all__ = [
    "Stage",
    "build_mesh",
    "forward_context",
    "mesh_coordinate",
    "parallelize",
]

#: ``--ac selective`` keeps the outputs of these (the matmuls) and recomputes the rest.
SELECTIVE_OPS = frozenset(
    {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
)


class Stage:
    """One pipeline stage held by this rank (the whole model when there is no pipeline)."""

    def __init__(self, index: int, n_stages: int, module: GPT) -> None:
        self.index = index
        self.n_stages = n_stages
        self.module = module

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1


def build_mesh(cfg: TrainConfig) -> DeviceMesh | None:
    """The device mesh ``(pp, dp_replicate, dp_shard)``, keeping only dimensions > 1.

    ``dp_shard`` is innermost, so sharding (the most communication) stays between
    neighbouring ranks, which torchrun places on the same node. None for one process.
    """
    dims = [(n, s) for n, s in cfg.mesh_dims.items() if s > 1]
    if not dims:
        return None
    names, shape = zip(*dims, strict=True)
    return init_device_mesh(cfg.device, tuple(shape), mesh_dim_names=tuple(names))


def mesh_coordinate(mesh: DeviceMesh | None, dim: str) -> int:
    """This rank's index along ``dim`` (0 where the mesh has no such dimension)."""
    if mesh is None or dim not in (mesh.mesh_dim_names or ()):
        return 0
    return mesh.get_local_rank(dim)


def _split(model: GPT, cfg: TrainConfig, pp_rank: int) -> list[Stage]:
    if cfg.pp == 1:
        return [Stage(0, 1, model)]
    style = schedule_spec(cfg.schedule).style
    mine = stages_of_rank(pp_rank, cfg.pp, cfg.n_stages, style)
    # Blocks in contiguous runs; the embeddings go with the first, the head with the last.
    plan = stage_layers(model, cfg.n_stages, layers="blocks")
    modules = split_model(model, plan, stages=mine)
    return [Stage(s, cfg.n_stages, cast(GPT, m)) for s, m in zip(mine, modules, strict=True)]


def _blocks(module: GPT) -> list[Block]:
    return [b for b in module.blocks if isinstance(b, Block)]


def _checkpoint(module: GPT, ac: str) -> None:
    if ac == "none":
        return
    options: dict[str, Any] = {"selective": {"policy": SELECTIVE_OPS}, "offload": {"offload": True}}
    for block in _blocks(module):
        checkpoint(block, **options.get(ac, {}))  # "full": no options


def _shard(module: GPT, cfg: TrainConfig, mesh: DeviceMesh) -> None:
    dp_dims = ("dp_replicate", "dp_shard") if cfg.dp_replicate > 1 else ("dp_shard",)
    bf16 = cfg.mp == "bf16"
    shard = functools.partial(
        fully_shard,
        mesh=mesh[dp_dims],
        mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        ),
        offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
    )
    for block in _blocks(module):
        shard(block, reshard_after_forward=cfg.reshard_after_forward)
    shard(module)  # the root: embeddings, head, and what runs at the end of backward


def parallelize(model: GPT, cfg: TrainConfig, mesh: DeviceMesh | None) -> list[Stage]:
    """Apply the recipe (module docstring) to ``model``; returns this rank's stages."""
    stages = _split(model, cfg, mesh_coordinate(mesh, "pp"))  # 1. pipeline split
    for stage in stages:
        _checkpoint(stage.module, cfg.ac)  # 2. activation checkpointing per block
        if cfg.dp_shard > 1:  # 3. data parallelism per block, then the root
            assert mesh is not None
            _shard(stage.module, cfg, mesh)
        elif cfg.dp_replicate > 1:
            assert mesh is not None
            replicate(stage.module, mesh=mesh["dp_replicate"])
    return stages


def forward_context(cfg: TrainConfig) -> AbstractContextManager[Any]:
    """What the forward runs under: autocast to bf16 where no ``fully_shard`` casts."""
    if cfg.mp == "bf16" and cfg.dp_shard == 1:
        return torch.autocast(cfg.device, dtype=torch.bfloat16)
    return nullcontext()
