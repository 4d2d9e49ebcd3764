"""What the planner reasons about: a model, a workload, a machine, a layout, and the memory
of one rank. Plain frozen dataclasses shared by the cost model, the search, the dry run and
the command line; nothing here computes a prediction. The layout is the one ``plait
train`` runs (:class:`plait.layout.Layout`), or a :class:`PlanLayout`: the same layout as
another framework would run it (ZeRO-1/2 data parallelism, Megatron-LM's activations),
which the planner predicts and ``plait train`` does not run. The model
(:class:`ModelSpec`) is the train layer's (:mod:`plait.train.model_spec`: the one
description ``plait train`` builds from), re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.layout import LAYOUT_FIELDS, MESH_DIMS, Layout

# Re-exported: the model is described once, in the train layer (``plait train`` builds from
# it, the planner prices it).
from plait.train.model_spec import ModelSpec as ModelSpec

__all__ = [
    "FLOAT8_RECIPES",
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
TP_OVERLAPS = ("none", "async", "micro-pipeline")
#: torchao's Float8Linear recipes the cost model prices (:class:`Software`, ``float8``).
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")


@dataclass(frozen=True)
class Software:
    """What the training code does beside the layout: the cost model's view of a
    framework (:mod:`plait.plan.timing`, :mod:`plait.plan.roofline`).

    * ``kernels``: the software stack whose kernels run a block
      (:data:`plait.plan.stacks.STACKS`: ``"plait"``, eager PyTorch as plait runs it;
      ``"torchtitan"``; ``"megatron-core"``, Transformer Engine; ``"megatron-2021"``;
      ``"megatron-deepspeed"``, the same kernels under DeepSpeed's engine; ``"llm-foundry"``);
    * ``tp_overlap``: ``"none"`` (torch's TP collectives in the compute stream, exposed),
      ``"async"`` (Megatron's ``--tp-comm-overlap``: each collective decomposed into the
      GEMM it feeds or follows, forward and backward) or ``"micro-pipeline"`` (torch's
      async TP, torchtitan's ``enable_async_tensor_parallel``: inductor fuses an
      all-gather into the matmuls it feeds and a reduce-scatter into the one matmul that
      produces it, so backward's reduce-scatters of input gradients, sums of several
      matmuls, stay whole; a fused reduce-scatter adds a reduction of the ``tp`` partial
      outputs on the compute stream);
    * ``param_gather_overlap``: ZeRO's all-gather of the updated parameters runs beside
      the next step's forward, block by block (Megatron's ``--overlap-param-gather``),
      rather than after the optimizer step, exposed;
    * ``grad_reduce_fp32``: data-parallel gradient reductions in fp32 (plait's, DeepSpeed's)
      or, False, in the compute dtype (Megatron-Core's ``grad_reduce_in_fp32=False``
      default);
    * ``ep_inner``: the expert-parallel groups are the innermost dim of an expert mesh of
      their own (Megatron-Core's ``expert_tensor_parallel_size=1``: its experts' ranks laid
      out as ETP x EP x EDP x PP apart from the dense TP x CP x DP x PP), so an ep group is
      ``ep`` consecutive ranks; False (plait's mesh, Megatron's ETP = TP): ``ep`` just
      outside ``tp``, a group spanning ``ep x tp`` ranks. Only where the all-to-alls run
      changes (inside a node or across nodes): the bytes are the same;
    * ``ac_early_stop``: whether ``ac="full"`` stops recomputing a block as soon as every
      tensor its backward saved is rebuilt (torch's non-reentrant checkpoint since 2.1,
      ``torch.utils.checkpoint.set_checkpoint_early_stop``, and ``plait.checkpoint``):
      the block's last GEMM, the MLP's output projection, packs its saved input before
      it runs and is never recomputed, nor the residual addition after it. ``None``: the
      stack's (:data:`plait.plan.stacks.STACKS`: True but for Megatron's own
      checkpoint function, which reruns the whole block); False for torch before 2.1
      (non-reentrant checkpoint reran the whole function) or reentrant checkpointing.

    Memory (:mod:`plait.plan.memory`) reads ``grad_reduce_fp32`` too: the gradient
    buffers a reduction reads (ZeRO's, Megatron-Core's ``main_grad`` and apex's
    contiguous grad buffer, DeepSpeed's fp16 ``param.grad``; ``fully_shard``'s accumulated
    gradients and reduce-scatter input) are in the reduction's dtype. And:

    * ``optimizer_states``: what the optimizer keeps per parameter beside the
      compute-dtype weights. ``"fp32"``: fp32 moments and fp32 master weights
      (``fully_shard``'s fp32 shards, ZeRO's fp32 partition; plait's, torchtitan's,
      Megatron's distributed optimizer, DeepSpeed). ``"remainders"``: fp32 moments, the
      master weights stored as the bf16 weights and their 16-bit remainders (2 bytes, not
      4: apex ``DistributedFusedAdam(store_param_remainders=True)``, which NeMo picks for a
      bf16 model under an fp32 optimizer; Transformer Engine's ``FusedAdam``).
      ``"bf16"``: no fp32 copy at all: the weights (and under ``fully_shard`` their shards
      and gradients) stay in bf16 and AdamW's moments are bf16 (torch's optimizers keep
      them in the parameter's dtype; NeMo's ``distributed_fused_adam`` with ``dtype:
      bf16``);
    * ``loss_upcast``: the cross-entropy runs on an fp32 copy of the logits
      (``logits.float()``: plait's ``lm_loss``, torchtitan's), so its saved
      log-probabilities and its backward's gradients are fp32; False: on the
      compute-dtype logits as they are (NeMo AutoModel's ``MaskedCrossEntropy(fp32_upcast=
      False)``).

    Kernels (:mod:`plait.plan.stacks`, "torch.compile and Float8"):

    * ``compiled``: ``torch.compile`` of each block (``plait train --compile``,
      torchtitan's ``compile``): the memory-bound passes fused (RMSNorm in one pass, the
      activation and gate product, rope, the first residual addition into the norm after
      it) and fewer kernel launches; GEMMs and attention unchanged;
    * ``float8``: ``"none"``, or torchao's ``Float8Linear`` recipe ``"tensorwise"`` /
      ``"rowwise"`` (``plait train --float8``: tensorwise): every linear of the blocks (not
      the head, not a MoE's router or routed experts) runs its three GEMMs in fp8 at the
      device's fp8 dense peak, plus the kernels that cast its operands; needs a device
      with an fp8 peak (:func:`plait.plan.devices.fp8_peak`);
    * ``float8_all_gather``: ``fully_shard`` all-gathers the blocks' linear weights in
      fp8 (torchao's ``enable_fsdp_float8_all_gather``, tensorwise only): 1 byte per
      parameter instead of the compute dtype's, and no weight casts in the blocks;
    * ``float8_tp_gather``: tensor parallelism's sequence-parallel all-gathers of the
      attention's and the MLP's inputs move fp8 (torchtitan's Float8 tensorwise TP,
      torchao's ``PrepareFloat8ModuleInput`` / ``Float8ColwiseParallel``: the input is cast
      before it is gathered; the reduce-scatters and backward's exchanges stay in the
      compute dtype); ``plait train`` gathers in the compute dtype;
    * ``compiled_loss``: ``torch.compile`` of the cross-entropy over the logits too
      (torchtitan's ``compile`` since 2025-04, ``build_cross_entropy_loss``; not ``plait
      train --compile``, which compiles the blocks): inductor fuses the upcast, the
      log-softmax and its backward, so the loss moves ``3 e`` bytes per vocabulary element
      (:data:`plait.plan.stacks.LOSS_BYTES` ``"fused"``) and keeps no fp32
      full-vocabulary tensor: the compute-dtype logits and, in backward, their gradient
      (memory as a fused cross-entropy, :class:`plait.plan.keeps.Keeps` ``"fused_ce"``).

    Context parallelism: ``kv_repeated``: whether the attention receives keys and values
    repeated to the query heads, which context parallelism then exchanges at the queries'
    width (None: the stack's, :data:`plait.plan.stacks.STACKS`).

    The default is what ``plait train`` runs.
    """

    kernels: str = "plait"
    tp_overlap: str = "none"
    param_gather_overlap: bool = False
    grad_reduce_fp32: bool = True
    ep_inner: bool = False
    ac_early_stop: bool | None = None
    optimizer_states: str = "fp32"
    loss_upcast: bool = True
    compiled: bool = False
    float8: str = "none"
    float8_all_gather: bool = False
    float8_tp_gather: bool = False
    compiled_loss: bool = False
    kv_repeated: bool | None = None

    def __post_init__(self) -> None:
        if self.compiled_loss and not self.compiled:
            raise ValueError(
                "compiled_loss needs compiled=True (torchtitan compiles its loss with the "
                "blocks, under one flag)"
            )
        if self.float8 not in FLOAT8_RECIPES:
            raise ValueError(f"float8 must be one of {FLOAT8_RECIPES}, got {self.float8!r}")
        if self.float8_all_gather and self.float8 != "tensorwise":
            raise ValueError(
                "float8_all_gather needs float8='tensorwise' (torchao all-gathers "
                f"tensorwise-scaled weights only), got float8={self.float8!r}"
            )
        if self.float8_tp_gather and self.float8 != "tensorwise":
            raise ValueError(
                "float8_tp_gather needs float8='tensorwise' (torchtitan gathers fp8 inputs "
                f"over tp for tensorwise scaling only), got float8={self.float8!r}"
            )
        if self.tp_overlap not in TP_OVERLAPS:
            raise ValueError(f"tp_overlap must be one of {TP_OVERLAPS}, got {self.tp_overlap!r}")
        states = ("fp32", "remainders", "bf16")
        if self.optimizer_states not in states:
            raise ValueError(
                f"optimizer_states must be one of {states}, got {self.optimizer_states!r}"
            )


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
      cores to the others, which then run up to this many times faster;
    * ``runtime_memory``: bytes a process holds beyond the tensors the memory model counts
      (a CPU process's interpreter and libraries, a GPU's workspaces and allocator slack),
      added to every rank's peak; fitted by ``--calibrate`` (:mod:`plait.plan.calibrate`;
      negative where the model over-counts), 0 for the presets;
    * ``flops_fp8``: the dense fp8 peak (FLOP/s) Float8 GEMMs run at
      (:class:`Software` ``float8``); 0: the device has none, and float8 is refused.
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
    runtime_memory: float = 0.0
    flops_fp8: float = 0.0  # dense fp8 peak (Float8 GEMMs); 0: none (float8 refused)


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
