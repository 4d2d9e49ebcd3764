"""What the planner reasons about: a model, a workload, a machine, a layout, and the memory
of one rank. Plain frozen dataclasses shared by the cost model, the search, the dry run and
the command line; nothing here computes a prediction. The layout is the one ``plait
train`` runs (:class:`plait.layout.Layout`), or a :class:`PlanLayout`: the same layout as
another framework would run it (ZeRO-1/2 data parallelism, Megatron-LM's activations),
which the planner predicts and ``plait train`` does not run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.layout import LAYOUT_FIELDS, MESH_DIMS, Layout

__all__ = [
    "LAYOUT_DIMS",
    "RECIPES",
    "TP_OVERLAPS",
    "ZERO",
    "ZERO_STAGES",
    "DeviceSpec",
    "Layout",
    "MemoryBreakdown",
    "ModelSpec",
    "PlanLayout",
    "Software",
    "Workload",
    "recipe",
    "zero_ranks",
    "zero_stage",
]

#: The mesh dimensions in :class:`Layout`'s field order: the order the planner's flags and
#: the commands it prints list them.
LAYOUT_DIMS = tuple(name for name in LAYOUT_FIELDS if name in MESH_DIMS)

#: Whose implementation of a layout the memory model follows (:class:`PlanLayout`).
RECIPES = ("plait", "megatron", "torchtitan", "foundry", "llama3")
#: ZeRO stages the planner models: 0 (none: plait's data parallelism), 1 and 2.
ZERO_STAGES = (0, 1, 2)
#: The dim ZeRO's collectives are reported on (:mod:`plait.plan.comm`): the data-parallel
#: ranks it shards the optimizer over, ``dp_replicate x cp``.
ZERO = "zero"


@dataclass(frozen=True)
class PlanLayout(Layout):
    """A :class:`~plait.layout.Layout` as another framework runs it: a prediction for
    published runs, not something ``plait train`` runs (it refuses one: see
    :func:`plait.plan.train_plan.config_of_layout`).

    ``zero``: ZeRO stage of the data parallelism (DeepSpeed ZeRO-1/2; Megatron-LM's
    distributed optimizer is ZeRO-1), over ``dp_replicate x cp`` (:func:`zero_ranks`);
    needs ``dp_shard`` 1 (parameters are replicated, not ``fully_shard`` ed) and ``ep`` 1.
    Parameters are kept in the compute dtype on every rank; the fp32 master copy and
    AdamW's moments (ZeRO-1), and the fp32 gradients too (ZeRO-2), are sharded over the
    group. Per step, gradients are reduce-scattered and the updated parameters
    all-gathered (an all-reduce's bytes); ZeRO-2 reduce-scatters every microbatch.

    ``recipe``: ``"plait"`` (what plait's runtime saves for backward: torch's tensor
    parallelism keeps the all-gathered linear inputs, autocast keeps the residual stream
    in fp32) or ``"megatron"`` (Megatron-LM's, Korthikanti et al. 2022, arXiv 2205.05198:
    with sequence parallelism every saved activation is split by ``tp`` and re-gathered in
    backward, a fused SwiGLU saves its input only), or another framework's as published
    runs used it (``"torchtitan"``, llm-foundry's ``"foundry"``, Meta's ``"llama3"``);
    :mod:`plait.plan.keeps` (``RECIPE_KEEPS``) says what each saves.
    """

    zero: int = 0
    recipe: str = "plait"

    def __post_init__(self) -> None:
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"--zero {self.zero}: the planner models ZeRO stages 1 and 2")
        if self.recipe not in RECIPES:
            raise ValueError(f"--recipe {self.recipe}: one of {', '.join(RECIPES)}")


def zero_stage(layout: Layout) -> int:
    """``layout``'s ZeRO stage: 0 for plait's own data parallelism."""
    return layout.zero if isinstance(layout, PlanLayout) else 0


def recipe(layout: Layout) -> str:
    """Whose activations ``layout`` saves: ``"plait"`` unless a :class:`PlanLayout` says."""
    return layout.recipe if isinstance(layout, PlanLayout) else "plait"


def zero_ranks(layout: Layout) -> int:
    """The ranks ZeRO shards the optimizer (and ZeRO-2 the gradients) over:
    ``dp_replicate x cp`` (the ranks holding the same parameters); 1 without ZeRO."""
    return layout.dp_replicate * layout.cp if zero_stage(layout) else 1


#: How tensor parallelism's collectives run (:class:`Software`).
TP_OVERLAPS = ("none", "async")


@dataclass(frozen=True)
class Software:
    """What the training code does beside the layout: the cost model's view of a
    framework (:mod:`plait.plan.timing`, :mod:`plait.plan.roofline`).

    * ``kernels``: the software stack whose kernels run a block
      (:data:`plait.plan.roofline.STACKS`: ``"plait"``, eager PyTorch as plait runs it;
      ``"torchtitan"``; ``"megatron-core"``, Transformer Engine; ``"megatron-2021"``;
      ``"llm-foundry"``);
    * ``tp_overlap``: ``"none"`` (torch's TP collectives in the compute stream, exposed) or
      ``"async"`` (Megatron's ``--tp-comm-overlap``, torchtitan's AsyncTP: each collective
      decomposed into the GEMM it feeds or follows);
    * ``param_gather_overlap``: ZeRO's all-gather of the updated parameters runs beside
      the next step's forward, block by block (Megatron's ``--overlap-param-gather``),
      rather than after the optimizer step, exposed;
    * ``grad_reduce_fp32``: data-parallel gradient reductions in fp32 (plait's, DeepSpeed's)
      or, False, in the compute dtype (Megatron-Core's ``grad_reduce_in_fp32=False``
      default);
    * ``ac_early_stop``: whether ``ac="full"`` stops recomputing a block as soon as every
      tensor its backward saved is rebuilt (torch's non-reentrant checkpoint since 2.1,
      ``torch.utils.checkpoint.set_checkpoint_early_stop``, and ``plait.checkpoint``):
      the block's last GEMM, the MLP's output projection, packs its saved input before
      it runs and is never recomputed, nor the residual addition after it. ``None``: the
      stack's (:data:`plait.plan.roofline.STACKS`: True but for Megatron's own
      checkpoint function, which reruns the whole block); False for torch before 2.1
      (non-reentrant checkpoint reran the whole function) or reentrant checkpointing.

    The default is what ``plait train`` runs.
    """

    kernels: str = "plait"
    tp_overlap: str = "none"
    param_gather_overlap: bool = False
    grad_reduce_fp32: bool = True
    ac_early_stop: bool | None = None

    def __post_init__(self) -> None:
        if self.tp_overlap not in TP_OVERLAPS:
            raise ValueError(f"tp_overlap must be one of {TP_OVERLAPS}, got {self.tp_overlap!r}")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (Llama family or plait's GPT).

    ``ffn_hidden``: the MLP's inner width; ``gated``: a SwiGLU MLP (three matrices, Llama)
    rather than two (GPT); ``kv_heads``: grouped-query attention (``heads`` for none);
    ``tied``: the head shares the embedding's weight; ``bias`` / ``norm_bias``: linear and
    norm layers have biases (GPT: LayerNorm and biased linears; Llama: RMSNorm, none);
    ``head_dim``: the heads' width where it is not ``d_model / heads`` (Qwen3); ``qk_norm``:
    per-head RMSNorms of queries and keys (Qwen3); ``source``: what ``plait train
    --model-config`` builds it from (a preset or a config.json; empty for plait's GPT).

    Mixture of experts (``experts`` > 0, plait's ``plait.experts.MoE``): every block after
    the first ``dense_layers`` replaces its MLP by a router (a bias-free ``d_model x
    experts`` gate), ``experts`` routed SwiGLU experts of width ``expert_hidden`` (each
    token goes to ``top_k`` of them, dropless) and ``shared_experts`` shared ones (one
    SwiGLU of width ``expert_hidden x shared_experts`` every token goes through). The
    leading dense blocks keep the MLP of ``ffn_hidden`` / ``gated``. Without experts the
    other MoE fields are ignored.
    """

    name: str
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    gated: bool = True
    tied: bool = False
    bias: bool = False
    norm_bias: bool = False
    positions: int = 0  # rows of a learned position embedding (plait's GPT: seq_len), else 0
    experts: int = 0  # routed experts per MoE block; 0: a dense model
    top_k: int = 1
    shared_experts: int = 0
    expert_hidden: int = 0
    dense_layers: int = 0  # leading blocks with a dense MLP (DeepSeek-V3: 3)
    head_dim: int = 0  # each attention head's width; 0: d_model / heads
    qk_norm: bool = False  # per-head RMSNorms of queries and keys (Qwen3)
    # What ``plait train --model-config`` takes to build exactly this model (a preset name
    # or a config.json path); "" for plait's GPT (its --n-layer / --n-head / --d-model).
    source: str = ""

    @property
    def dim_head(self) -> int:
        """Each attention head's width (``head_dim``, by default ``d_model / heads``)."""
        return self.head_dim or self.d_model // self.heads

    @property
    def q_width(self) -> int:
        """The width of the queries (and of the attention's output): ``heads x head_dim``."""
        return self.heads * self.dim_head

    @property
    def kv_width(self) -> int:
        """The width of the keys, and of the values: ``kv_heads x head_dim``."""
        return self.kv_heads * self.dim_head

    def __post_init__(self) -> None:
        if self.experts < 0 or self.shared_experts < 0 or self.dense_layers < 0:
            raise ValueError(f"{self.name}: experts, shared experts and dense layers must be >= 0")
        if self.experts:
            if not 1 <= self.top_k <= self.experts:
                raise ValueError(
                    f"{self.name}: --top-k {self.top_k} must be in 1..--experts {self.experts}"
                )
            if self.expert_hidden < 1:
                raise ValueError(f"{self.name}: --expert-hidden must be at least 1 with experts")
            if self.dense_layers >= self.layers:
                raise ValueError(
                    f"{self.name}: --dense-layers {self.dense_layers} leaves no MoE block of "
                    f"{self.layers}: use fewer than {self.layers}"
                )

    @property
    def moe_layers(self) -> int:
        """Blocks whose MLP is a mixture of experts (0 for a dense model)."""
        return self.layers - self.dense_layers if self.experts else 0


