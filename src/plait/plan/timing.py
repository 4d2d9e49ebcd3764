"""Predicted step time, tokens/s per device and MFU: the cost model.

**Compute** (:mod:`plait.plan.roofline`): each kernel of a block (q, k, v, o and MLP
GEMMs at their tp split and the microbatch's tokens; flash attention, causal, at its share
of the sequence; the eager memory-bound norms, residuals, rotary embeddings and
activations at the HBM bandwidth) and of the head and its loss, priced by the roofline
with a fraction of the peak that depends on the GEMM's shape; backward twice the GEMMs
and the memory-bound passes, flash attention's backward its own. Every kernel time is
divided by ``EFFICIENCY``, the sustained fraction. Checkpointing adds its recomputation:
``selective`` recomputes attention and the memory-bound work (plait keeps only matmul
outputs), ``full`` the whole block forward, less what runs after the block's last saved
tensor where the checkpoint stops early (``Software.ac_early_stop``: the MLP's output
GEMM and the residual addition after it). Devices without a roofline profile (the
``cpu`` preset) run every FLOP at ``FLAT_EFFICIENCY`` of the peak; measured devices at
their measured rates.

**Communication** (bytes from :mod:`plait.plan.comm`, time = bytes / link bandwidth +
the device's ``latency`` per call), overlapped as plait
overlaps it:

* ``fully_shard`` prefetches: the next block's all-gather runs during the current block's
  compute (forward and backward), its reduce-scatter (and HSDP's all-reduce) during the
  next block's backward. Per block, only what exceeds that block's compute is exposed; the
  first all-gather, the root's and the last reductions are exposed whole. They move the
  units' padded buffers (:func:`~plait.plan.shards.padded_params`).
* ``replicate``: bucketed all-reduces overlap backward the same way, per block.
* the root unit (embeddings, final norm, head: one unit in plait's recipe) is gathered at
  each microbatch's start, before anything runs, and reduced after the embedding's
  gradient, the last of backward: both exposed whole.
* collectives whose group spans nodes with ``k`` members in each node run at ``k x`` the
  network's rate per rank, at most NVLink's (NCCL's rings side by side, one per NIC).
* tensor parallelism: ``tp_overlap="none"`` (plait's recipe, the default: torch's TP
  collectives run synchronously in the compute stream) exposes them whole;
  ``"async"`` (Megatron's TP communication overlap, torchtitan's AsyncTP) exposes per
  block only what exceeds the GEMMs they are decomposed into.
* pipelines: each stage's own forward and backward (its blocks; the first stage's
  embedding, the last stage's head and loss), and the makespan from them
  (:func:`~plait.plan.schedule.stage_makespan`: the busiest rank's work plus the uniform
  schedule's fill and drain at the other stages' mean duration). A stage's units are
  gathered right before its first compute and reduced right after its last backward
  (:mod:`plait.pipeline.grad_sync`, blocking): a gather is exposed only beyond the
  forwards of the first microbatch through the stages before it (the rank waits for
  them anyway), a reduction beyond the last microbatch's backwards through them; a
  rank's later local stages count from its previous one. Each of the
  ``2 (stages - 1)`` hops of the fill and drain exposes one send. On a measured CPU, the
  uniform makespan times the slowest stage, as checked against real runs. Where workers
  outnumber the cores (a measured CPU's ``oversubscription`` above 1,
  its FLOP/s measured with every worker busy), a rank idle in the bubble gives its share of
  the cores to the others: the pipeline then takes the longer of its busiest rank's work
  without a bubble and the makespan run up to ``oversubscription`` times faster.

**Interference.** A data-parallel collective that runs beside compute (``fully_shard``'s
gathers and reduce-scatters, ``replicate``'s and ZeRO's reductions, ZeRO's overlapped
parameter gather, a pipeline stage's gathers and reductions) holds
:data:`COLLECTIVE_CTAS` thread blocks, one per NCCL channel, for as long as it runs; the
compute beside it runs on the other SMs. Each step adds ``COLLECTIVE_CTAS / SMs`` of the
time its collectives ran hidden (their total minus what is exposed); a pipeline, of its
busiest rank's. Not applied to tensor parallelism's overlapped collectives (userbuffers
and async TP budget their own SMs) nor on measured devices.

**Context parallelism** (``cp`` ranks per sequence, :mod:`plait.context`): a rank computes
its ``seq_len / cp`` tokens of each of its data-parallel rank's sequences, each attending
to the whole sequence (so attention's FLOPs per rank fall by ``cp`` like the rest; the
causal load balancing makes the ranks' shares equal). Its key/value exchange per block
(:func:`~plait.plan.comm.cp_traffic`), on NVLink while ``cp x tp`` ranks fit a node:

* ``allgather`` and ``alltoall``: exposed whole. The all-gather (its reduce-scatter in
  backward) and the all-to-alls sit between the q, k, v projections and attention, and
  between attention and the output projection: nothing of the block runs beside them.
* ``ring``: overlapped with attention. Each shift starts before the current block's
  attention runs, so per block only what exceeds the attention's compute (forward: the
  forward's; backward: twice that) is exposed, latencies included. That assumes the
  kernels run at the same rate beside the transfers and that no shift waits on one
  another.

Recomputation (``--ac full`` or ``selective``) repeats the forward's exchange. ``fully_shard``
shards over ``dp_shard x cp`` and its collectives have that many ranks.

**Mixture of experts.** A MoE block's compute is its attention, router and shared experts
and, per token, its ``top_k`` experts. The router runs whole on every tp rank; under tensor
parallelism with ``fully_shard`` the routed rows are cut into ``tp`` chunks, one per tp
rank, so a rank runs ``1 / tp`` of the routed experts' rows (whole experts: tp splits rows,
not their matrices; without ``fully_shard`` every tp rank runs all of them:
:func:`~plait.plan.shards.routed_tp`). Its expert-parallel all-to-alls (of its chunk) sit
between the router and the experts and between the experts and the residual: nothing runs
beside them, so they are exposed whole, like tensor parallelism's, per MoE block and
microbatch: dispatch and combine in forward, both again in backward, and the forward's in a
recompute; each forward also pays the latency of its row-count exchange and load all-reduce.
Under tensor parallelism the chunks' outputs are all-gathered over tp (in backward the input
rows' gradients), one all-gather per pass, exposed whole as well. The experts' all-gathers
and reduce-scatters over ``efsdp`` (``efsdp x tp`` under tensor parallelism) run beside the
block's own over ``dp_shard``, overlapped as those are (their times add up per block).

On a device whose communication shares the compute's cores (a measured CPU,
:class:`~plait.plan.spec.DeviceSpec` with ``overlap=False``: gloo's threads run on
the cores that compute), nothing is hidden: every collective's time adds to the compute,
and in a pipeline every send a rank makes (not only the fill and drain's).

**Optimizer step and host work** (measured devices): the rank's parameter elements after
``fully_shard``'s sharding over the measured ``update_rate`` of clipping plus AdamW (a
memory-bound pass over parameters, gradients and both moments), plus the step's two scalar
all-reduces (gradient norm, loss); under ``fully_shard``, the measured ``unit_overhead``
per unit and microbatch (hooks, DTensor parameters, buffer copies: host time that a tiny
model shows when compute and bytes are nothing). Datasheet presets have no such figures:
on roofline devices the AdamW step is memory-bound traffic over the rank's shard
(:data:`~plait.plan.roofline.OPTIMIZER_BYTES`), host work is not modelled beyond the
gaps between kernels (:data:`~plait.plan.roofline.KERNEL_GAP`).

**ZeRO** (a :class:`~plait.plan.spec.PlanLayout` with ``zero``): gradients
reduce-scattered over the ZeRO ranks in buckets beside the last microbatch's backward
(ZeRO-2: every microbatch's), in fp32 or in the compute dtype
(``Software.grad_reduce_fp32``); the updated parameters all-gathered after the optimizer
step, exposed whole, or with ``Software.param_gather_overlap`` block by block beside the
next forward (the first block's gather waits; in a pipeline, beside the stage's first
forward).

**Calibration.** ``EFFICIENCY`` (the shared sustained fraction) and ``STACK_SCALE`` (one
factor per software stack) are the fitted constants, on the four runs
``benchmarks/published_runs.py`` marks ``"calibration"``, one per stack
(:mod:`plait.plan.calibration`, which recomputes them); the roofline's other figures are
cited (:mod:`plait.plan.roofline`). Every other published row is a prediction.

Not modelled: ``torch.compile``'s fusions, communication slowing compute down beyond the
SMs its kernels hold, collective latency growing with group size, data loading, host overheads
(Python) other than the kernel gaps and ``fully_shard``'s measured per-unit work,
Float8.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plait.layout import CP, DP_REPLICATE, EFSDP, EP, PP, TP
from plait.plan.comm import (
    Collective,
    _span,
    all_to_all_bytes,
    communication,
    cp_traffic,
    fsdp_dim,
    link_bandwidth,
    ring,
    tp_bytes_per_block,
    tp_gather_bytes,
)
from plait.plan.devices import compute_peak, streaming_multiprocessors
from plait.plan.models import attention_flops_per_token, flops_per_token
from plait.plan.roofline import (
    BANDWIDTH_FRACTION,
    KERNEL_GAP,
    OPTIMIZER_BYTES,
    block_kernels,
    elementwise_seconds,
    head_kernels,
    profile,
    stack,
)
from plait.plan.schedule import PipelineShape, RankLoad, pipeline_stages, stage_makespan
from plait.plan.shards import (
    compute_bytes,
    expert_fsdp_ranks,
    experts_apart,
    fsdp_ranks,
    microbatch_tokens,
    padded_params,
    rank_params,
    routed_tp,
)
from plait.plan.spec import (
    TP_OVERLAPS,
    ZERO,
    DeviceSpec,
    Layout,
    ModelSpec,
    Software,
    Workload,
    zero_ranks,
    zero_stage,
)

__all__ = [
    "COLLECTIVE_CTAS",
    "EFFICIENCY",
    "FLAT_EFFICIENCY",
    "STACK_SCALE",
    "TP_OVERLAPS",
    "Software",
    "Timing",
    "predict_time",
]

EFFICIENCY = 0.8113
"""The sustained fraction: every roofline kernel time is divided by it (fitted by
:mod:`plait.plan.calibration` on the published calibration runs; module docstring)."""

_PLAIT = Software()  # what plait train runs

STACK_SCALE: dict[str, float] = {
    "torchtitan": 0.8857,
    "megatron-2021": 1.1071,
    "megatron-core": 1.1131,
    "llm-foundry": 0.9589,
}
"""Per software stack (:data:`plait.plan.roofline.STACKS`), the factor its sustained
fraction is of ``EFFICIENCY`` (what its host overheads and kernels the roofline does not
list cost or save), fitted on that stack's one calibration run by
:func:`plait.plan.calibration.calibrate_stacks`; 1 for a stack without one (``plait``)."""

COLLECTIVE_CTAS = 24
"""Thread blocks an NCCL collective holds while it runs (one per channel): an H100 trace
of an all-gather beside a GEMM, as FSDP's prefetch runs them, shows 24 blocks
(NVIDIA developer forum, "Compute-Communication Overlap Causes Severe GEMM Performance
Degradation because of Tail Effect", 2025). While a data-parallel collective runs beside
compute, those SMs are the collective's: compute runs at ``1 - COLLECTIVE_CTAS / SMs`` of
its rate (module docstring, "Interference")."""


def interference(device: DeviceSpec) -> float:
    """Fraction of ``device``'s compute a collective running beside it takes
    (:data:`COLLECTIVE_CTAS` of its streaming multiprocessors; 0 without a roofline)."""
    sms = streaming_multiprocessors(device)
    return min(1.0, COLLECTIVE_CTAS / sms) if sms and device.overlap else 0.0


FLAT_EFFICIENCY = 0.3641
"""Devices without a roofline profile (the ``cpu`` preset, unknown names): the fraction
of the dense peak every FLOP runs at (scaled by ``efficiency / EFFICIENCY``)."""


@dataclass(frozen=True)
class Timing:
    """One step's predicted time and throughput (seconds, tokens/s per device)."""

    step_time: float
    compute: float  # the busiest rank's compute, recomputation included
    exposed_comm: float
    bubble: float  # the pipeline's idle fraction (0 without a pipeline)
    tokens_per_s_per_device: float
    mfu: float
    collectives: tuple[Collective, ...]  # the busiest rank's, per step
    host: float = 0.0  # optimizer step and fully_shard's host work (measured devices only)


def _bandwidth(dim: str, layout: Layout, device: DeviceSpec) -> float:
    """Per rank bandwidth of ``dim``'s collectives. Inside a node NVLink's; across nodes, a
    group with ``k`` members in each node runs ``k`` rings side by side, one per NIC
    (NCCL's channels over rail-optimised networks), each member's NIC carrying ``1 / k``
    of the node-crossing traffic: ``k x`` the network's rate, at most NVLink's."""
    bw = link_bandwidth(dim, layout, device)
    if bw != device.inter_node_bw or dim == PP:
        return bw
    sizes = {EP: layout.ep, EFSDP: expert_fsdp_ranks(layout), "dp_shard_cp": fsdp_ranks(layout)}
    sizes["zero"] = layout.dp_replicate * layout.cp
    size = sizes[dim] if dim in sizes else int(getattr(layout, dim))
    per_node = max(1, device.gpus_per_node * size // max(_span(dim, layout), 1))
    return min(device.intra_node_bw, per_node * device.inter_node_bw)


def _seconds(nbytes: float, dim: str, layout: Layout, device: DeviceSpec, calls: int) -> float:
    return nbytes / _bandwidth(dim, layout, device) + calls * device.latency


def _update_seconds(layout: Layout, device: DeviceSpec, elements: float) -> float:
    """The optimizer step (clipping, AdamW) over ``elements`` parameters before sharding,
    and the step's two scalar all-reduces (the gradient norm, the loss): at the measured
    update rate, or on a roofline device :data:`~plait.plan.roofline.OPTIMIZER_BYTES` per
    element of the rank's shard (``fully_shard``'s or ZeRO's) at the HBM bandwidth; 0
    when the device has neither."""
    scalars = 2 * device.latency if layout.world > 1 else 0.0
    shard = zero_ranks(layout) if zero_stage(layout) else fsdp_ranks(layout)
    if device.update_rate:
        return elements / fsdp_ranks(layout) / device.update_rate + scalars
    prof = profile(device)
    if prof is None:
        return 0.0
    return elements / shard * OPTIMIZER_BYTES / (prof.bandwidth * BANDWIDTH_FRACTION) + scalars


@dataclass(frozen=True)
class _RankTimes:
    block_fwd: float  # one block, one microbatch: compute plus its TP collectives
    block_bwd: float  # backward, recomputation and their TP collectives
    head_fwd: float  # the rank's ends: embedding and / or head (and loss)
    head_bwd: float
    compute: float  # per step, pure compute
    exposed: float  # data-parallel communication not hidden, per step (without a pipeline)
    gather: float  # a pipeline rank's units' all-gathers (once per step)
    reduce: float  # and their reductions
    host: float  # the optimizer step and fully_shard's host work, per step

    def per_microbatch(self, blocks: int) -> float:
        """Forward and backward of ``blocks`` blocks and the rank's ends, one microbatch."""
        return blocks * (self.block_fwd + self.block_bwd) + self.head_fwd + self.head_bwd


@dataclass(frozen=True)
class _Kernels:
    """Compute seconds of one block and of the rank's ends, one microbatch."""

    fwd: float
    bwd: float  # without recomputation
    recompute: float
    gemm_fwd: float  # of fwd: the GEMMs (what async TP hides collectives behind)
    attention_fwd: float  # of fwd: attention (what a ring's shifts run beside)
    head_fwd: float
    head_bwd: float


def _kernels(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    load: RankLoad,
    efficiency: float,
    software: Software = _PLAIT,
) -> _Kernels:
    """The roofline's kernel times (:mod:`plait.plan.roofline`) for ``software``'s kernels,
    divided by the sustained fraction ``efficiency``, plus the gaps between kernels;
    without a profile, FLOPs at one fraction of the peak."""
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
        return _Kernels(
            forward, 2 * forward, recompute, forward - attention, attention, head, 2 * head
        )
    e = compute_bytes(work)
    kernels = stack(software.kernels)
    sp = layout.sequence_parallel and tp > 1
    kinds = []
    if p.dense_blocks:
        kinds.append((p.dense_blocks, False))
    if p.moe_blocks:
        kinds.append((p.moe_blocks, True))
    early = kernels.early_stop if software.ac_early_stop is None else software.ac_early_stop
    fwd = bwd = gemm = attn = redo = full = 0.0
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
        )
        share = count / p.blocks
        fwd += share * k.forward
        bwd += share * k.backward
        gemm += share * k.gemm
        attn += share * k.attention_fwd
        launches += share * k.launches
        full += share * (k.forward - (k.tail if early else 0.0))
        if kernels.selective == "torchtitan":  # keeps attention and every second matmul
            redo += share * (k.gemm / 2 + k.elementwise)
        else:  # plait keeps matmul outputs
            redo += share * (k.attention_fwd + k.elementwise)
    recompute = {"none": 0.0, "selective": redo, "full": full}[layout.ac]
    gap = KERNEL_GAP * launches  # per forward; backward launches twice as many
    redo_gap = {"none": 0.0, "selective": gap / 2, "full": gap}[layout.ac]
    head_f = head_b = 0.0
    if load.head:
        head_f, head_b = head_kernels(model, tp, n, e, prof, peak, kernels.loss)
    if load.embedding:  # the lookup's rows, and backward's scatter into the gradient
        rows = elementwise_seconds(n * model.d_model * e, prof)
        head_f, head_b = head_f + rows, head_b + 2 * rows
    s = efficiency * STACK_SCALE.get(software.kernels, 1.0)
    return _Kernels(
        fwd / s + gap,
        bwd / s + 2 * gap,
        recompute / s + redo_gap,
        gemm / s,
        attn / s,
        head_f / s,
        head_b / s,
    )


def _rank_times(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    load: RankLoad,
    efficiency: float,
    software: Software = _PLAIT,
) -> _RankTimes:
    k = _kernels(model, layout, work, device, load, efficiency, software)
    tp_overlap = software.tp_overlap
    e = compute_bytes(work)
    m, ds, dr, tp = layout.microbatches, fsdp_ranks(layout), layout.dp_replicate, layout.tp
    p = padded_params(model, layout, load)  # fully_shard's padded buffers and shards
    forward, recompute = k.fwd, k.recompute
    t_tp = 0.0
    if tp > 1:
        t_tp = _seconds(tp_bytes_per_block(model, layout, work), TP, layout, device, 4)
    tp_fwd = tp_bwd = t_tp  # exposed per pass
    if tp_overlap == "async" and device.overlap:
        tp_fwd, tp_bwd = max(0.0, t_tp - k.gemm_fwd), max(0.0, t_tp - 2 * k.gemm_fwd)
    passes = tp_fwd if layout.ac != "none" else 0.0
    fwd, bwd = forward + tp_fwd, k.bwd + recompute + tp_bwd + passes
    if layout.cp > 1:  # attention's exchange (module docstring)
        cp_fwd, cp_bwd = _cp_exposed(model, layout, work, device, k.attention_fwd)
        fwd += cp_fwd
        bwd += cp_bwd + (cp_fwd if layout.ac != "none" else 0.0)
    if p.moe_blocks:  # exposed exchanges of the MoE blocks, spread over the rank's blocks
        share = p.moe_blocks / p.blocks
        one = _seconds(all_to_all_bytes(model, layout, work), EP, layout, device, 0)
        latency = device.latency * ((3 if layout.ep > 1 else 0) + (1 if layout.dp > 1 else 0))
        exchange = 2 * one + latency  # forward: counts, dispatch, combine (and the load)
        back = 2 * one + (2 * device.latency if layout.ep > 1 else 0.0)
        if routed_tp(layout) > 1:  # the routed rows' all-gather over tp, one per pass
            gathered = _seconds(tp_gather_bytes(model, layout, work), TP, layout, device, 1)
            exchange, back = exchange + gathered, back + gathered
        fwd += share * exchange
        bwd += share * (back + (exchange if layout.ac != "none" else 0.0))
    ends = int(load.embedding) + int(load.head)
    head_f, head_b = k.head_fwd + ends * tp_fwd / 4, k.head_bwd + ends * tp_bwd / 4
    compute = m * (load.layers * (forward + k.bwd + recompute) + k.head_fwd + k.head_bwd)

    def dp(nbytes: float, dim: str, op: str, group: int) -> float:
        return _seconds(nbytes * ring(op, group), dim, layout, device, 1) if group > 1 else 0.0

    # With ep > 1 (or tp > 1) the routed experts are a group of their own over efsdp (x tp);
    # else they join the block's group over dp_shard.
    apart = experts_apart(layout)
    eg = expert_fsdp_ranks(layout) if apart else ds

    def groups(dense: float, experts: float) -> tuple[float, float]:
        return (dense, experts) if apart else (dense + experts, 0.0)

    def gather(dense: float, experts: float = 0.0) -> float:
        dense, experts = groups(dense, experts)
        ag = dp(dense * e, fsdp_dim(layout), "all_gather", ds)
        return ag + (dp(experts * e, EFSDP, "all_gather", eg) if experts else 0.0)

    z = zero_ranks(layout)
    g = 4 if software.grad_reduce_fp32 else e  # bytes per gradient element reduced

    def reduce(dense: float, experts: float = 0.0) -> float:
        # reduce-scatters, then HSDP's / replicate's all-reduce of the shards (ZeRO: a
        # reduce-scatter over its ranks instead)
        dense, experts = groups(dense, experts)
        rs = dp(dense * g, fsdp_dim(layout), "reduce_scatter", ds)
        rs += dp(experts * g, EFSDP, "reduce_scatter", eg) if experts else 0.0
        shards = (dense / ds + experts / eg) * g
        if zero_stage(layout):
            return rs + dp(shards, ZERO, "reduce_scatter", z)
        return rs + dp(shards, DP_REPLICATE, "all_reduce", dr)

    def zero_gather(dense: float) -> float:
        # ZeRO: the updated parameters all-gathered in the compute dtype after the step
        return dp(dense / ds * e, ZERO, "all_gather", z) if zero_stage(layout) else 0.0

    overlap_params = software.param_gather_overlap and device.overlap

    host = _update_seconds(layout, device, p.total)
    if ds > 1:  # fully_shard's host work per unit (measured devices; else 0)
        host += m * (p.blocks + (1 if p.root else 0)) * device.unit_overhead
    held = (p.sharded_blocks + p.root, p.expert_total)  # gathered: dense part, experts
    if layout.pp > 1:
        # ZeRO's parameter gather: after the step, or beside the stage's first forward
        zg = zero_gather(held[0])
        if overlap_params:
            zg = max(0.0, zg - load.layers * fwd) + zero_gather(held[0] / max(p.blocks, 1))
        return _RankTimes(
            fwd, bwd, head_f, head_b, compute, 0.0, gather(*held) + zg, reduce(*held), host
        )
    # Per block, the rank's average one (dense and MoE blocks alike).
    block = (p.sharded_blocks / p.blocks, p.expert_total / p.blocks)
    gather_block = gather(*block)
    gather_root = gather(p.root)
    bwd_gather = gather_block if layout.reshard_after_forward else 0.0
    if not device.overlap:  # communication shares the cores: every second of it adds
        gathers = m * (gather_root + p.blocks * (gather_block + bwd_gather))
        exposed = gathers + p.blocks * reduce(*block) + reduce(p.root)
        exposed += zero_gather(p.root) + p.blocks * zero_gather(block[0])
        return _RankTimes(fwd, bwd, head_f, head_b, compute, exposed, 0.0, 0.0, host)
    # The root unit (embeddings, final norm, head: one unit in plait's recipe) is gathered
    # at each microbatch's forward start, before anything runs, and reduced after the
    # embedding's gradient, the last of backward: both exposed whole.
    uncovered = max(0.0, gather_block - fwd) * max(p.blocks - 1, 0)  # prefetch longer than compute
    exposed = m * (gather_root + gather_block + uncovered)
    exposed += (m - 1) * p.blocks * max(0.0, bwd_gather - bwd)  # microbatches without sync
    exposed += p.blocks * max(0.0, bwd_gather + reduce(*block) - bwd) + reduce(p.root)
    if zero_stage(layout) == 2:  # ZeRO-2 reduces every microbatch's gradients
        exposed += (m - 1) * p.blocks * max(0.0, reduce(*block) - bwd)
    zg_block, zg_root = zero_gather(block[0]), zero_gather(p.root)
    if overlap_params:  # beside the next forward, block by block: the first one waits
        exposed += zg_root + zg_block + max(0.0, zg_block - fwd) * max(p.blocks - 1, 0)
    else:  # after the optimizer step, before the next forward
        exposed += zg_root + p.blocks * zg_block
    # Interference: what of the collectives runs beside compute slows it down.
    reductions = p.blocks * reduce(*block) * (m if zero_stage(layout) == 2 else 1)
    total = m * (gather_root + p.blocks * (gather_block + bwd_gather)) + reductions
    total += reduce(p.root) + zg_root + p.blocks * zg_block
    exposed += interference(device) * max(0.0, total - exposed)
    return _RankTimes(fwd, bwd, head_f, head_b, compute, exposed, 0.0, 0.0, host)


def predict_time(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    shape: PipelineShape,
    efficiency: float = EFFICIENCY,
    tp_overlap: str | None = None,
    software: Software | None = None,
) -> Timing:
    """The step time of ``layout`` (module docstring) from its pipeline ``shape``;
    ``efficiency``: the sustained fraction (the calibrated one by default);
    ``software``: the framework's kernels and overlaps (plait's by default);
    ``tp_overlap``: one of :data:`TP_OVERLAPS`, replacing ``software``'s."""
    sw = software or Software()
    if tp_overlap is not None:
        if tp_overlap not in TP_OVERLAPS:
            raise ValueError(f"tp_overlap must be one of {TP_OVERLAPS}, got {tp_overlap!r}")
        sw = dataclasses.replace(sw, tp_overlap=tp_overlap)
    m = layout.microbatches
    if layout.pp == 1:
        ((load,),) = (shape.ranks,)
        t = _rank_times(model, layout, work, device, load, efficiency, sw)
        compute, exposed, host = t.compute, t.exposed, t.host
        step = m * t.per_microbatch(load.layers) + exposed + host
    elif device.measured:
        step, compute, exposed, host = _measured_pipeline(
            model, layout, work, device, shape, efficiency
        )
    else:
        step, compute, exposed, host = _pipeline(model, layout, work, device, shape, efficiency, sw)
    tokens = work.global_batch * work.seq_len / step / layout.world
    peak = compute_peak(device, work.precision)
    busiest = max(shape.ranks, key=lambda r: (r.layers, r.head))
    return Timing(
        step_time=step,
        compute=compute,
        exposed_comm=exposed,
        bubble=shape.bubble,
        tokens_per_s_per_device=tokens,
        mfu=flops_per_token(model, work.seq_len) * tokens / peak,
        collectives=tuple(communication(model, layout, work, device, busiest)),
        host=host,
    )


def _pipeline(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    shape: PipelineShape,
    efficiency: float,
    software: Software,
) -> tuple[float, float, float, float]:
    """A pipeline's step, compute, exposed communication and host time from each stage's
    own duration (module docstring): step = makespan of the per-stage durations
    (:func:`plait.plan.schedule.stage_makespan`) + the data-parallel gathers and
    reductions the schedule does not hide + the fill and drain's sends + host work."""
    m, pp, v = layout.microbatches, layout.pp, layout.stages_per_rank
    stages = pipeline_stages(model.layers, pp, layout.schedule, v)
    cache: dict[tuple[int, int, bool, bool], _RankTimes] = {}
    times = []
    for s, (size, rank) in enumerate(stages):
        key = (size, rank if model.experts else 0, s == 0, s == len(stages) - 1)
        if key not in cache:
            load = RankLoad(rank, size, size, key[2], key[3], 1, 1)
            cache[key] = _rank_times(model, layout, work, device, load, efficiency, software)
        times.append(cache[key])
    fwd = [size * t.block_fwd + t.head_fwd for (size, _), t in zip(stages, times, strict=True)]
    bwd = [size * t.block_bwd + t.head_bwd for (size, _), t in zip(stages, times, strict=True)]
    durations = [f + b for f, b in zip(fwd, bwd, strict=True)]
    owners = tuple(rank for _, rank in stages)
    pipeline = stage_makespan(tuple(durations), owners, pp, m, shape.makespan)
    # Data parallelism inside stages (plait.pipeline.grad_sync): a stage's units are
    # gathered right before its first compute and reduced right after its last backward,
    # both blocking. Each hides behind the time the rank would wait anyway: a gather behind
    # the first microbatch's forwards through the earlier stages (the fill), a reduction
    # behind the last microbatch's backwards through them (the drain), counted from the
    # rank's previous local stage for its later ones.
    start = end = 0.0
    for rank in range(pp):
        mine = [s for s, o in enumerate(owners) if o == rank]
        late_start = late_end = 0.0
        previous = -1
        for s in mine:
            slack_f = sum(fwd[previous + 1 : s])
            slack_b = sum(bwd[previous + 1 : s])
            late_start += max(0.0, times[s].gather - slack_f)
            late_end = max(late_end, times[s].reduce - slack_b)
            previous = s
        start, end = max(start, late_start), max(end, late_end)
    hop = _microbatch_hop(model, layout, work, device)
    exposed = start + end + 2 * (pp * v - 1) * hop
    # Interference: the busiest rank's gathers and reductions beyond what is exposed ran
    # beside compute and slowed it down.
    busy = max(
        sum(times[s].gather + times[s].reduce for s in range(len(stages)) if owners[s] == r)
        for r in range(pp)
    )
    exposed += interference(device) * max(0.0, busy - start - end)
    compute = max(sum(t.compute for s, t in enumerate(times) if owners[s] == r) for r in range(pp))
    host = max(t.host for t in times) * v
    return pipeline + exposed + host, compute, exposed, host


def _measured_pipeline(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    shape: PipelineShape,
    efficiency: float,
) -> tuple[float, float, float, float]:
    """A pipeline on a measured CPU: the uniform-stage makespan times the slowest stage
    (as checked against real CPU runs by ``benchmarks/plan_check.py``), every send a rank
    makes exposed, ranks sharing cores filling each other's bubbles."""
    m = layout.microbatches
    times = {
        load: _rank_times(model, layout, work, device, load, efficiency) for load in shape.ranks
    }
    unit = max(t.per_microbatch(r.stage_layers) for r, t in times.items())
    hop = _microbatch_hop(model, layout, work, device)
    hops = 2 * (layout.pp * layout.stages_per_rank - 1)
    if not device.overlap:  # every send a rank makes takes its cores' time
        hops = max(hops, 2 * m * layout.stages_per_rank)
    exposed = max(t.gather + t.reduce for t in times.values()) + hops * hop
    pipeline = shape.makespan * unit
    share = device.oversubscription
    if share > 1:  # ranks sharing cores fill each other's bubbles (see the docstring)
        busy = max(m * t.per_microbatch(r.layers) for r, t in times.items())
        pipeline = max(busy, pipeline / share)
    host = max(t.host for t in times.values())
    compute = max(t.compute for t in times.values())
    return pipeline + exposed + host, compute, exposed, host


def _cp_exposed(
    model: ModelSpec, layout: Layout, work: Workload, device: DeviceSpec, attention: float
) -> tuple[float, float]:
    """Seconds context parallelism's exchange adds to one block's forward and backward for
    one microbatch (module docstring); ``attention``: the forward's attention compute,
    which a ring's shifts run beside (the backward's is twice that)."""
    t = cp_traffic(model, layout, work)
    fwd = _seconds(t.forward, CP, layout, device, t.forward_calls)
    bwd = _seconds(t.backward, CP, layout, device, t.backward_calls)
    if layout.cp_method == "ring" and device.overlap:
        return max(0.0, fwd - attention), max(0.0, bwd - 2 * attention)
    return fwd, bwd


def _microbatch_hop(model: ModelSpec, layout: Layout, work: Workload, device: DeviceSpec) -> float:
    """Seconds to send one microbatch's activation to the next pipeline stage."""
    sp = layout.tp if layout.sequence_parallel else 1
    n = microbatch_tokens(layout, work)
    e = compute_bytes(work)
    return _seconds(n * model.d_model / sp * e, PP, layout, device, 1)
