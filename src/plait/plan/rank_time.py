"""One rank's times for one step: its blocks' forward and backward per microbatch with the
exchanges nothing hides (:mod:`plait.plan.comm_time`), its compute, its data-parallel
collectives and how much of them its compute hides, and its host work
(:mod:`plait.plan.timing` composes them into the step).

**Data parallelism**, overlapped as plait overlaps it:

* ``fully_shard`` prefetches: the next block's all-gather runs during the current block's
  compute (forward and backward), its reduce-scatter (and HSDP's all-reduce) during the
  next block's backward. Per block, only what exceeds that block's compute is exposed; the
  first all-gather, the root's and the last reductions are exposed whole. They move the
  units' padded buffers (:func:`~plait.plan.shards.padded_params`); with
  ``Software.float8_all_gather`` the blocks' (not the root's, nor routed experts') in fp8,
  1 byte per parameter (:mod:`plait.plan.comm`).
* ``replicate``: bucketed all-reduces overlap backward the same way, per block.
* the root unit (embeddings, final norm, head: one unit in plait's recipe) is gathered at
  each microbatch's start, before anything runs, and reduced after the embedding's
  gradient, the last of backward: both exposed whole.
* a mixture of experts' all-gathers and reduce-scatters over ``efsdp`` (``efsdp x tp``
  under tensor parallelism) run beside the block's own over ``dp_shard``, overlapped as
  those are (their times add up per block).
* under a pipeline, a rank's units are gathered and reduced once per step: their times
  go to :mod:`plait.plan.pipeline_time`, which knows what the schedule hides them behind.

The collectives that run beside compute slow it down (``contention``: the fraction of the
compute they take, :func:`plait.plan.timing.interference`): each step adds that fraction
of the time they ran hidden.

On a device whose communication shares the compute's cores (a measured CPU,
:class:`~plait.plan.spec.DeviceSpec` with ``overlap=False``: gloo's threads run on
the cores that compute), nothing is hidden: every collective's time adds to the compute.

**Optimizer step and host work** (measured devices): the rank's parameter elements after
``fully_shard``'s sharding over the measured ``update_rate`` of clipping plus AdamW (a
memory-bound pass over parameters, gradients and both moments), plus the step's two scalar
all-reduces (gradient norm, loss); under ``fully_shard``, the measured ``unit_overhead``
per unit and microbatch (hooks, DTensor parameters, buffer copies: host time that a tiny
model shows when compute and bytes are nothing), under a pipeline per unit once per step
(plait's schedules gather and reduce each stage once: ``add_fsdp_actions``; charged per
microbatch, pp 2 x dp_shard 2 on 4 CPU workers was predicted 46-58% slower than measured,
once per step -16% to +3%: ``benchmarks/plan_calibrate.py``, medians over repeats).
Datasheet presets have no such figures:
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
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.layout import DP_REPLICATE, EFSDP
from plait.plan.comm import fsdp_dim, ring
from plait.plan.comm_time import cp_exposed, link_seconds, moe_exchanges, tp_exposed
from plait.plan.compute_time import KernelTimes
from plait.plan.roofline import BANDWIDTH_FRACTION, OPTIMIZER_BYTES, profile
from plait.plan.schedule import RankLoad, layout_gathers
from plait.plan.shards import (
    RankParams,
    compute_bytes,
    expert_fsdp_ranks,
    experts_apart,
    fsdp_ranks,
    padded_params,
)
from plait.plan.spec import (
    ZERO,
    DeviceSpec,
    Layout,
    ModelSpec,
    Software,
    Workload,
    zero_ranks,
    zero_stage,
)
from plait.plan.stacks import stack

__all__ = ["RankTimes", "rank_times"]


@dataclass(frozen=True)
class RankTimes:
    """One rank's seconds (module docstring)."""

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
class _Passes:
    """One block's forward and backward and the rank's ends, one microbatch: compute and
    the exchanges nothing hides."""

    fwd: float
    bwd: float
    head_fwd: float
    head_bwd: float


