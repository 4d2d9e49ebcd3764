"""The composition recipe: how ``plait train`` puts the parallelisms together, in order.

1. **Pipeline split** (``--pp``): this rank keeps its stages of the model, each a copy of
   the model without the other stages' blocks, embeddings or head
   (:func:`plait.pipeline.split_model`); parameter names stay those of the whole model.
   With ``--float8`` its blocks' linears then become torchao's float8 linears
   (:mod:`plait.train.float8`), before what follows wraps or shards them: ``fully_shard``
   must shard the float8 weight subclass to all-gather in float8.
2. **Tensor parallelism** (``--tp``) over the ``tp`` mesh dimension, torch's own
   ``torch.distributed.tensor.parallel`` with the plan below (:func:`tensor_parallel_plan`):
   parameters become DTensors on the tp mesh, and the loss runs under ``loss_parallel``
   (:func:`loss_context`).
3. **Context parallelism** (``--cp``): each sequence is split over the ``cp`` ranks (a head
   and a tail chunk each: :mod:`plait.context`), which share their data-parallel rank's
   batch; every attention runs over the whole sequence from the local tokens
   (``--cp-method``: keys and values all-gathered, ringed, or all-to-all by heads), and
   the position embedding takes the tokens' global positions. Rows packed with several
   documents: their document ids and positions in documents are computed on the whole
   rows and sharded alike (:func:`plait.train.step.step_batch`), and each attention
   passes the ids to the context-parallel attention (``packed_documents``).
4. **Expert parallelism** (``--ep``, with ``--experts`` or a ``--model-config`` of a
   mixture of experts: Mixtral, Qwen3-MoE): every MoE block's routed experts are
   sharded over the ``ep`` dimension of the experts' mesh (``dp_shard x cp`` split into
   ``(efsdp, ep)``: :meth:`plait.layout.Layout.expert_mesh`), tokens sent to them by
   all-to-all (:func:`plait.experts.expert_parallel`). Every MoE balances its load over
   the data-parallel (and context-parallel) ranks, which hold different tokens.
5. **Compilation** (``--compile``): each block's forward compiled in place
   (:mod:`plait.train.compiled`), after the steps that decide what a block computes (its
   tensor-parallel pieces, its context-parallel attention, its experts' dispatch) and
   before the ones that only hook around it (checkpointing, fully_shard), whose hooks so
   stay eager, outside the graphs. Then **activation checkpointing** (``--ac``) per
   block: ``full`` recomputes a block in backward, ``selective`` keeps its matmul outputs
   and recomputes the rest, ``offload`` parks what backward needs in host memory.
6. **Data parallelism** per block, then the stage's root: ``fully_shard`` over the
   ``dp_shard`` mesh dimension (with ``--cp``, over ``dp_shard x cp``: each cp rank's
   gradients cover its own tokens), or over the 2-D ``(dp_replicate, dp_shard)`` mesh
   (HSDP: sharded inside a group, replicated across groups); ``replicate`` over
   ``dp_replicate`` when nothing is sharded. A block's expert-parallel experts are a
   parameter group of their own in the block's unit, sharded over ``efsdp`` (and
   replicated over ``dp_replicate``): torchtitan's layout. Stacked expert weights shard on
   their experts' dim when it splits evenly over their ranks, else on a dim that does
   (``Shard(1)``: fewer experts than ranks must not pad every shard to a whole expert).
   Mixed precision and CPU offload are
   ``fully_shard`` policies; without ``fully_shard``, bf16 runs the forward under
   autocast (:func:`forward_context`).

The order matters: tensor parallelism first, so that what checkpointing recomputes and what
``fully_shard`` shards over the data-parallel ranks are the tensor-parallel pieces;
checkpointing wraps the block's forward next, so ``fully_shard``'s hooks run outside it and
a recomputation in backward finds the block already unsharded.

A mixture-of-experts block under tensor parallelism: the MoE runs on the whole sequence
(gathered on entry, its output cut back to this rank's positions with sequence
parallelism), its shared experts split like the dense MLP, and the router replicated over
the tp ranks (the same routing on each). Under ``fully_shard`` the tp ranks share the
routed rows (:attr:`plait.layout.Layout.splits_routed_rows`): each runs one chunk of
them through the routed experts (and their all-to-all) and the outputs are all-gathered,
and the routed experts are sharded over ``efsdp x tp``, whose fully_shard group sums the
chunks' gradients (torchtitan's experts likewise take ranks from tp). Without
``fully_shard`` every tp rank computes all routed rows, the experts replicated over tp.
(Experts whose matrices tp splits, Megatron's expert-tensor parallelism, are left out.)

The tensor-parallel plan (torchtitan's and Megatron's): in each block, attention's q, k
and v column-wise (each rank computes ``n_head / tp`` heads) and its output projection
row-wise, the MLP's first linear column-wise and its second row-wise (a Llama block's
SwiGLU: ``gate`` and ``up`` column-wise, ``down`` row-wise; its q and k/v heads split alike,
so the kv heads must divide by tp too; Qwen3's per-head query and key norms run on the
local heads, their gains replicated with gradients summed over tp); the token embedding
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
from typing import Any, TypeAlias, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from plait.checkpoint import checkpoint
from plait.context import Method, apply_context_parallel, sequence_positions
from plait.experts import MoE, expert_parallel, set_load_balance_mesh, split_routed_rows
from plait.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardPlacement,
    fully_shard,
)
from plait.layout import (
    CP,
    DATA_PARALLEL,
    DP_REPLICATE,
    DP_SHARD,
    DP_SHARD_CP,
    EFSDP,
    EP,
    PP,
    TP,
    Layout,
    expert_shard_dim,
)
from plait.mesh import mesh_coordinate
from plait.pipeline import schedule_spec, split_model, stage_layers, stages_of_rank
from plait.replicate import replicate
from plait.train.checkpointing import save_as
from plait.train.compiled import compile_blocks
from plait.train.config import ExecutionConfig, TrainConfig
from plait.train.float8 import convert as float8_linears
from plait.train.llama import Llama, LlamaBlock
from plait.train.llama.attention import LlamaAttention
from plait.train.model import GPT, Block

#: A model ``plait train`` builds: the GPT, or a Llama from a ``config.json``.
Model: TypeAlias = GPT | Llama

__all__ = [
    "Stage",
    "build_expert_mesh",
    "build_mesh",
    "build_shard_mesh",
    "forward_context",
    "is_tied",
    "loss_context",
    "mesh_coordinate",
    "parallelize",
    "tensor_parallel_plan",
]

#: ``--ac selective`` keeps the outputs of these (the matmuls) and recomputes the rest.
SELECTIVE_OPS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_mm.default,  # --float8's matmuls on CUDA
        torch.ops.aten._grouped_mm.default,  # the experts' GEMMs (plait.experts.grouped)
    }
)


class Stage:
    """One pipeline stage held by this rank (the whole model when there is no pipeline)."""

    def __init__(self, index: int, n_stages: int, module: Model) -> None:
        self.index = index
        self.n_stages = n_stages
        self.module = module

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1


def build_mesh(cfg: ExecutionConfig | TrainConfig) -> DeviceMesh | None:
    """The device mesh of ``cfg``'s layout (:meth:`plait.layout.Layout.mesh`) on its
    device: ``(pp, dp_replicate, dp_shard, tp)``, keeping only dimensions > 1; None for
    one process. ``cfg``: the execution group, or the whole TrainConfig (so for the two
    below)."""
    return cfg.layout.mesh(cfg.device)


def build_shard_mesh(cfg: ExecutionConfig | TrainConfig) -> DeviceMesh | None:
    """With ``--cp``, the mesh of tensor parallelism and fully_shard
    (:meth:`plait.layout.Layout.shard_mesh`: ``dp_shard x cp`` as one dimension)."""
    return cfg.layout.shard_mesh(cfg.device)


def build_expert_mesh(cfg: ExecutionConfig | TrainConfig, moe: bool) -> DeviceMesh | None:
    """The routed experts' mesh (:meth:`plait.layout.Layout.expert_mesh`) of a model with
    (``moe``) or without mixture-of-experts blocks: ``(pp, dp_replicate, efsdp, ep, tp)``,
    or with tp ranks that split the routed rows ``(pp, dp_replicate, efsdp, ep)`` (tp
    folded into efsdp); None when neither applies."""
    return cfg.layout.expert_mesh(cfg.device, split_rows=moe and cfg.layout.splits_routed_rows)


def _split(model: Model, layout: Layout, pp_rank: int) -> list[Stage]:
    if layout.pp == 1:
        return [Stage(0, 1, model)]
    style = schedule_spec(layout.schedule).style
    mine = stages_of_rank(pp_rank, layout.pp, layout.n_stages, style)
    # Blocks in contiguous runs; the embeddings go with the first, the head with the last.
    plan = stage_layers(model, layout.n_stages, layers="blocks", end_blocks=layout.end_blocks)
    modules = split_model(model, plan, stages=mine)
    if is_tied(model):  # the last stage's copy of the matrix: saved as the embedding's
        for m in modules:
            if not m.tok_emb and m.head:
                save_as(m, "head.weight", "tok_emb.weight")
    return [Stage(s, layout.n_stages, cast(Model, m)) for s, m in zip(mine, modules, strict=True)]


def tensor_parallel_plan(module: Model, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan (module docstring) of ``module``, a whole model or a
    pipeline stage (only the parts it holds), by submodule name."""
    between = Shard(1) if sequence_parallel else Replicate()  # activations between layers
    block: dict[str, ParallelStyle] = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=between),
    }
    mlp: dict[str, ParallelStyle] = {
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=between),
    }
    shared = {  # a MoE's shared experts, split as the MLP; its output stays replicated
        "mlp.shared_experts.w1": ColwiseParallel(),
        "mlp.shared_experts.w3": ColwiseParallel(),
        "mlp.shared_experts.w2": RowwiseParallel(),
    }
    swiglu: dict[str, ParallelStyle] = {  # a Llama block's MLP
        "mlp.gate": ColwiseParallel(),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=between),
    }
    # Qwen3's per-head query and key norms see this rank's heads (dim 1 of (B, heads, T,
    # d)): their gains replicated over tp, whose ranks' gradients differ and are summed.
    qk_norms: dict[str, ParallelStyle] = {
        f"attn.{name}": SequenceParallel(sequence_dim=1, use_local_output=True)
        for name in ("q_norm", "k_norm")
    }
    moe: dict[str, ParallelStyle] = {}
    if sequence_parallel:
        # Norms on sequence shards; attention and the MLP gather the sequence on entry (their
        # row-wise outputs reduce-scatter it back: ``between`` is Shard(1)).
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        block |= {"ln1": SequenceParallel(), "ln2": SequenceParallel(), "attn": gather}
        mlp["mlp"] = gather
        swiglu["mlp"] = gather
        # A MoE's output is whole and the same on every tp rank: each keeps its positions.
        moe["mlp"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
        )
    plan: dict[str, ParallelStyle] = {}
    if module.tok_emb:  # falsy on pipeline stages without it
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if isinstance(module, GPT) and module.pos_emb and sequence_parallel:
        # Its output, (T, C), or (B, T, C) for packed rows' per-row positions, has the
        # sequence on dim -2: each rank adds its positions.
        plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-2))
    for i, b in enumerate(module.blocks):
        if isinstance(b, LlamaBlock):
            styles = block | (moe if isinstance(b.mlp, MoE) else swiglu)
            if b.attn.q_norm is not None:
                styles |= qk_norms
            plan |= {f"blocks.{i}.{name}": style for name, style in styles.items()}
            continue
        if not isinstance(b, Block):
            continue
        styles = block | mlp
        if isinstance(b.mlp, MoE):
            styles = block | moe | (shared if b.mlp.shared_experts is not None else {})
        plan |= {f"blocks.{i}.{name}": style for name, style in styles.items()}
    if module.ln_f and sequence_parallel:
        plan["ln_f"] = SequenceParallel()
    if module.head:
        # Logits stay a DTensor sharded by vocabulary: loss_parallel's cross-entropy
        # reduces over the ranks without gathering the (B, T, vocab) logits.
        plan["head"] = ColwiseParallel(
            input_layouts=between, output_layouts=Shard(-1), use_local_output=False
        )
    return plan


