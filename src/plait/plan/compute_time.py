"""Compute seconds of one block and of a rank's ends for one microbatch: the compute part
of the cost model (:mod:`plait.plan.timing`), and its fitted constants.

**Compute** (:mod:`plait.plan.roofline`): each kernel of a block (q, k, v, o and MLP
GEMMs at their tp split and the microbatch's tokens; flash attention, causal, at its share
of the sequence, and under context parallelism the fp32 merges and gradient accumulations of
its blocks (:func:`plait.plan.stacks.cp_pass_bytes`); the eager memory-bound norms,
residuals, rotary embeddings and activations at the HBM bandwidth) and of the head and its
loss, priced by the roofline with a fraction of the peak that depends on the GEMM's shape;
backward twice the GEMMs and the memory-bound passes, flash attention's backward its own.
Every kernel time is divided by ``EFFICIENCY``, the sustained fraction. Checkpointing adds
its recomputation:
``selective`` recomputes attention and the memory-bound work (plait keeps only matmul
outputs), ``full`` the whole block forward, less what runs after the block's last saved
tensor where the checkpoint stops early (``Software.ac_early_stop``: the MLP's output
GEMM and the residual addition after it). Devices without a roofline profile (the
``cpu`` preset) run every FLOP at ``FLAT_EFFICIENCY`` of the peak; measured devices at
their measured rates.

**torch's async TP** (``Software.tp_overlap="micro-pipeline"``, with sequence
parallelism): each fused matmul + reduce-scatter
(``torch.distributed._symmetric_memory``'s ``fused_matmul_reduce_scatter``) writes the
``tp`` partial outputs and sums them in a reduction kernel of its own: reading ``n x d``
elements and writing their ``1 / tp``, after the attention's output projection and a dense
MLP's output GEMM, in every forward (a full recompute's too); its fused GEMMs run one
row chunk at a time (:mod:`plait.plan.roofline`).

**Mixture of experts.** A MoE block's compute is its attention, router and shared experts
and, per token, its ``top_k`` experts. The router runs whole on every tp rank; under tensor
parallelism with ``fully_shard`` the routed rows are cut into ``tp`` chunks, one per tp
rank, so a rank runs ``1 / tp`` of the routed experts' rows (whole experts: tp splits rows,
not their matrices; without ``fully_shard`` every tp rank runs all of them:
:func:`~plait.plan.shards.routed_tp`).

**Calibration.** ``EFFICIENCY`` (the shared sustained fraction), ``STACK_SCALE`` (one
factor per software stack), ``DEVICE_SCALE`` (one per device generation beyond the
A100's) and ``STACK_HOST`` (host seconds per block of a stack whose engine does not run
ahead of its kernels) are the fitted constants, on the five runs
``benchmarks/published_runs.py`` marks ``"calibration"`` (one per stack, and a second
generation of one stack) and the one ``benchmarks/published_fresh.py`` marks so
(:mod:`plait.plan.calibration`, which recomputes them); the roofline's other figures are
cited (:mod:`plait.plan.roofline`) but llm-foundry's attention rate
(:data:`plait.plan.stacks.TRITON_SLOWDOWN`, fitted on rows of its tables no validation set
counts). Every other published row is a prediction.

**torch.compile and Float8** (``Software.compiled``, ``float8``): the block's kernels as
:mod:`plait.plan.roofline` prices them (fused memory-bound passes; fp8 GEMMs and their
casts). A recompute repeats what it reruns: ``full`` the whole forward with its casts,
torchtitan's ``selective`` half the GEMMs with their casts, plait's none of them. Float8
on a device without an fp8 peak is refused (:func:`plait.plan.devices.fp8_peak`).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.devices import compute_peak, family, fp8_peak
from plait.plan.models import attention_flops_per_token
from plait.plan.roofline import block_kernels, elementwise_seconds, head_kernels, profile
from plait.plan.schedule import RankLoad
from plait.plan.shards import compute_bytes, microbatch_tokens, rank_params, routed_tp
from plait.plan.spec import DeviceSpec, Layout, ModelSpec, Software, Workload
from plait.plan.stacks import (
    attention_in_graph,
    compiled,
    cp_pass_bytes,
    float8,
    kv_share,
    stack,
)

__all__ = [
    "DEVICE_SCALE",
    "EFFICIENCY",
    "FLAT_EFFICIENCY",
    "STACK_HOST",
    "STACK_SCALE",
    "KernelTimes",
    "device_scale",
    "kernel_times",
    "stack_scale",
]

EFFICIENCY = 0.8498
"""The sustained fraction: every roofline kernel time is divided by it (fitted by
:mod:`plait.plan.calibration` on the published calibration runs; module docstring)."""

STACK_SCALE: dict[str, float] = {
    "torchtitan": 1.0335,
    "megatron-2021": 1.0569,
    "megatron-core": 1.1428,
    "llm-foundry": 0.9366,
}
"""Per software stack (:data:`plait.plan.stacks.STACKS`), the factor its sustained
fraction is of ``EFFICIENCY`` (what its host overheads and kernels the roofline does not
list cost or save), fitted on that stack's one calibration run by
:func:`plait.plan.calibration.calibrate_stacks`; 1 for a stack without one (``plait``)."""

STACK_HOST: dict[str, float] = {"megatron-deepspeed": 0.00424}
"""Per software stack, seconds of host work per block forward that the GPU does not hide
(backward twice, a full recompute once, a selective one half: as kernel launches count);
fitted on that stack's one host run by :func:`plait.plan.calibration.calibrate_host`; 0
for the others, whose host work runs ahead of their kernels. Read when called (so that
the calibration can try values)."""


def stack_scale(name: str) -> float:
    """The fitted scale of stack ``name`` (:data:`STACK_SCALE`), or of the stack whose
    kernels it runs (:attr:`plait.plan.stacks.Stack.scale_of`)."""
    return STACK_SCALE.get(stack(name).scale_of or name, 1.0)


DEVICE_SCALE: dict[str, float] = {"hopper": 0.9399}
"""Per device generation (:func:`device_scale`), the factor its sustained fraction is of the
A100's, at the same software stack: what a generation's kernels hold of the roofline's
figures under a whole training step, which the kernel benchmarks behind
:data:`plait.plan.roofline.PROFILES` do not show (the H100 SXM's clocks under its 700 W cap
through a step of GEMMs, attention and collectives together; launch gaps that a faster
device spends more of its time in). Fitted by :func:`plait.plan.calibration.calibrate_devices`
on the one code base published on both generations in one table (llm-foundry: MPT-13B on 8
A100s fits its stack, MPT-7B on 8 H100s the Hopper scale); 1 for a generation without such a
pair (the B200)."""

#: The generation of each chip family (:func:`plait.plan.devices.family`) with a roofline
#: profile.
GENERATIONS = {"h100": "hopper", "a100": "ampere"}


def device_scale(device: DeviceSpec) -> float:
    """:data:`DEVICE_SCALE` of ``device``'s generation (1 for the A100 and unknown ones)."""
    return DEVICE_SCALE.get(GENERATIONS.get(family(device.name), ""), 1.0)


