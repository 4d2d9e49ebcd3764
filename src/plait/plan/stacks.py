"""What each software stack runs beside the roofline (:mod:`plait.plan.roofline`): its
attention kernel, its memory-bound passes and launches, its loss over the logits; and how
``torch.compile`` and Float8 change a stack's kernels.

**Software stacks** (:data:`STACKS`, chosen by :class:`plait.plan.spec.Software`): the
memory-bound passes and attention above are eager PyTorch's (``plait``, ``torchtitan``).
Other code bases run other kernels, priced from their byte counts, not fitted:

* ``megatron-core`` (Transformer Engine, 2024): LayerNorm in one pass fused into the
  linear (``2 e`` bytes per element), fused bias-GELU / SwiGLU (read, write) and rope,
  cuDNN's fused attention: on H100 0.55 forward and 0.45 backward of the peak (the cuDNN
  curves of FlashAttention-3's figures, arXiv 2407.08608, head dimension 128, long
  causal sequences), on A100 as FlashAttention-2; 12 kernels per block forward;
* ``megatron-2021``: fused LayerNorm, bias-GELU and bias-dropout-add (a byte mask per
  element), no flash attention (published 2022): the scores materialized, two batched
  GEMMs per head over the whole sequence (the mask applied after) with the head
  dimension as one side, and the fused scale-mask-softmax and dropout 0.1 reading and
  writing every score (``2 e`` and ``2 e + 1`` bytes); 18 kernels;
* ``megatron-deepspeed`` (Megatron-DeepSpeed, 2021-2022: BLOOM, MT-NLG): Megatron-LM's
  2021 kernels above, so ``megatron-2021``'s fitted scale, run by DeepSpeed's engine (its
  pipeline engine, activation checkpointing and ZeRO-1 optimizer), which adds host time
  per block and micro-batch that the GPU does not hide
  (:data:`plait.plan.compute_time.STACK_HOST`: the published tables show it as a fixed cost
  per block and micro-batch, the same at TP 1 to 8 and micro-batches of 1 to 4 samples);
* ``llm-foundry`` (MPT): llm-foundry's Triton flash attention (``attn_impl: triton``, the
  default of its ``submit_benchmarks.py`` when its tables were measured), low-precision
  LayerNorm in one pass, eager GELU and residuals; 14 kernels. No cited figure prices that
  kernel on either device: it runs at FlashAttention-2's fractions divided by
  :data:`TRITON_SLOWDOWN`, one factor per device fitted by least squares on the rows of
  llm-foundry's own tables that no validation set counts (``benchmarks/foundry_attention.py``:
  31 H100 and 26 A100 rows, 512 to 65,536 tokens). Priced as FlashAttention-2, both
  tables were over-predicted more the longer the sequence (H100 from 0.97 at 512 tokens to
  1.21 at 65,536, A100 from 0.91 to 1.35); fitted, each is flat within a few percent. The
  A100's fitted 1.51 agrees with FlashAttention-2's paper (arXiv 2307.08691: 1.3-1.5x faster
  forward and about 2x backward than attention in Triton on the A100); the H100's is
  1.28;
* ``plait`` / ``torchtitan``: 38 kernels (the fp32 RMSNorm alone is 8). torchtitan's
  selective checkpointing (its ``op`` policy) saves attention and every second matmul,
  recomputing the other matmuls and the memory-bound work.

**torch.compile and Float8** (:class:`plait.plan.spec.Software` ``compiled``, ``float8``,
``float8_all_gather``; priced from byte counts and peaks, nothing fitted):

* ``compiled`` (``torch.compile`` of each block, inductor; :func:`compiled`): the stack's
  memory-bound passes fused as inductor fuses pointwise and reduction chains: RMSNorm in
  one pass (read, write: ``2 e``), the SwiGLU's ``silu(a) x b`` in one (read both, write:
  ``3 e``), rope in one (``2 e``), and the first residual addition fused into the RMSNorm
  after it (the kernel reads both addends and writes the sum beside the normed output:
  ``2 e`` more, not ``3 e``); the block's last addition ends the graph and stays ``3 e``.
  GEMMs stay cuBLAS calls and attention the flash kernel (inductor's defaults: no
  max-autotune), so their times do not change. Kernels per block forward
  (:data:`COMPILED_KERNELS`): 7 GEMMs (q, k, v, o, gate, up, down), flash attention, two
  fused norms, rope, the activation, the last residual addition: 13 (a stack already
  launching fewer keeps its count). The head is not compiled; the loss is where
  ``Software.compiled_loss`` says (torchtitan's since 2025-04; ``plait train --compile``
  compiles the blocks only), then priced as ``"fused"`` below. ``plait train --compile``
  under context parallelism compiles a block's norms and its feed-forward network as graphs
  of their own and runs attention eagerly (:mod:`plait.train.compiled`: its SDPA becomes
  collectives): the norms and the activation fuse, rope stays as the stack runs it, no
  residual addition fuses (the block's own forward is no graph), and the forward launches
  the stack's kernels less those the fusions save (an ``eager-fp32`` norm's 8 become 1,
  the eager activation's 2 become 1: 23 for ``plait``).
* ``float8`` (torchao ``Float8Linear`` as torchtitan converts the model, ``"tensorwise"``
  or ``"rowwise"``): every linear of a block (q, k, v, o, the MLP's, a MoE's shared
  experts; not the head, not a MoE's router nor its routed experts, a grouped GEMM)
  runs its forward, input-gradient and weight-gradient GEMMs in fp8: ``2 M N K`` FLOPs at
  ``gemm_fp8 x g(M) g(N) g_K(K)`` of the device's dense fp8 peak
  (:func:`plait.plan.devices.fp8_peak`), or ``(M K + K N) + e M N`` bytes (fp8 operands,
  output in the compute dtype), the longer; ``K_half`` scales with the fp8 rate per SM
  (twice the bf16 one). ``gemm_fp8`` (:data:`FP8_GEMM`): an *assumption*, not a cited
  measurement (the mamf-finder table is bf16 only): cuBLAS fp8 GEMMs at large shapes are
  commonly reported at 1.3 to 1.45 PFLOP/s on the H100 SXM, 0.65 to 0.73 of its 1,979;
  0.70 is taken for the H100 and H200 and, in the same ratio to its bf16 fraction
  (0.875), 0.65 for the B200. Rowwise scaling runs a CUTLASS kernel that torchao calls
  slower than tensorwise's cuBLAS one; it is priced the same (not modelled).
  **The casts** (torchao ``float8_utils`` / ``float8_tensor``): each GEMM operand is cast
  from its high-precision copy per use, ``amax = max(abs(x))``, a scale from it, then
  ``x.to(float32) * scale``, clamped, ``.to(float8)``. Per Float8Linear and microbatch,
  forward: the input ``X`` (``M x K``) and the weight ``W`` (``N x K``); backward: the
  output gradient twice (for the input-gradient GEMM and, transposed, for the
  weight-gradient one: ``2 M N``), ``W`` and ``X`` again (torchao saves the
  high-precision ``X`` and ``W`` and casts in backward). Bytes per element cast
  (:func:`cast_cost`): eager, op by op: ``abs`` (read, write ``e``), ``max`` (read
  ``e``), the upcast (read ``e``, write 4), the scaling and the clamp (read, write 4
  each), the cast (read 4, write 1): ``4 e + 25`` bytes in 8 kernels (two for the scale);
  compiled, tensorwise: the global amax needs a grid-wide reduction before any element
  can be scaled, so two kernels, the amax (read ``e``) and one fused scale-clamp-cast
  (read ``e``, write 1): ``2 e + 1``; compiled, rowwise: a row's amax and its cast fuse
  into one kernel (read ``e``, write 1): ``e + 1``. With ``float8_all_gather`` the weight
  arrives in fp8, its scale precomputed once per step over the shards (one all-reduce,
  latency only; the shard's cast before the all-gather is ``1 / dp_shard`` of the
  weight's bytes, left out): no weight casts in the blocks. With ``float8_tp_gather``
  (torchtitan's Float8 TP, tensorwise, tp > 1: ``PrepareFloat8ModuleInput`` and
  ``Float8ColwiseParallel``) the attention's input and a dense MLP's are cast once each,
  on the sequence shard (``n / tp`` rows), and gathered in fp8: q, k, v and the MLP's
  input GEMMs cast no input of their own, forward or backward (the saved input is the
  fp8 one). The casts are memory-bound
  work beside the GEMMs (:attr:`BlockKernels.cast`); their kernels count as launches
  (backward's taken as twice the forward's, as for the rest).

**Context parallelism** (``cp > 1``; :func:`plait.plan.comm.cp_traffic`,
:func:`plait.plan.comm_time.cp_exposed`). What a context-parallel attention exchanges is
the keys and values it is handed: ``torchtitan`` repeats them to the query heads before
attention (``kv_repeated``: its Llama at 9dec370, ``repeat_kv`` before
``F.scaled_dot_product_attention``), so under grouped-query attention every exchange
moves ``heads / kv_heads`` times the keys and values a GQA-aware attention does
(:mod:`plait.context`, which plait's Llama hands grouped heads under context parallelism;
Transformer Engine's, Megatron-Core's; Meta's all-gather, which its Llama 3 paper states
moves the GQA-sized K and V). plait's Ulysses (``alltoall``) expands key/value heads that
do not divide by ``cp`` before its exchange. And whose attention runs (``context``): ``"plait"``,
:mod:`plait.context`'s methods; ``"torch"`` (torchtitan), torch's ``context_parallel``
(``torch.distributed.tensor.experimental``), whose all-gather method differs from
plait's: the all-gather is issued before the first (local) block's attention and waited
on after it, and its backward gathers the keys and values again the same way and passes
their fp32 gradient accumulators round the ring, ``cp`` shifts, each issued after one
block's backward and waited on after the next (``_templated_ring_attention_backward``:
its ``dkv_rotater`` always shifts). torch's ring method shifts as plait's ring does.
Ulysses (``cp_method="alltoall"``) has no torch counterpart and is priced as plait's.

**Block-wise attention's memory-bound passes** (:func:`cp_pass_bytes`, per element of the
rank's attention output ``n q / tp``, beside the attention kernels; ``r``: key/value
elements per query element as attention receives them, 1 when repeated). The all-gather
and ring methods attend the local queries block by block and merge the partial outputs
in fp32 by their log-sum-exp; backward accumulates the blocks' gradients in fp32. As each
code runs them (the busiest rank, every block whole; small per-row log-sum-exp tensors
left out):

* torch's ``context_parallel`` (``_SDPAMerger``, ``_templated_ring_attention`` and its
  backward), eager: the first block's output cast to fp32 and the result cast back (6
  bytes each); per later block (``cp - 1``) the cast (6), ``out - block_out`` (12), the
  sigmoid weight's product (8), the subtraction (12): 38; the ``cat`` of the current keys
  and values into the next send buffer (``8 r``), made on every step. Backward: fp32
  zeros and final casts of ``dq``, ``dk``, ``dv`` (``10 + 20 r``); per block ``dq +=``
  (10), ``dk +=``, ``dv +=`` (``20 r``), their ``cat`` into the shift's buffer (``16 r``),
  and the keys' ``cat`` again. Under ``torch.compile`` (torchtitan compiles each block
  with ``fullgraph=True``, the attention inside the graph) each merge is one fused pass
  (read ``out`` and the block's, write ``out``: 10), the casts fold into the first and
  last, the all-gather method's unused per-step ``cat`` is dropped, and each step's
  ``dk``, ``dv`` additions write the shift's buffer directly (``20 r``).
* Transformer Engine (``megatron-core``, :attr:`Stack.cp_merges` ``"fused"``): its
  corrections are fused kernels, priced as torch's compiled ones.
* :mod:`plait.context` (eager, also under ``plait train --compile``: its autograd
  functions run outside the graph): each merge (:func:`plait.context.blocks.merge`) casts
  the block (6), weighs both sides (8 + 8), adds (12) and writes the rows back into the
  accumulator (8): 42 per merged element. The ring merges ``cp + 1/2`` outputs' worth
  (its own keys' three blocks, then one output's worth per step), from fp32 zeros (4) to
  the cast back (6), beside ``torch.stack`` of k, v (``8 r``); backward ``dq +=`` over
  the same (10 each), ``dk``, ``dv +=`` per step (``20 r``), zeros and casts. The
  all-gather merges two blocks per local chunk (the prefix and the causal diagonal), and
  copies the gathered keys and values into natural order (``8 r cp``); its backward
  accumulates ``dq`` (zeros, two blocks' additions, the cast: 30) and, into fp32 gradients
  of the whole sequence's keys and values at the query heads, ``dk`` and ``dv`` (zeros,
  additions over ``cp + 1/2`` outputs' worth, casts: ``40 cp + 10``), and copies them back
  out of natural order (``8 r cp``) before the reduce-scatter. Under grouped-query
  attention (``r < 1``) both expand the keys and values to the query heads (``4 + 4 r``
  per step, the ring; once over the gathered sequence, the all-gather) and fold their
  gradients back (as much again; the ring each step).
* Ulysses (``alltoall``) runs one attention over the whole sequence: none.

**The loss** over the logits (:data:`LOSS_BYTES`, per vocabulary element of the rank and
token, forward and backward together, split 1 : 2): ``plait`` / ``torchtitan`` torch's
eager loss, ``2 e + 28``; ``megatron-core`` and ``megatron-2021`` Megatron's
vocab-parallel cross-entropy (``megatron/core/tensor_parallel/cross_entropy.py``, the
same in 2021's ``mpu``): ``logits.float()`` (read ``e``, write 4), max (read 4), the
in-place subtraction, ``exp`` and the division (read and write 4 each), the sum (read 4);
backward the multiply by the output gradient (read, write 4) and the cast back (read 4,
write ``e``): ``2 e + 48``; ``llm-foundry`` flash-attn's fused cross-entropy (its
default ``loss_fn``, ``fused_crossentropy``): the logits read forward, read and the
gradient written backward, ``3 e``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plait.plan.devices import family, fp8_peak
from plait.plan.spec import DeviceSpec, ModelSpec, Software

__all__ = [
    "ATTENTION",
    "COMPILED_KERNELS",
    "FP8_GEMM",
    "LOSS_BYTES",
    "STACKS",
    "STACK_NAMES",
    "TRITON_SLOWDOWN",
    "Float8",
    "Stack",
    "attention_in_graph",
    "cast_cost",
    "compiled",
    "cp_pass_bytes",
    "float8",
    "kv_share",
    "stack",
]


@dataclass(frozen=True)
class Stack:
    """A software stack's kernels (module docstring, "Software stacks"): which attention
    kernel, which memory-bound passes and how many kernels a block launches."""

    name: str
    attention: str  # "fa2" (flash attention 2), "cudnn" (TE / cuDNN), "triton"
    # (llm-foundry's Triton flash attention) or "materialized" (scores in HBM)
    norm: str  # "eager-fp32" (RMSNorm in fp32, op by op) or "fused" (one pass)
    activation: str  # "eager" (activation, then gate product) or "fused"
    rope: str  # "eager-fp32" (complex products in fp32) or "fused"
    dropout: bool  # dropout after attention's softmax and in the residual additions
    kernels: int  # kernels one block's forward launches (backward: twice)
    selective: str  # what ``ac="selective"`` recomputes: "plait" or "torchtitan"
    loss: str = "eager-fp32"  # the loss over the logits: :data:`LOSS_BYTES`
    early_stop: bool = True  # ``ac="full"`` stops its recompute at the last saved tensor
    fused_residuals: int = 0  # residual additions fused into the norm after them (compile)
    scale_of: str = ""  # the stack whose fitted scale it shares (it runs that one's kernels)
    kv_repeated: bool = False  # k, v repeated to the query heads before attention
    context: str = "plait"  # whose context-parallel attention: "plait" or "torch"
    cp_merges: str = "eager"  # its block merges: "eager" (compile may fuse) or "fused"


STACKS: dict[str, Stack] = {
    "plait": Stack("plait", "fa2", "eager-fp32", "eager", "eager-fp32", False, 38, "plait"),
    "torchtitan": Stack(
        "torchtitan",
        "fa2",
        "eager-fp32",
        "eager",
        "eager-fp32",
        False,
        38,
        "torchtitan",
        kv_repeated=True,
        context="torch",
    ),
    "megatron-core": Stack(
        "megatron-core",
        "cudnn",
        "fused",
        "fused",
        "fused",
        False,
        12,
        "plait",
        "megatron-fp32",
        early_stop=False,
        cp_merges="fused",
    ),
    "megatron-2021": Stack(
        "megatron-2021",
        "materialized",
        "fused",
        "fused",
        "fused",
        True,
        18,
        "plait",
        "megatron-fp32",
        early_stop=False,
    ),
    "llm-foundry": Stack(
        "llm-foundry", "triton", "fused", "eager", "fused", False, 14, "plait", "fused"
    ),
}
STACKS["megatron-deepspeed"] = dataclasses.replace(
    STACKS["megatron-2021"], name="megatron-deepspeed", scale_of="megatron-2021"
)
"""The software stacks the cost model knows (module docstring, "Software stacks")."""

STACK_NAMES = tuple(STACKS)

TRITON_SLOWDOWN: dict[str, float] = {"a100": 1.51, "h100": 1.28, "b200": 1.28}
"""How many times slower than FlashAttention-2 llm-foundry's Triton flash attention runs,
forward and backward, by chip family: fitted per device on llm-foundry's tables
(``benchmarks/foundry_attention.py``; module docstring); the B200 as the H100 (no table)."""

_FA2 = {"h100": (0.35, 0.30), "a100": (0.70, 0.60), "b200": (0.35, 0.30)}
ATTENTION: dict[tuple[str, str], tuple[float, float]] = {
    **{("fa2", chip): rates for chip, rates in _FA2.items()},
    ("cudnn", "h100"): (0.55, 0.45),
    ("cudnn", "a100"): (0.70, 0.60),
    ("cudnn", "b200"): (0.55, 0.45),
    **{
        ("triton", chip): (fwd / TRITON_SLOWDOWN[chip], bwd / TRITON_SLOWDOWN[chip])
        for chip, (fwd, bwd) in _FA2.items()
    },
}
"""Flash attention kernels' fractions of the dense peak ``(forward, backward)``, causal
FLOPs counted, by kernel and chip family (:func:`plait.plan.devices.family`; module
docstring)."""

LOSS_BYTES: dict[str, tuple[float, float]] = {
    "eager-fp32": (28.0, 2.0),
    "megatron-fp32": (48.0, 2.0),
    "fused": (0.0, 3.0),
}
"""HBM bytes per vocabulary element of the rank and token that the loss over the logits
moves, forward and backward together, as ``(fixed, per byte of the compute dtype)``
(module docstring, "The loss")."""


COMPILED_KERNELS = 13
"""Kernels one compiled block's forward launches (module docstring, "torch.compile and
Float8")."""


