"""Predicted step time, tokens/s per device and MFU: the cost model.

A step is each rank's compute (:mod:`plait.plan.compute_time`: the roofline's kernels at
the calibrated ``EFFICIENCY``), the exchanges inside its blocks that nothing hides
(:mod:`plait.plan.comm_time`: tensor, context and expert parallelism's), its
data-parallel collectives less what its compute hides and its host work
(:mod:`plait.plan.rank_time`), and under a pipeline the makespan of its stages with the
bubble (:mod:`plait.plan.pipeline_time`). Each module's docstring gives its part of the
model; this one applies the constants they share (:data:`COLLECTIVE_CTAS`,
:data:`~plait.plan.roofline.KERNEL_GAP`) and composes them.

**Interference.** A data-parallel collective that runs beside compute (``fully_shard``'s
gathers and reduce-scatters, ``replicate``'s and ZeRO's reductions, ZeRO's overlapped
parameter gather, a pipeline stage's gathers and reductions) holds
:data:`COLLECTIVE_CTAS` thread blocks, one per NCCL channel, for as long as it runs; the
compute beside it runs on the other SMs. Each step adds ``COLLECTIVE_CTAS / SMs`` of the
time its collectives ran hidden (their total minus what is exposed); a pipeline, of its
busiest rank's; context parallelism's exchanges, of what of them attention hides
(:func:`plait.plan.comm_time.cp_exposed`). Not applied to tensor parallelism's overlapped
collectives (userbuffers and async TP budget their own SMs) nor on measured devices.

Not modelled: ``torch.compile``'s fusions, communication slowing compute down beyond the
SMs its kernels hold, collective latency growing with group size, data loading, host overheads
(Python) other than the kernel gaps and ``fully_shard``'s measured per-unit work,
Float8.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from plait.plan.comm import Collective, communication
from plait.plan.compute_time import EFFICIENCY, FLAT_EFFICIENCY, STACK_SCALE, kernel_times
from plait.plan.devices import compute_peak, streaming_multiprocessors
from plait.plan.models import flops_per_token
from plait.plan.pipeline_time import measured_pipeline_step, pipeline_step
from plait.plan.rank_time import RankTimes, rank_times
from plait.plan.roofline import KERNEL_GAP
from plait.plan.schedule import PipelineShape, RankLoad
from plait.plan.spec import TP_OVERLAPS, DeviceSpec, Layout, ModelSpec, Software, Workload

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

_PLAIT = Software()  # what plait train runs

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


def _rank_times(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    load: RankLoad,
    efficiency: float,
    software: Software = _PLAIT,
) -> RankTimes:
    """Pipeline rank ``load``'s times (:mod:`plait.plan.rank_time`) from its kernels'
    (:mod:`plait.plan.compute_time`), with this module's :data:`KERNEL_GAP` and
    :func:`interference`: read when called, so that both can be changed here."""
    kernels = kernel_times(model, layout, work, device, load, efficiency, software, KERNEL_GAP)
    return rank_times(model, layout, work, device, load, kernels, interference(device), software)


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
    step, compute, exposed, host = _step(model, layout, work, device, shape, efficiency, sw)
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
        collectives=tuple(communication(model, layout, work, device, busiest, sw)),
        host=host,
    )


def _step(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    shape: PipelineShape,
    efficiency: float,
    software: Software,
) -> tuple[float, float, float, float]:
    """The step's seconds, its compute, exposed communication and host work: the one
    rank's without a pipeline, else the pipeline's from its stages' times."""
    if layout.pp == 1:
        ((load,),) = (shape.ranks,)
        t = _rank_times(model, layout, work, device, load, efficiency, software)
        step = layout.microbatches * t.per_microbatch(load.layers) + t.exposed + t.host
        return step, t.compute, t.exposed, t.host
    if device.measured:  # a measured CPU runs plait train: plait's software
        plaits = functools.partial(_rank_times, model, layout, work, device, efficiency=efficiency)
        return measured_pipeline_step(model, layout, work, device, shape, plaits)
    times_of = functools.partial(
        _rank_times, model, layout, work, device, efficiency=efficiency, software=software
    )
    return pipeline_step(model, layout, work, device, shape, times_of, interference(device))
