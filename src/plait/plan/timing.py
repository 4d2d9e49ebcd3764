"""Predicted step time, tokens/s per device and MFU: the cost model.

**Compute.** A rank's FLOPs (its blocks' matrices after tensor parallelism, attention
``4 T d / tp`` per token and block forward, backward twice the forward, the head on the
last stage) run at ``EFFICIENCY x`` the device's dense peak for the compute dtype.
Checkpointing adds its recomputation: ``selective`` recomputes attention (plait keeps only
matmul outputs), ``full`` the whole block forward.

**Communication** (bytes from :mod:`plait.plan.comm`, time = bytes / link bandwidth +
the device's ``latency`` per call), overlapped as plait
overlaps it:

* ``fully_shard`` prefetches: the next block's all-gather runs during the current block's
  compute (forward and backward), its reduce-scatter (and HSDP's all-reduce) during the
  next block's backward. Per block, only what exceeds that block's compute is exposed; the
  first all-gather, the root's and the last reductions are exposed whole.
* ``replicate``: bucketed all-reduces overlap backward the same way, per block.
* tensor parallelism: exposed whole (plait runs torch's TP collectives synchronously, in
  the compute stream; no async TP).
* pipelines: the schedule's makespan from plait's simulator (:mod:`plait.plan.schedule`)
  times the slowest stage's forward plus backward; the stage's all-gather at the start of
  the step and its reductions at the end are exposed (plait gathers a stage once per
  step); each of the ``2 (stages - 1)`` hops of the pipeline's fill and drain exposes one
  send. Where workers outnumber the cores (a measured CPU's ``oversubscription`` above 1,
  its FLOP/s measured with every worker busy), a rank idle in the bubble gives its share of
  the cores to the others: the pipeline then takes the longer of its busiest rank's work
  without a bubble and the makespan run up to ``oversubscription`` times faster.

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
and, per token, its ``top_k`` experts (whole on every tp rank: plait's recipe does not
split routed experts by tp). Its expert-parallel all-to-alls sit between the router and
the experts and between the experts and the residual: nothing runs beside them, so they
are exposed whole, like tensor parallelism's, per MoE block and microbatch: dispatch and
combine in forward, both again in backward, and the forward's in a recompute; each
forward also pays the latency of its row-count exchange and load all-reduce. The experts'
all-gathers and reduce-scatters over ``efsdp`` run beside the block's own over
``dp_shard``, overlapped as those are (their times add up per block).

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
there they are not modelled (small beside the compute of the runs they are meant for).

**Calibration.** ``EFFICIENCY`` is the one fitted constant, from one published run only:
torchtitan's Llama 3.1 8B on 8 H100s, FSDP 8, selective checkpointing, local batch 2,
sequence 8192, 5,762 tokens/s per GPU (``shared/reference/published_runs.md``, table 1; see
:mod:`plait.plan.calibration`, which recomputes it). Every other prediction uses it
unchanged. A ``measured`` device's FLOP/s are already achieved
rates (:mod:`plait.plan.measure` times a block of the model at its shapes on the
machine), so its compute uses them directly: efficiency 1, the calibration does not apply.

Not modelled: kernel efficiency varying with shape (small matrices, short sequences), the
causal mask's saving in attention, communication slowing compute down when overlapped,
collective latency growing with group size, the optimizer step on datasheet presets, data
loading, host overheads (kernel launches, Python) other than ``fully_shard``'s measured
per-unit work, ``torch.compile``, Float8.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.layout import CP, DP_REPLICATE, EFSDP, EP, PP, TP
from plait.plan.comm import (
    Collective,
    all_to_all_bytes,
    communication,
    cp_traffic,
    fsdp_dim,
    link_bandwidth,
    ring,
    tp_bytes_per_block,
)
from plait.plan.devices import compute_peak
from plait.plan.models import attention_flops_per_token, flops_per_token
from plait.plan.schedule import PipelineShape, RankLoad
from plait.plan.shards import compute_bytes, fsdp_ranks, microbatch_tokens, rank_params
from plait.plan.spec import DeviceSpec, Layout, ModelSpec, Workload

__all__ = ["EFFICIENCY", "Timing", "predict_time"]

EFFICIENCY = 0.3641
"""Achievable fraction of the dense peak (calibrated: module docstring)."""


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


def _seconds(nbytes: float, dim: str, layout: Layout, device: DeviceSpec, calls: int) -> float:
    return nbytes / link_bandwidth(dim, layout, device) + calls * device.latency


def _update_seconds(layout: Layout, device: DeviceSpec, elements: float) -> float:
    """The optimizer step (clipping, AdamW) over ``elements`` parameters before sharding,
    and the step's two scalar all-reduces (the gradient norm, the loss); 0 when the device
    has no measured update rate."""
    if not device.update_rate:
        return 0.0
    scalars = 2 * device.latency if layout.world > 1 else 0.0
    return elements / fsdp_ranks(layout) / device.update_rate + scalars


@dataclass(frozen=True)
class _RankTimes:
    block_fwd: float  # one block, one microbatch: compute plus its TP collectives
    block_bwd: float  # backward, recomputation and their TP collectives
    head_fwd: float
    head_bwd: float
    compute: float  # per step, pure compute
    exposed: float  # data-parallel communication not hidden, per step (without a pipeline)
    ends: float  # the data-parallel communication around a pipeline's step
    host: float  # the optimizer step and fully_shard's host work, per step

    def per_microbatch(self, blocks: int) -> float:
        """Forward and backward of ``blocks`` blocks and the rank's head, one microbatch."""
        return blocks * (self.block_fwd + self.block_bwd) + self.head_fwd + self.head_bwd