def is_tied(module: Model) -> bool:
    """Whether ``module`` holds both the token embedding and a head that shares its matrix."""
    emb, head = module.tok_emb, module.head
    return bool(emb and head) and head.weight is emb.weight  # type: ignore[union-attr]


def loss_context(cfg: Layout | TrainConfig) -> AbstractContextManager[Any]:
    """What the loss and its backward run under in the layout ``cfg``: ``loss_parallel``
    with ``--tp``, whose head leaves the logits sharded by vocabulary."""
    return loss_parallel() if cfg.tp > 1 else nullcontext()


def _blocks(module: Model) -> list[Block | LlamaBlock]:
    return [b for b in module.blocks if isinstance(b, (Block, LlamaBlock))]


def _checkpoint(module: Model, ac: str) -> None:
    if ac == "none":
        return
    options: dict[str, Any] = {"selective": {"policy": SELECTIVE_OPS}, "offload": {"offload": True}}
    for block in _blocks(module):
        checkpoint(block, **options.get(ac, {}))  # "full": no options


def _shard_dims(layout: Layout) -> tuple[str, ...]:
    """The dims fully_shard shards over (HSDP: replicates, then shards): of the layout's
    mesh, or with context parallelism of its shard mesh (``dp_shard x cp`` as one)."""
    shard = DP_SHARD_CP if layout.cp > 1 else DP_SHARD
    return (DP_REPLICATE, shard) if layout.dp_replicate > 1 else (shard,)


