"""A pipeline's step from its stages' times (:mod:`plait.plan.timing`): each stage's own
forward and backward (its blocks; the first stage's embedding, the last stage's head and
loss, :mod:`plait.plan.rank_time`), and the makespan from them
(:func:`~plait.plan.schedule.stage_makespan`: the busiest rank's work plus the uniform
schedule's fill and drain at the other stages' mean duration).

A stage's units are gathered right before its first compute and reduced right after its
last backward (:mod:`plait.pipeline.grad_sync`, blocking): a gather is exposed only beyond
the forwards of the first microbatch through the stages before it (the rank waits for
them anyway), a reduction beyond the last microbatch's backwards through them; a rank's
later local stages count from its previous one. Each of the ``2 (stages - 1)`` hops of
the fill and drain exposes one send. The collectives that ran hidden slow the compute
beside them down (``contention``, :func:`plait.plan.timing.interference`): the busiest
rank's.

With ``max_active_stages`` a stage is gathered again each time it comes back into the
rank's window (:func:`~plait.plan.schedule.layout_gathers` times per step). Those gathers
are issued at their UNSHARD, ahead of the compute that awaits them: with a window of one
stage right before it, so each is exposed whole; with more, one action ahead, so each is
exposed beyond one microbatch's forward through a stage.

On a measured CPU, the uniform makespan times the slowest stage, as checked against real
runs, and every send a rank makes is exposed where communication shares the compute's
cores. Where workers outnumber the cores (a measured CPU's ``oversubscription`` above 1,
its FLOP/s measured with every worker busy), a rank idle in the bubble gives its share of
the cores to the others: the pipeline then takes the longer of its busiest rank's work
without a bubble and the makespan run up to ``oversubscription`` times faster.
"""

from __future__ import annotations

from collections.abc import Callable

from plait.plan.comm_time import microbatch_hop
from plait.plan.rank_time import RankTimes
from plait.plan.schedule import (
    PipelineShape,
    RankLoad,
    layout_gathers,
    pipeline_stages,
    stage_makespan,
)
from plait.plan.spec import DeviceSpec, Layout, ModelSpec, Workload

__all__ = ["measured_pipeline_step", "pipeline_step"]


def pipeline_step(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    shape: PipelineShape,
    times_of: Callable[[RankLoad], RankTimes],
    contention: float,
) -> tuple[float, float, float, float]:
    """A pipeline's step, compute, exposed communication and host time from each stage's
    own duration (module docstring): step = makespan of the per-stage durations
    (:func:`plait.plan.schedule.stage_makespan`) + the data-parallel gathers and
    reductions the schedule does not hide + the fill and drain's sends + host work.
    ``times_of``: a rank's times for a load; ``contention``: the fraction of compute a
    collective beside it takes."""
    m, pp, v = layout.microbatches, layout.pp, layout.stages_per_rank
    stages = pipeline_stages(model.layers, pp, layout.schedule, v, layout.end_blocks)
    times = _stage_times(stages, times_of)
    fwd = [size * t.block_fwd + t.head_fwd for (size, _), t in zip(stages, times, strict=True)]
    bwd = [size * t.block_bwd + t.head_bwd for (size, _), t in zip(stages, times, strict=True)]
    durations = [f + b for f, b in zip(fwd, bwd, strict=True)]
    owners = tuple(rank for _, rank in stages)
    pipeline = stage_makespan(tuple(durations), owners, pp, m, shape.makespan)
    start, end = _exposed_sync(times, fwd, bwd, owners, pp)
    again = layout_gathers(layout) - 1  # each stage's gathers beyond its first, per step
    ahead = layout.max_active_stages > 1  # issued one action early (module docstring)
    regather = (
        max(
            sum(
                again * max(0.0, times[s].gather - (fwd[s] if ahead else 0.0))
                for s in range(len(stages))
                if owners[s] == r
            )
            for r in range(pp)
        )
        if again
        else 0.0
    )
    hop = microbatch_hop(model, layout, work, device)
    exposed = start + end + regather + 2 * (pp * v - 1) * hop
    # Interference: the busiest rank's gathers and reductions beyond what is exposed ran
    # beside compute and slowed it down.
    busy = max(
        sum(
            (1 + again) * times[s].gather + times[s].reduce
            for s in range(len(stages))
            if owners[s] == r
        )
        for r in range(pp)
    )
    busy -= regather
    exposed += contention * max(0.0, busy - start - end)
    compute = max(sum(t.compute for s, t in enumerate(times) if owners[s] == r) for r in range(pp))
    host = max(t.host for t in times) * v
    return pipeline + exposed + host, compute, exposed, host


def _stage_times(
    stages: tuple[tuple[int, int], ...], times_of: Callable[[RankLoad], RankTimes]
) -> list[RankTimes]:
    """Each stage's times (of one stage of its size: its blocks, and the embedding or the
    head at the ends), computed once per kind of stage: its size and whether it is the
    first or the last (a MoE model's dense blocks are the first stage's:
    :mod:`plait.plan.shards`), whichever rank holds it."""
    cache: dict[tuple[int, bool, bool], RankTimes] = {}
    times = []
    for s, (size, rank) in enumerate(stages):
        key = (size, s == 0, s == len(stages) - 1)
        if key not in cache:
            cache[key] = times_of(RankLoad(rank, size, size, key[1], key[2], 1, 1))
        times.append(cache[key])
    return times


def _exposed_sync(
    times: list[RankTimes],
    fwd: list[float],
    bwd: list[float],
    owners: tuple[int, ...],
    pp: int,
) -> tuple[float, float]:
    """The stages' gathers and reductions exposed at the step's start and end (module
    docstring), the most of any rank."""
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
    return start, end


def measured_pipeline_step(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    shape: PipelineShape,
    times_of: Callable[[RankLoad], RankTimes],
) -> tuple[float, float, float, float]:
    """A pipeline on a measured CPU: the uniform-stage makespan times the slowest stage
    (as checked against real CPU runs by ``benchmarks/plan_check.py``), every send a rank
    makes exposed, ranks sharing cores filling each other's bubbles."""
    m = layout.microbatches
    times = {load: times_of(load) for load in shape.ranks}
    unit = max(t.per_microbatch(r.stage_layers) for r, t in times.items())
    hop = microbatch_hop(model, layout, work, device)
    hops = 2 * (layout.pp * layout.stages_per_rank - 1)
    if not device.overlap:  # every send a rank makes takes its cores' time
        hops = max(hops, 2 * m * layout.stages_per_rank)
    gathers = layout_gathers(layout)  # a stage gathered again: serial here, all exposed
    exposed = max(gathers * t.gather + t.reduce for t in times.values()) + hops * hop
    pipeline = shape.makespan * unit
    share = device.oversubscription
    if share > 1:  # ranks sharing cores fill each other's bubbles (see the docstring)
        busy = max(m * t.per_microbatch(r.layers) for r, t in times.items())
        pipeline = max(busy, pipeline / share)
    host = max(t.host for t in times.values())
    compute = max(t.compute for t in times.values())
    return pipeline + exposed + host, compute, exposed, host
