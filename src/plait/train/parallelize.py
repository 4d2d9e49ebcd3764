"""The composition recipe: how ``plait train`` puts the parallelisms together, in order.

1. **Pipeline split** (``--pp``): this rank keeps its stages of the model, each a copy of
   the model without the other stages' blocks, embeddings or head
   (:func:`plait.pipeline.split_model`); parameter names stay those of the whole model.
2. **Tensor parallelism** (``--tp``) over the ``tp`` mesh dimension, torch's own
   ``torch.distributed.tensor.parallel`` with the plan below (:func:`tensor_parallel_plan`):
   parameters become DTensors on the tp mesh, and the loss runs under ``loss_parallel``
   (:func:`loss_context`).
3. **Activation checkpointing** (``--ac``) per block: ``full`` recomputes a block in
   backward, ``selective`` keeps its matmul outputs and recomputes the rest, ``offload``
   parks what backward needs in host memory.
4. **Data parallelism** per block, then the stage's root: ``fully_shard`` over the
   ``dp_shard`` mesh dimension, or over the 2-D ``(dp_replicate, dp_shard)`` mesh (HSDP:
   sharded inside a group, replicated across groups); ``replicate`` over ``dp_replicate``
   when nothing is sharded. Mixed precision and CPU offload are ``fully_shard`` policies;
   without ``fully_shard``, bf16 runs the forward under autocast (:func:`forward_context`).

The order matters: tensor parallelism first, so that what checkpointing recomputes and what
``fully_shard`` shards over the data-parallel ranks are the tensor-parallel pieces;
checkpointing wraps the block's forward next, so ``fully_shard``'s hooks run outside it and
a recomputation in backward finds the block already unsharded.

The tensor-parallel plan (torchtitan's and Megatron's): in each block, attention's q, k
and v column-wise (each rank computes ``n_head / tp`` heads) and its output projection
row-wise, the MLP's first linear column-wise and its second row-wise; the token embedding
row-wise (the vocabulary split over the ranks) and the head column-wise, its logits left
sharded by vocabulary for ``loss_parallel``. With sequence parallelism (the default) the
activations between those layers stay sharded on the sequence dimension: the norms run on
sequence shards (``SequenceParallel``), attention and MLP gather the sequence on entry and
their row-wise outputs reduce-scatter it on exit, and the position embedding is split by
position like the sequence. Without it, activations are replicated over the tp ranks and
the norms and the position embedding stay plain replicated parameters.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from plait.checkpoint import checkpoint
from plait.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from plait.layout import DATA_PARALLEL, DP_REPLICATE, DP_SHARD, PP, TP
from plait.mesh import mesh_coordinate
from plait.pipeline import schedule_spec, split_model, stage_layers, stages_of_rank
from plait.replicate import replicate
from plait.train.config import TrainConfig
from plait.train.model import GPT, Block

__all__ = [
    "Stage",
    "build_mesh",
    "forward_context",
    "loss_context",
    "mesh_coordinate",
    "parallelize",
    "tensor_parallel_plan",
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
    """The device mesh of ``cfg``'s layout (:meth:`plait.layout.Layout.mesh`): ``(pp,
    dp_replicate, dp_shard, tp)``, keeping only dimensions > 1; None for one process."""
    return cfg.layout.mesh(cfg.device)


def _split(model: GPT, cfg: TrainConfig, pp_rank: int) -> list[Stage]:
    if cfg.pp == 1:
        return [Stage(0, 1, model)]
    style = schedule_spec(cfg.schedule).style
    mine = stages_of_rank(pp_rank, cfg.pp, cfg.n_stages, style)
    # Blocks in contiguous runs; the embeddings go with the first, the head with the last.
    plan = stage_layers(model, cfg.n_stages, layers="blocks")
    modules = split_model(model, plan, stages=mine)
    return [Stage(s, cfg.n_stages, cast(GPT, m)) for s, m in zip(mine, modules, strict=True)]


def tensor_parallel_plan(module: GPT, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan (module docstring) of ``module``, a whole model or a
    pipeline stage (only the parts it holds), by submodule name."""
    between = Shard(1) if sequence_parallel else Replicate()  # activations between layers
    block: dict[str, ParallelStyle] = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=between),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:
        # Norms on sequence shards; attention and the MLP gather the sequence on entry (their
        # row-wise outputs reduce-scatter it back: ``between`` is Shard(1)).
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        block |= {"ln1": SequenceParallel(), "ln2": SequenceParallel()}
        block |= {"attn": gather, "mlp": gather}
    plan: dict[str, ParallelStyle] = {}
    if module.tok_emb:  # falsy on pipeline stages without it
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if module.pos_emb and sequence_parallel:
        # Its output, (T, C), has the sequence on dim 0: each rank adds its positions.
        plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    for i, b in enumerate(module.blocks):
        if isinstance(b, Block):
            plan |= {f"blocks.{i}.{name}": style for name, style in block.items()}
    if module.ln_f and sequence_parallel:
        plan["ln_f"] = SequenceParallel()
    if module.head:
        # Logits stay a DTensor sharded by vocabulary: loss_parallel's cross-entropy
        # reduces over the ranks without gathering the (B, T, vocab) logits.
        plan["head"] = ColwiseParallel(
            input_layouts=between, output_layouts=Shard(-1), use_local_output=False
        )
    return plan


def loss_context(cfg: TrainConfig) -> AbstractContextManager[Any]:
    """What the loss and its backward run under: ``loss_parallel`` with ``--tp``, whose
    head leaves the logits sharded by vocabulary."""
    return loss_parallel() if cfg.tp > 1 else nullcontext()


def _blocks(module: GPT) -> list[Block]:
    return [b for b in module.blocks if isinstance(b, Block)]


def _checkpoint(module: GPT, ac: str) -> None:
    if ac == "none":
        return
    options: dict[str, Any] = {"selective": {"policy": SELECTIVE_OPS}, "offload": {"offload": True}}
    for block in _blocks(module):
        checkpoint(block, **options.get(ac, {}))  # "full": no options


def _shard(module: GPT, cfg: TrainConfig, mesh: DeviceMesh) -> None:
    dp_dims = DATA_PARALLEL if cfg.dp_replicate > 1 else (DP_SHARD,)
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
    stages = _split(model, cfg, mesh_coordinate(mesh, PP))  # 1. pipeline split
    for stage in stages:
        if cfg.tp > 1:  # 2. tensor parallelism
            assert mesh is not None
            plan = tensor_parallel_plan(stage.module, cfg.sequence_parallel)
            parallelize_module(stage.module, mesh[TP], plan)
        _checkpoint(stage.module, cfg.ac)  # 3. activation checkpointing per block
        if cfg.dp_shard > 1:  # 4. data parallelism per block, then the root
            assert mesh is not None
            _shard(stage.module, cfg, mesh)
        elif cfg.dp_replicate > 1:
            assert mesh is not None
            replicate(stage.module, mesh=mesh[DP_REPLICATE])
    return stages


def forward_context(cfg: TrainConfig) -> AbstractContextManager[Any]:
    """What the forward runs under: autocast to bf16 where no ``fully_shard`` casts."""
    if cfg.mp == "bf16" and cfg.dp_shard == 1:
        return torch.autocast(cfg.device, dtype=torch.bfloat16)
    return nullcontext()