def _token_dims(layout: Layout) -> tuple[str, ...]:
    """The dims of the layout's mesh whose ranks hold different tokens of a batch."""
    return tuple(d for d in (*DATA_PARALLEL, CP) if getattr(layout, d) > 1)


def _moe(
    module: Model, layout: Layout, mesh: DeviceMesh | None, experts: DeviceMesh | None
) -> None:
    """Expert parallelism and load balancing of ``module``'s MoE blocks (recipe step 4)."""
    dims = _token_dims(layout)
    dp = mesh[dims] if mesh is not None and dims else None
    if layout.ep > 1:
        assert experts is not None
        expert_parallel(module, experts[EP], load_balance_mesh=dp)
    else:
        set_load_balance_mesh(module, dp)
    if experts is not None and layout.splits_routed_rows:
        # The tp ranks see the same tokens: each runs a chunk of the routed rows, and the
        # experts' fully_shard group (efsdp, folded with tp) sums their gradients.
        assert mesh is not None
        split_routed_rows(module, mesh[TP])
    for m in module.modules():
        if isinstance(m, MoE):
            # Each microbatch's forward adds its own auxiliary losses: weighted 1/microbatches,
            # they average over the microbatches (and, by the gradient averaging of
            # fully_shard / replicate, over the data-parallel ranks), as the one-process loss
            # counts them once. (The token loss needs no such factor: each microbatch's is
            # its tokens' sum over the global batch's count, plait.train.step.)
            m.aux_loss_scale = 1.0 / layout.microbatches