def _rank_times(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    load: RankLoad,
    efficiency: float,
) -> _RankTimes:
    if device.measured:
        efficiency = 1.0  # measured figures are achieved rates, not datasheet peaks
    rate = compute_peak(device, work.precision) * efficiency
    e = compute_bytes(work)
    m, ds, dr, tp = layout.microbatches, fsdp_ranks(layout), layout.dp_replicate, layout.tp
    n = microbatch_tokens(layout, work)
    p = rank_params(model, layout, load)
    attention = attention_flops_per_token(model, work.seq_len) / tp
    forward = n * (2 * p.block_matmul + attention) / rate
    recompute = {"none": 0.0, "selective": n * attention / rate, "full": forward}[layout.ac]
    t_tp = 0.0
    if tp > 1:
        t_tp = _seconds(tp_bytes_per_block(model, layout, work), TP, layout, device, 4)
    passes = 2 if layout.ac != "none" else 1
    fwd, bwd = forward + t_tp, 2 * forward + recompute + passes * t_tp
    if layout.cp > 1:  # attention's exchange (module docstring)
        cp_fwd, cp_bwd = _cp_exposed(model, layout, work, device, n * attention / rate)
        fwd += cp_fwd
        bwd += cp_bwd + (cp_fwd if layout.ac != "none" else 0.0)
    if p.moe_blocks:  # exposed exchanges of the MoE blocks, spread over the rank's blocks
        share = p.moe_blocks / p.blocks
        one = _seconds(all_to_all_bytes(model, layout, work), EP, layout, device, 0)
        latency = device.latency * ((3 if layout.ep > 1 else 0) + (1 if layout.dp > 1 else 0))
        exchange = 2 * one + latency  # forward: counts, dispatch, combine (and the load)
        back = 2 * one + (2 * device.latency if layout.ep > 1 else 0.0)
        fwd += share * exchange
        bwd += share * (back + (exchange if layout.ac != "none" else 0.0))
    head = n * 2 * model.vocab * model.d_model / tp / rate if load.head else 0.0
    ends = int(load.embedding) + int(load.head)
    head_f, head_b = head + ends * t_tp / 4, 2 * head + ends * t_tp / 4
    compute = m * (load.layers * (3 * forward + recompute) + 3 * head)

    def dp(nbytes: float, dim: str, op: str, group: int) -> float:
        return _seconds(nbytes * ring(op, group), dim, layout, device, 1) if group > 1 else 0.0

    # With ep > 1 the routed experts are a group of their own over efsdp; else they join
    # the block's group over dp_shard.
    eg = layout.efsdp if layout.ep > 1 else ds

    def groups(dense: float, experts: float) -> tuple[float, float]:
        return (dense, experts) if layout.ep > 1 else (dense + experts, 0.0)

    def gather(dense: float, experts: float = 0.0) -> float:
        dense, experts = groups(dense, experts)
        ag = dp(dense * e, fsdp_dim(layout), "all_gather", ds)
        return ag + (dp(experts * e, EFSDP, "all_gather", eg) if experts else 0.0)

    def reduce(dense: float, experts: float = 0.0) -> float:
        # reduce-scatters, then HSDP's / replicate's all-reduce of the shards
        dense, experts = groups(dense, experts)
        rs = dp(dense * 4, fsdp_dim(layout), "reduce_scatter", ds)
        rs += dp(experts * 4, EFSDP, "reduce_scatter", eg) if experts else 0.0
        return rs + dp((dense / ds + experts / eg) * 4, DP_REPLICATE, "all_reduce", dr)

    host = _update_seconds(layout, device, p.total)
    if ds > 1:  # fully_shard's host work per unit (measured devices; else 0)
        host += m * (p.blocks + (1 if p.root else 0)) * device.unit_overhead
    held = (p.sharded_blocks + p.root, p.expert_total)  # gathered: dense part, experts
    if layout.pp > 1:
        around = gather(*held) + reduce(*held)
        return _RankTimes(fwd, bwd, head_f, head_b, compute, 0.0, around, host)
    # Per block, the rank's average one (dense and MoE blocks alike).
    block = (p.sharded_blocks / p.blocks, p.expert_total / p.blocks)
    gather_block = gather(*block)
    gather_root = gather(p.root)
    bwd_gather = gather_block if layout.reshard_after_forward else 0.0
    if not device.overlap:  # communication shares the cores: every second of it adds
        gathers = m * (gather_root + p.blocks * (gather_block + bwd_gather))
        exposed = gathers + p.blocks * reduce(*block) + reduce(p.root)
        return _RankTimes(fwd, bwd, head_f, head_b, compute, exposed, 0.0, host)
    uncovered = max(0.0, gather_block - fwd) * max(p.blocks - 1, 0)  # prefetch longer than compute
    exposed = m * (gather_root + gather_block + uncovered)
    exposed += (m - 1) * p.blocks * max(0.0, bwd_gather - bwd)  # microbatches without sync
    exposed += p.blocks * max(0.0, bwd_gather + reduce(*block) - bwd) + reduce(p.root)
    return _RankTimes(fwd, bwd, head_f, head_b, compute, exposed, 0.0, host)