FLAT_EFFICIENCY = 0.3641
"""Devices without a roofline profile (the ``cpu`` preset, unknown names): the fraction
of the dense peak every FLOP runs at (scaled by ``efficiency / EFFICIENCY``)."""


@dataclass(frozen=True)
class KernelTimes:
    """Compute seconds of one block and of the rank's ends, one microbatch."""

    fwd: float
    bwd: float  # without recomputation
    recompute: float
    # of fwd: the GEMMs after each of TP's four collectives (what async TP hides them
    # behind; roofline.BlockKernels.fused)
    fused: tuple[float, ...]
    attention_fwd: float  # of fwd: attention (what a ring's shifts run beside)
    head_fwd: float
    head_bwd: float


def kernel_times(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    load: RankLoad,
    efficiency: float,
    software: Software,
    kernel_gap: float,
) -> KernelTimes:
    """The roofline's kernel times (:mod:`plait.plan.roofline`) for ``software``'s kernels,
    divided by the sustained fraction ``efficiency``, plus ``kernel_gap`` seconds between
    kernels (:data:`~plait.plan.roofline.KERNEL_GAP`, passed by :mod:`plait.plan.timing`);
    without a profile, FLOPs at one fraction of the peak."""
    if software.float8 != "none":
        fp8_peak(device)  # ValueError naming the fix on a device without fp8
    peak = compute_peak(device, work.precision)
    n, tp = microbatch_tokens(layout, work), layout.tp
    p = rank_params(model, layout, load)
    prof = profile(device)
    if prof is None:
        flat = 1.0 if device.measured else FLAT_EFFICIENCY * efficiency / EFFICIENCY
        rate = peak * flat
        attention = n * attention_flops_per_token(model, work.seq_len) / tp / rate
        forward = n * 2 * p.block_matmul / rate + attention
        recompute = {"none": 0.0, "selective": attention, "full": forward}[layout.ac]
        head = n * 2 * model.vocab * model.d_model / tp / rate if load.head else 0.0
        quarter = (forward - attention) / 4
        return KernelTimes(
            forward, 2 * forward, recompute, (quarter,) * 4, attention, head, 2 * head
        )
    e = compute_bytes(work)
    kernels = stack(software.kernels)
    if software.compiled:
        kernels = compiled(kernels, attention=attention_in_graph(kernels, layout.cp))
    fp8 = float8(device, software, prof.gemm, prof.k_half)
    sp = layout.sequence_parallel and tp > 1
    kinds = []
    if p.dense_blocks:
        kinds.append((p.dense_blocks, False))
    if p.moe_blocks:
        kinds.append((p.moe_blocks, True))
    early = kernels.early_stop if software.ac_early_stop is None else software.ac_early_stop
    kv = kv_share(model, software)
    merges = cp_pass_bytes(kernels, layout.cp_method, layout.cp, kv, software.compiled)
    fwd = bwd = attn = redo = full = 0.0
    fused = [0.0] * 4
    launches = 0.0
    for count, moe in kinds:
        k = block_kernels(
            model,
            tp,
            n,
            work.seq_len,
            layout.cp,
            e,
            moe,
            prof,
            peak,
            kernels,
            sp,
            device.name,
            routed_tp(layout),
            fp8,
            software.tp_overlap == "micro-pipeline" and sp,
            merges,
        )
        share = count / p.blocks
        fwd += share * k.forward
        bwd += share * k.backward
        fused = [a + share * b for a, b in zip(fused, k.fused, strict=True)]
        attn += share * k.attention_fwd
        launches += share * k.launches
        full += share * (k.forward - (k.tail if early else 0.0))
        if kernels.selective == "torchtitan":  # keeps attention and every second matmul
            redo += share * (k.gemm / 2 + k.elementwise + k.cast / 2)
        else:  # plait keeps matmul outputs
            redo += share * (k.attention_fwd + k.elementwise)
    if software.tp_overlap == "micro-pipeline" and sp:
        # A fused matmul + reduce-scatter sums the tp partial outputs in a kernel of its
        # own (read all, write the shard): after the attention's output projection and a
        # dense MLP's output GEMM (comm_time's module docstring).
        dense = p.dense_blocks / p.blocks
        partials = n * model.d_model * e * (1 + 1 / tp)
        reduction = (1 + dense) * elementwise_seconds(partials, prof)
        fwd, full = fwd + reduction, full + reduction
    recompute = {"none": 0.0, "selective": redo, "full": full}[layout.ac]
    gap = kernel_gap * launches  # per forward; backward launches twice as many
    redo_gap = {"none": 0.0, "selective": gap / 2, "full": gap}[layout.ac]
    head_f = head_b = 0.0
    if load.head:
        loss = "fused" if software.compiled_loss else kernels.loss
        head_f, head_b = head_kernels(model, tp, n, e, prof, peak, loss)
    if load.embedding:  # the lookup's rows, and backward's scatter into the gradient
        rows = elementwise_seconds(n * model.d_model * e, prof)
        head_f, head_b = head_f + rows, head_b + 2 * rows
    s = efficiency * stack_scale(software.kernels) * device_scale(device)
    host = STACK_HOST.get(software.kernels, 0.0)
    redo_host = {"none": 0.0, "selective": host / 2, "full": host}[layout.ac]
    return KernelTimes(
        fwd / s + gap + host,
        bwd / s + 2 * (gap + host),
        recompute / s + redo_gap + redo_host,
        tuple(x / s for x in fused),
        attn / s,
        head_f / s,
        head_b / s,
    )