def _expert_placement(block: Block | LlamaBlock, layout: Layout, experts: DeviceMesh | None) -> Any:
    """``shard_placement_fn`` of ``block``'s unit: its routed experts' stacked weights
    sharded on a dim their shard group divides (:func:`plait.layout.expert_shard_dim`), in
    a group on ``efsdp`` (HSDP: ``(dp_replicate, efsdp)``) under expert parallelism; the
    rest on the unit's mesh as ``Shard(0)``."""
    if not isinstance(block.mlp, MoE):
        return None
    if experts is not None:
        dims = (DP_REPLICATE, EFSDP) if layout.dp_replicate > 1 else (EFSDP,)
        mesh: DeviceMesh | None = experts[dims]
        group = experts[EFSDP].size()
    else:  # the experts shard with the rest of the unit
        mesh, group = None, layout.dp_shard * layout.cp
    placements: dict[int, Any] = {}
    for weight in block.mlp.experts.parameters():
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        shard = Shard(expert_shard_dim(tuple(local.shape), group))
        placements[id(weight)] = shard if mesh is None else ShardPlacement(shard, mesh)
    return lambda p: placements.get(id(p))


def _shard(
    module: Model, execution: ExecutionConfig, mesh: DeviceMesh, experts: DeviceMesh | None
) -> None:
    layout, bf16 = execution.layout, execution.mp == "bf16"
    shard = functools.partial(
        fully_shard,
        mesh=mesh[_shard_dims(layout)],
        mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        ),
        offload_policy=CPUOffloadPolicy() if execution.cpu_offload else OffloadPolicy(),
    )
    for block in _blocks(module):
        placement = _expert_placement(block, layout, experts)
        reshard = layout.reshard_after_forward
        shard(block, reshard_after_forward=reshard, shard_placement_fn=placement)
    shard(module)  # the root: embeddings, head, and what runs at the end of backward