def _passes(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    k: KernelTimes,
    params: RankParams,
    ends: int,
    software: Software,
    contention: float,
) -> _Passes:
    """``k``'s compute plus tensor, context and expert parallelism's exposed exchanges
    (:mod:`plait.plan.comm_time`), a checkpoint's recompute repeating the forward's;
    ``ends``: how many of the embedding and the head the rank holds; ``contention``: the
    fraction of the attention a context-parallel exchange beside it takes."""
    recomputing = layout.ac != "none"
    # torchtitan's selective checkpointing saves the reduce-scatters' outputs
    # (torchtitan/distributed/activation_checkpoint.py, since April 2024): its recompute
    # repeats TP's all-gathers only. (It saves all-to-alls too, since 2025; the MoE
    # exchanges below are repeated whole, their tp gather with them.)
    keeps_reductions = (
        layout.ac == "selective" and stack(software.kernels).selective == "torchtitan"
    )
    tp_fwd, tp_bwd, tp_gathers = tp_exposed(
        model, layout, work, device, k.fused, software.tp_overlap, software.float8_tp_gather
    )
    passes = 0.0 if not recomputing else tp_gathers if keeps_reductions else tp_fwd
    fwd, bwd = k.fwd + tp_fwd, k.bwd + k.recompute + tp_bwd + passes
    if layout.cp > 1:  # attention's exchange
        cp_fwd, cp_bwd = cp_exposed(
            model, layout, work, device, k.attention_fwd, software, contention
        )
        fwd += cp_fwd
        bwd += cp_bwd + (cp_fwd if recomputing else 0.0)
    if params.moe_blocks:  # exposed exchanges of the MoE blocks, spread over the rank's blocks
        share = params.moe_blocks / params.blocks
        exchange, back = moe_exchanges(model, layout, work, device, software.ep_inner)
        fwd += share * exchange
        bwd += share * (back + (exchange if recomputing else 0.0))
    head_f, head_b = k.head_fwd + ends * tp_fwd / 4, k.head_bwd + ends * tp_bwd / 4
    return _Passes(fwd, bwd, head_f, head_b)


@dataclass(frozen=True)
class _DataParallel:
    """Seconds of the rank's data-parallel collectives for given elements: the gathers and
    reductions of ``fully_shard`` (the routed experts' over ``efsdp`` when ``apart``),
    HSDP's and ``replicate``'s all-reduces, ZeRO's reduce-scatters and gathers."""

    layout: Layout
    device: DeviceSpec
    e: int  # bytes per parameter element gathered (the compute dtype)
    g: int  # bytes per gradient element reduced
    ds: int  # fully_shard's ranks
    eg: int  # the routed experts' fully_shard ranks
    apart: bool  # whether the routed experts are a group of their own
    z: int  # ZeRO's ranks
    zero: int  # ZeRO's stage (0: none)
    block_e: float = 0.0  # bytes per block parameter gathered where not ``e`` (fp8: 1)

    def _dp(self, nbytes: float, dim: str, op: str, group: int) -> float:
        if group <= 1:
            return 0.0
        return link_seconds(nbytes * ring(op, group), dim, self.layout, self.device, 1)

    def _groups(self, dense: float, experts: float) -> tuple[float, float]:
        return (dense, experts) if self.apart else (dense + experts, 0.0)

    def gather(self, dense: float, experts: float = 0.0, root: float = 0.0) -> float:
        """``fully_shard``'s all-gathers of ``dense`` block and ``experts`` elements (and
        ``root`` elements, in the compute dtype, gathered with the blocks in one call)."""
        if self.block_e:  # the blocks' weights in fp8; the root and experts as they are
            mixed = dense * self.block_e + (root + (0.0 if self.apart else experts)) * self.e
            ag = self._dp(mixed, fsdp_dim(self.layout), "all_gather", self.ds)
            if self.apart and experts:
                ag += self._dp(experts * self.e, EFSDP, "all_gather", self.eg)
            return ag
        dense, experts = self._groups(dense + root, experts)
        ag = self._dp(dense * self.e, fsdp_dim(self.layout), "all_gather", self.ds)
        return ag + (self._dp(experts * self.e, EFSDP, "all_gather", self.eg) if experts else 0.0)

    def reduce(self, dense: float, experts: float = 0.0) -> float:
        """The reduce-scatters, then HSDP's / replicate's all-reduce of the shards (ZeRO: a
        reduce-scatter over its ranks instead)."""
        dense, experts = self._groups(dense, experts)
        g = self.g
        rs = self._dp(dense * g, fsdp_dim(self.layout), "reduce_scatter", self.ds)
        rs += self._dp(experts * g, EFSDP, "reduce_scatter", self.eg) if experts else 0.0
        shards = (dense / self.ds + experts / self.eg) * g
        if self.zero:
            return rs + self._dp(shards, ZERO, "reduce_scatter", self.z)
        return rs + self._dp(shards, DP_REPLICATE, "all_reduce", self.layout.dp_replicate)

    def zero_gather(self, dense: float) -> float:
        """ZeRO: the updated parameters all-gathered in the compute dtype after the step."""
        if not self.zero:
            return 0.0
        return self._dp(dense / self.ds * self.e, ZERO, "all_gather", self.z)