def compiled(kernels: Stack, attention: bool = True) -> Stack:
    """``kernels`` under ``torch.compile`` of each block (module docstring): norms,
    activation and rope fused, the first residual addition fused into the norm after it,
    :data:`COMPILED_KERNELS` launches; attention, GEMMs, the loss and the checkpointing
    policy unchanged. ``attention=False``: the attention runs eagerly outside the graphs
    (``plait train --compile`` under context parallelism): the norms and the activation
    fused only."""
    if not attention:
        saved = 2 * 7 if kernels.norm == "eager-fp32" else 0  # two norms, 8 kernels to 1
        saved += 1 if kernels.activation == "eager" else 0  # silu, product: one kernel
        return dataclasses.replace(
            kernels, norm="fused", activation="fused", kernels=kernels.kernels - saved
        )
    return dataclasses.replace(
        kernels,
        norm="fused",
        activation="fused",
        rope="fused",
        fused_residuals=max(kernels.fused_residuals, 1),
        kernels=min(kernels.kernels, COMPILED_KERNELS),
    )


FP8_GEMM: dict[str, float] = {"h100": 0.70, "b200": 0.65}
"""Per chip family (:func:`plait.plan.devices.family`), the fraction of the dense fp8
peak large fp8 GEMMs reach (an assumption, module docstring, "torch.compile and
Float8")."""