def _context_parallel(
    module: Model, execution: ExecutionConfig, seq_len: int, mesh: DeviceMesh
) -> None:
    """Every attention of ``module`` over the whole sequence (of ``seq_len`` tokens) from
    this rank's tokens, and the position embedding at their global positions (recipe
    step 3)."""
    # On each attention, not the whole model: the mode then intercepts only the calls
    # that run SDPA, and nothing else of a block (its norms, its MLP) carries the mode's
    # hooks, so --compile can compile those parts whole.
    for block in _blocks(module):
        method = cast(Method, execution.layout.cp_method)
        apply_context_parallel(block.attn, mesh[CP], method=method)
        if isinstance(block.attn, LlamaAttention):  # exchange grouped keys, not repeated ones
            block.attn.repeat_kv = False
    module.positions = sequence_positions(seq_len, mesh[CP], device=execution.device)


def parallelize(
    model: Model,
    cfg: TrainConfig,
    mesh: DeviceMesh | None,
    experts: DeviceMesh | None = None,
    shard: DeviceMesh | None = None,
) -> list[Stage]:
    """Apply the recipe (module docstring) to ``model``; returns this rank's stages.
    ``cfg``: the whole configuration (the recipe reads ``cfg.execution``, and for ``--cp``
    the sequence length); ``mesh``: the layout's (:func:`build_mesh`); ``experts``: the
    experts' mesh (:func:`build_expert_mesh`; None without ``--ep``); ``shard``: what
    tensor parallelism and fully_shard use with ``--cp`` (:func:`build_shard_mesh`;
    default ``mesh``)."""
    execution = cfg.execution
    layout = execution.layout
    has_experts = model.moe_shape is not None  # the GPT's --experts, a Llama's config
    stages = _split(model, layout, mesh_coordinate(mesh, PP))  # 1. pipeline split
    inner = shard if shard is not None else mesh
    for stage in stages:
        float8_linears(_blocks(stage.module), execution)  # --float8: the blocks' linears
        if layout.tp > 1:  # 2. tensor parallelism
            assert inner is not None
            plan = tensor_parallel_plan(stage.module, layout.sequence_parallel)
            tied = is_tied(stage.module)
            parallelize_module(stage.module, inner[TP], plan)
            if tied:  # each style made its own DTensor: one matrix again (both Shard(0))
                assert stage.module.head and stage.module.tok_emb
                stage.module.head.weight = stage.module.tok_emb.weight
        if layout.cp > 1:  # 3. context parallelism: sequences split, attention exact
            assert mesh is not None
            _context_parallel(stage.module, execution, cfg.seq_len, mesh)
        if has_experts:  # 4. expert parallelism, load balancing over the dp ranks
            _moe(stage.module, layout, mesh, experts)
        if execution.compile:  # each block's forward compiled; the APIs' hooks stay around it
            compile_blocks(_blocks(stage.module), context_parallel=layout.cp > 1)
        _checkpoint(stage.module, layout.ac)  # 5. activation checkpointing per block
        if layout.dp_shard * layout.cp > 1:  # 6. data parallelism per block, then the root
            assert inner is not None
            _shard(stage.module, execution, inner, experts)
        elif layout.dp_replicate > 1:
            assert mesh is not None
            replicate(stage.module, mesh=mesh[DP_REPLICATE])
    return stages


def forward_context(cfg: ExecutionConfig | TrainConfig) -> AbstractContextManager[Any]:
    """What the forward runs under: autocast to bf16 where no ``fully_shard`` casts.
    ``cfg``: the execution group, or the whole TrainConfig."""
    if cfg.mp == "bf16" and cfg.layout.dp_shard * cfg.layout.cp == 1:
        return torch.autocast(cfg.device, dtype=torch.bfloat16)
    return nullcontext()