def predict_time(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    shape: PipelineShape,
    efficiency: float = EFFICIENCY,
) -> Timing:
    """The step time of ``layout`` (module docstring) from its pipeline ``shape``."""
    times = {
        load: _rank_times(model, layout, work, device, load, efficiency) for load in shape.ranks
    }
    m = layout.microbatches
    if layout.pp == 1:
        ((load, t),) = times.items()
        compute, exposed, host = t.compute, t.exposed, t.host
        step = m * t.per_microbatch(load.layers) + exposed + host
    else:
        unit = max(t.per_microbatch(r.stage_layers) for r, t in times.items())
        hop = _microbatch_hop(model, layout, work, device)
        hops = 2 * (layout.pp * layout.stages_per_rank - 1)
        if not device.overlap:  # every send a rank makes takes its cores' time
            hops = max(hops, 2 * m * layout.stages_per_rank)
        exposed = max(t.ends for t in times.values()) + hops * hop
        pipeline = shape.makespan * unit
        share = device.oversubscription
        if share > 1:  # ranks sharing cores fill each other's bubbles (see the docstring)
            busy = max(m * t.per_microbatch(r.layers) for r, t in times.items())
            pipeline = max(busy, pipeline / share)
        host = max(t.host for t in times.values())
        step = pipeline + exposed + host
        compute = max(t.compute for t in times.values())
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