@dataclass(frozen=True)
class Float8:
    """How a block's Float8Linears run (module docstring, "torch.compile and Float8"): the
    fp8 peak, the GEMM fraction and ``K_half`` at that rate, the bytes one cast moves per
    element (``per_element x e + fixed``) in ``kernels`` launches, and whether the weights
    are cast in the block (False: all-gathered in fp8), and whether tp gathers the inputs
    of the column-parallel linears in fp8 (each module input cast once, on its sequence
    shard, before the gather: :attr:`plait.plan.spec.Software.float8_tp_gather`)."""

    peak: float
    gemm: float
    k_half: float
    per_element: float
    fixed: float
    kernels: int
    weights: bool
    gathered: bool = False


def cast_cost(compiled_block: bool, recipe: str) -> tuple[float, float, int]:
    """One cast to fp8: bytes per element as ``(per byte of the compute dtype, fixed)``
    and kernels (module docstring)."""
    if not compiled_block:
        return 4.0, 25.0, 8
    if recipe == "rowwise":
        return 1.0, 1.0, 1
    return 2.0, 1.0, 2


def float8(device: DeviceSpec, software: Software, gemm: float, k_half: float) -> Float8 | None:
    """``software``'s Float8Linears on ``device`` (None without float8), beside its bf16
    GEMMs' fraction ``gemm`` and ``k_half`` (:class:`plait.plan.roofline.KernelProfile`);
    ValueError for a device without an fp8 peak (:func:`plait.plan.devices.fp8_peak`)."""
    if software.float8 == "none":
        return None
    peak = fp8_peak(device)
    fraction = FP8_GEMM.get(family(device.name), gemm)
    per_element, fixed, kernels = cast_cost(software.compiled, software.float8)
    # The fixed prologue and epilogue against a main loop at the fp8 rate per SM.
    half = k_half * peak / device.flops
    weights = not software.float8_all_gather
    return Float8(
        peak, fraction, half, per_element, fixed, kernels, weights, software.float8_tp_gather
    )