def _data_parallel(
    layout: Layout, device: DeviceSpec, work: Workload, software: Software
) -> _DataParallel:
    e, ds = compute_bytes(work), fsdp_ranks(layout)
    g = 4 if software.grad_reduce_fp32 else e  # bytes per gradient element reduced
    # With ep > 1 (or tp > 1) the routed experts are a group of their own over efsdp (x tp);
    # else they join the block's group over dp_shard.
    apart = experts_apart(layout)
    eg = expert_fsdp_ranks(layout) if apart else ds
    block_e = 1.0 if software.float8_all_gather else 0.0
    return _DataParallel(
        layout, device, e, g, ds, eg, apart, zero_ranks(layout), zero_stage(layout), block_e
    )


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


def _host_seconds(layout: Layout, device: DeviceSpec, p: RankParams) -> float:
    """The optimizer step, and ``fully_shard``'s host work per unit (measured devices;
    else 0): per microbatch, but under a pipeline once per gather of a stage, as plait's
    schedules gather and reduce each stage (``add_fsdp_actions``: once per step without
    ``max_active_stages``)."""
    host = _update_seconds(layout, device, p.total)
    if fsdp_ranks(layout) > 1:
        passes = layout_gathers(layout) if layout.pp > 1 else layout.microbatches
        host += passes * (p.blocks + (1 if p.root else 0)) * device.unit_overhead
    return host


def _stage_sync(
    dp: _DataParallel, p: RankParams, load: RankLoad, fwd: float, overlap_params: bool
) -> tuple[float, float]:
    """A pipeline rank's gathers (ZeRO's parameter gather included: after the step, or
    beside the stage's first forward) and reductions, once per step."""
    held = (p.sharded_blocks + p.root, p.expert_total)  # gathered: dense part, experts
    zg = dp.zero_gather(held[0])
    if overlap_params:
        zg = max(0.0, zg - load.layers * fwd) + dp.zero_gather(held[0] / max(p.blocks, 1))
    gathered = dp.gather(p.sharded_blocks, p.expert_total, root=p.root)
    return gathered + zg, dp.reduce(*held)


def _serial_exposed(dp: _DataParallel, p: RankParams, m: int, reshard: bool) -> float:
    """Communication sharing the compute's cores: every second of it adds."""
    block = (p.sharded_blocks / p.blocks, p.expert_total / p.blocks)
    gather_block, gather_root = dp.gather(*block), dp.gather(0.0, root=p.root)
    bwd_gather = gather_block if reshard else 0.0
    gathers = m * (gather_root + p.blocks * (gather_block + bwd_gather))
    exposed = gathers + p.blocks * dp.reduce(*block) + dp.reduce(p.root)
    exposed += dp.zero_gather(p.root) + p.blocks * dp.zero_gather(block[0])
    return exposed