@dataclass(frozen=True)
class Workload:
    """One optimizer step: ``global_batch`` sequences of ``seq_len`` tokens.

    ``precision``: ``"fp32"`` or ``"bf16"`` (bf16 compute and all-gathers, fp32 shards,
    gradient reductions and optimizer state, as plait's ``--mp bf16``).
    """

    seq_len: int
    global_batch: int
    precision: str = "bf16"


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator and its links, per device: bytes, FLOP/s and bytes/s.

    ``measured``: the figures were measured on the machine (:mod:`plait.plan.measure`),
    not read from a datasheet: ``flops`` / ``flops_fp32`` are then *achieved* rates at the
    workload's shapes, used as they are (no efficiency factor). The fields after it are
    what a measurement adds; datasheet presets keep their defaults:

    * ``latency``: seconds of one collective call whatever its size;
    * ``update_rate``: parameter elements per second through the optimizer step (gradient
      clipping and AdamW: a memory-bound pass); 0: not modelled;
    * ``overlap``: whether communication runs beside compute. False on a CPU, where gloo's
      threads share the compute's cores: communication adds to compute;
    * ``unit_overhead``: host seconds ``fully_shard`` adds per unit and microbatch (hooks,
      DTensor parameters, buffer copies), collective latency excluded; 0: not modelled;
    * ``oversubscription``: workers per core (at least 1). Rates are measured with every
      worker busy; above 1, a worker idle in a pipeline's bubble leaves its share of the
      cores to the others, which then run up to this many times faster.
    """

    name: str
    memory: float
    flops: float  # dense peak in the workload's compute precision
    intra_node_bw: float  # per device, one direction (NVLink)
    inter_node_bw: float  # per device, one direction (RDMA NIC)
    gpus_per_node: int = 8
    flops_fp32: float = 0.0  # dense fp32 peak (no TF32) for fp32 workloads; 0: flops / 2
    measured: bool = False
    latency: float = 10e-6
    update_rate: float = 0.0
    overlap: bool = True
    unit_overhead: float = 0.0
    oversubscription: float = 1.0


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds at its peak, by part (predicted or measured)."""

    params: float  # sharded (or replicated) parameters this rank stores
    grads: float
    optimizer: float
    unsharded: float  # all-gathered units alive at the peak
    activations: float  # saved for backward, over the microbatches in flight
    buffers: float  # communication buffers (all-gather / reduce-scatter staging)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        parts = (self.params, self.grads, self.optimizer, self.unsharded, self.activations)
        return sum(parts) + self.buffers + sum(self.extra.values())