def stack(name: str) -> Stack:
    """The stack called ``name`` (ValueError for an unknown one)."""
    if name not in STACKS:
        raise ValueError(f"kernels {name!r}: one of {', '.join(STACKS)}")
    return STACKS[name]


def kv_share(model: ModelSpec, software: Software) -> float:
    """Key/value elements per query element as ``software``'s attention receives them
    (module docstring, "Context parallelism"): 1 where they are repeated to the query
    heads (``software.kv_repeated``, else its stack's), else ``kv_width / q_width``."""
    repeated = software.kv_repeated
    if repeated is None:
        repeated = stack(software.kernels).kv_repeated
    return 1.0 if repeated else model.kv_width / model.q_width


def attention_in_graph(kernels: Stack, cp: int) -> bool:
    """Whether ``torch.compile`` of a block takes in its attention: always without context
    parallelism; under it torch's ``context_parallel`` (torchtitan compiles each block
    whole, ``fullgraph=True``), not :mod:`plait.context` (``plait train --compile`` runs it
    eagerly, :mod:`plait.train.compiled`)."""
    return cp == 1 or kernels.context == "torch"


def cp_pass_bytes(
    kernels: Stack, method: str, cp: int, kv_share: float, compiled: bool
) -> tuple[float, float]:
    """HBM bytes per element of the rank's attention output that a context-parallel
    attention of ``kernels``' stack moves beside its kernels, ``(forward, backward)`` of one
    block and microbatch (module docstring, "Block-wise attention's memory-bound passes");
    ``kv_share``: key/value elements per query element as attention receives them;
    ``compiled``: the blocks under ``torch.compile``. (0, 0) without context parallelism
    and for Ulysses."""
    if cp == 1 or method == "alltoall":
        return 0.0, 0.0
    r, later = kv_share, cp - 1
    torch_cp = kernels.context == "torch"
    if kernels.cp_merges == "fused" or (compiled and attention_in_graph(kernels, cp)):
        cats = 8 * r * later if torch_cp and method == "ring" else 0.0
        return 10 * later + cats, cp * (10 + 20 * r) + cats
    if torch_cp:
        cats = 8 * r * later
        return 12 + 38 * later + cats, 10 + 20 * r + cp * (10 + 36 * r) + cats
    grouped = 4 + 4 * r if r < 1 else 0.0  # expanding to the query heads (folding: as much)
    if method == "ring":
        merged = cp + 0.5
        forward = 10 + 8 * r + 42 * merged + cp * grouped
        return forward, 10 + 28 * r + 10 * merged + cp * (20 * r + 2 * grouped)
    forward = 10 + 2 * 42 + 8 * r * (cp + 1) + cp * grouped
    return forward, 40 + 40 * cp + 8 * r * cp + cp * grouped