def _overlapped_exposed(
    dp: _DataParallel,
    p: RankParams,
    passes: _Passes,
    layout: Layout,
    overlap_params: bool,
    contention: float,
) -> float:
    """What of the collectives the blocks' compute does not hide (module docstring), plus
    ``contention`` of what it does."""
    m, fwd, bwd = layout.microbatches, passes.fwd, passes.bwd
    # Per block, the rank's average one (dense and MoE blocks alike).
    block = (p.sharded_blocks / p.blocks, p.expert_total / p.blocks)
    gather_block, gather_root = dp.gather(*block), dp.gather(0.0, root=p.root)
    bwd_gather = gather_block if layout.reshard_after_forward else 0.0
    # The root unit (embeddings, final norm, head: one unit in plait's recipe) is gathered
    # at each microbatch's forward start, before anything runs, and reduced after the
    # embedding's gradient, the last of backward: both exposed whole.
    uncovered = max(0.0, gather_block - fwd) * max(p.blocks - 1, 0)  # prefetch longer than compute
    exposed = m * (gather_root + gather_block + uncovered)
    exposed += (m - 1) * p.blocks * max(0.0, bwd_gather - bwd)  # microbatches without sync
    exposed += p.blocks * max(0.0, bwd_gather + dp.reduce(*block) - bwd) + dp.reduce(p.root)
    if dp.zero == 2:  # ZeRO-2 reduces every microbatch's gradients
        exposed += (m - 1) * p.blocks * max(0.0, dp.reduce(*block) - bwd)
    zg_block, zg_root = dp.zero_gather(block[0]), dp.zero_gather(p.root)
    if overlap_params:  # beside the next forward, block by block: the first one waits
        exposed += zg_root + zg_block + max(0.0, zg_block - fwd) * max(p.blocks - 1, 0)
    else:  # after the optimizer step, before the next forward
        exposed += zg_root + p.blocks * zg_block
    # Interference: what of the collectives runs beside compute slows it down.
    reductions = p.blocks * dp.reduce(*block) * (m if dp.zero == 2 else 1)
    total = m * (gather_root + p.blocks * (gather_block + bwd_gather)) + reductions
    total += dp.reduce(p.root) + zg_root + p.blocks * zg_block
    exposed += contention * max(0.0, total - exposed)
    return exposed


def rank_times(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    load: RankLoad,
    kernels: KernelTimes,
    contention: float,
    software: Software,
) -> RankTimes:
    """Pipeline rank ``load``'s times (module docstring) from its ``kernels``' compute;
    ``contention``: the fraction of compute a collective beside it takes."""
    k, m = kernels, layout.microbatches
    p = padded_params(model, layout, load)  # fully_shard's padded buffers and shards
    ends = int(load.embedding) + int(load.head)
    passes = _passes(model, layout, work, device, k, p, ends, software, contention)
    fwd, bwd, head_f, head_b = passes.fwd, passes.bwd, passes.head_fwd, passes.head_bwd
    compute = m * (load.layers * (k.fwd + k.bwd + k.recompute) + k.head_fwd + k.head_bwd)
    dp = _data_parallel(layout, device, work, software)
    overlap_params = software.param_gather_overlap and device.overlap
    host = _host_seconds(layout, device, p)
    if layout.pp > 1:
        gather, reduce = _stage_sync(dp, p, load, fwd, overlap_params)
        return RankTimes(fwd, bwd, head_f, head_b, compute, 0.0, gather, reduce, host)
    if not device.overlap:  # communication shares the cores: every second of it adds
        exposed = _serial_exposed(dp, p, m, layout.reshard_after_forward)
    else:
        exposed = _overlapped_exposed(dp, p, passes, layout, overlap_params, contention)
    return RankTimes(fwd, bwd, head_f, head_b, compute, exposed, 0.0, 0.0, host)
