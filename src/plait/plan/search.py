"""The layout search: enumerate what plait can run on ``gpus`` devices, keep what fits,
rank by predicted tokens/s per device.

Candidates: every factorisation ``pp x dp_replicate x dp_shard x tp`` of the devices with
``tp`` at most a node and dividing the heads, KV heads, MLP width, vocabulary (and the
sequence under sequence parallelism), ``pp x stages_per_rank`` at most the blocks, the
global batch divisible by ``dp``; for pipelines every schedule with a few microbatch counts
(the fewest the schedule takes, then doubling up to one sequence per microbatch); without
one, gradient accumulation over a few microbatch counts; checkpointing none / selective /
full; ``reshard_after_forward`` both ways under ``fully_shard``. Fixed flags pin their
field. A layout fits when its peak rank's memory is at most ``memory_fraction`` of the
device's (the rest: allocator, CUDA context, workspaces). Memory is predicted first and
timing only for what fits, and the pipeline's figures are closed-form where exact and
cached (:mod:`plait.plan.schedule`), so 10,240 devices take about a second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from plait.pipeline.schedules import SCHEDULES, schedule_spec
from plait.plan.memory import peak_memory
from plait.plan.schedule import layout_shape
from plait.plan.spec import DeviceSpec, Layout, MemoryBreakdown, ModelSpec, Workload
from plait.plan.timing import EFFICIENCY, Timing, predict_time

__all__ = ["AC_SEARCHED", "Candidate", "PlanError", "evaluate", "plan"]

AC_SEARCHED = ("none", "selective", "full")
_GIB = 2.0**30


class PlanError(ValueError):
    """Input the planner cannot plan for; the message says what to change."""


@dataclass(frozen=True)
class Candidate:
    """One evaluated layout: its peak rank's memory, predicted time, and whether it fits."""

    layout: Layout
    memory: MemoryBreakdown
    timing: Timing
    fits: bool


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_splits(model: ModelSpec, work: Workload, sequence_parallel: bool) -> dict[str, int]:
    split = {
        "attention heads": model.heads,
        "KV heads": model.kv_heads,
        "MLP width": model.ffn_hidden,
        "vocabulary": model.vocab,
    }
    if sequence_parallel:
        split["sequence length (sequence parallelism; or --no-sequence-parallel)"] = work.seq_len
    return split


def _check_tp(model: ModelSpec, work: Workload, tp: int, sequence_parallel: bool) -> None:
    for what, size in _tp_splits(model, work, sequence_parallel and tp > 1).items():
        if size % tp:
            raise PlanError(
                f"--tp {tp} does not divide the {size} {what} of {model.name}: "
                f"use a --tp that divides {size}"
            )


def evaluate(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    *,
    memory_fraction: float = 0.9,
    efficiency: float = EFFICIENCY,
) -> Candidate:
    """Memory and time of one layout (no search). ValueError for a shape plait refuses."""
    shape = layout_shape(model, layout)
    memory = peak_memory(model, layout, work, shape)
    timing = predict_time(model, layout, work, device, shape, efficiency)
    return Candidate(layout, memory, timing, memory.total <= memory_fraction * device.memory)


@dataclass(frozen=True)
class _Fixed:
    dp_replicate: int | None
    dp_shard: int | None
    tp: int | None
    pp: int | None
    schedule: str | None
    stages_per_rank: int | None
    microbatches: int | None
    ac: str | None
    reshard_after_forward: bool | None
    sequence_parallel: bool | None


def _microbatch_options(local: int, fewest: int) -> list[int]:
    """Microbatch counts to try: the fewest allowed, doubling, and one sequence each."""
    ok = [d for d in _divisors(local) if d >= fewest]
    if not ok:
        return []
    picks = {ok[0], ok[-1]}
    m = ok[0]
    while m * 2 <= ok[-1] and len(picks) < 3:
        m *= 2
        if local % m == 0:
            picks.add(m)
    return sorted(picks)


def _layouts(
    model: ModelSpec, work: Workload, gpus: int, per_node: int, f: _Fixed
) -> Iterator[Layout]:
    sp = True if f.sequence_parallel is None else f.sequence_parallel
    tps = [f.tp] if f.tp else [t for t in _divisors(gpus) if t <= per_node]
    for tp in tps:
        if any(size % tp for size in _tp_splits(model, work, sp and tp > 1).values()):
            continue
        rest = gpus // tp
        for pp in [f.pp] if f.pp else _divisors(rest):
            if rest % pp:
                continue
            for dr in [f.dp_replicate] if f.dp_replicate else _divisors(rest // pp):
                if (rest // pp) % dr:
                    continue
                ds = rest // pp // dr
                if (f.dp_shard and ds != f.dp_shard) or work.global_batch % (dr * ds):
                    continue
                base = Layout(dr, ds, tp, pp, sequence_parallel=sp)
                yield from _variants(model, work, base, f)


def _variants(model: ModelSpec, work: Workload, base: Layout, f: _Fixed) -> Iterator[Layout]:
    local = work.global_batch // base.dp
    if base.pp == 1:
        schedules: list[tuple[str, int, int]] = [("1F1B", 1, 1)]
    else:
        names = [schedule_spec(f.schedule).name] if f.schedule else list(SCHEDULES)
        schedules = []
        for name in names:
            spec = SCHEDULES[name]
            v = f.stages_per_rank or spec.stages_per_rank or 2
            if spec.stages_per_rank not in (None, v) or base.pp * v > model.layers:
                continue
            schedules.append((name, v, spec.min_microbatches(base.pp * v)))
    for name, v, fewest in schedules:
        if f.microbatches:
            counts = [f.microbatches] if local % f.microbatches == 0 else []
        else:
            counts = _microbatch_options(local, max(fewest, base.pp))
        for m in counts:
            for ac in [f.ac] if f.ac else AC_SEARCHED:
                reshards = [True] if base.dp_shard == 1 or base.pp > 1 else [True, False]
                if f.reshard_after_forward is not None:
                    reshards = [f.reshard_after_forward]
                for reshard in reshards:
                    yield dataclasses.replace(
                        base,
                        schedule=name,
                        stages_per_rank=v,
                        microbatches=m,
                        ac=ac,
                        reshard_after_forward=reshard,
                    )


def _check_fixed(model: ModelSpec, work: Workload, gpus: int, f: _Fixed) -> None:
    if gpus < 1:
        raise PlanError(f"--gpus {gpus}: must be at least 1")
    sizes = {"--dp-replicate": f.dp_replicate, "--dp-shard": f.dp_shard, "--tp": f.tp, "--pp": f.pp}
    product = 1
    for option, size in sizes.items():
        if size is not None and size < 1:
            raise PlanError(f"{option} {size}: must be at least 1")
        product *= size or 1
    given = " x ".join(f"{o} {s}" for o, s in sizes.items() if s)
    if sum(1 for s in sizes.values() if s) > 1:
        given += f" = {product}"
    if gpus % product:
        raise PlanError(
            f"{given} does not divide --gpus {gpus}: every layout is a "
            f"pp x dp_replicate x dp_shard x tp grid of the devices; choose sizes whose "
            f"product divides {gpus}"
        )
    if all(s is not None for s in sizes.values()) and product != gpus:
        raise PlanError(f"{given} devices, but --gpus is {gpus}: make them equal")
    if f.tp:
        _check_tp(model, work, f.tp, f.sequence_parallel is not False)
    if f.ac is not None and f.ac not in AC_SEARCHED:
        raise PlanError(f"--ac {f.ac}: the planner models {', '.join(AC_SEARCHED)}")
    if f.schedule is not None:
        try:
            schedule_spec(f.schedule)
        except ValueError as err:
            raise PlanError(f"--schedule {f.schedule}: {err}") from err
    if f.pp and f.pp * (f.stages_per_rank or 1) > model.layers:
        raise PlanError(
            f"--pp {f.pp} x {f.stages_per_rank or 1} stage(s) per rank is more pipeline "
            f"stages than the {model.layers} blocks of {model.name}: use fewer"
        )


def plan(
    model: ModelSpec,
    work: Workload,
    device: DeviceSpec,
    gpus: int,
    *,
    dp_replicate: int | None = None,
    dp_shard: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    schedule: str | None = None,
    stages_per_rank: int | None = None,
    microbatches: int | None = None,
    ac: str | None = None,
    reshard_after_forward: bool | None = None,
    sequence_parallel: bool | None = None,
    memory_fraction: float = 0.9,
    efficiency: float = EFFICIENCY,
) -> list[Candidate]:
    """Every layout of ``gpus`` devices that fits, fastest first (module docstring).

    Layout arguments left ``None`` are searched; given ones are fixed. ``device.gpus_per_node``
    bounds tp. Raises :class:`PlanError` for fixed sizes that do not divide ``gpus``, a
    ``tp`` that does not divide the model, no possible layout, or no layout that fits (the
    message gives the smallest peak memory found).
    """
    fixed = _Fixed(
        dp_replicate,
        dp_shard,
        tp,
        pp,
        schedule,
        stages_per_rank,
        microbatches,
        ac,
        reshard_after_forward,
        sequence_parallel,
    )
    _check_fixed(model, work, gpus, fixed)
    fitting: list[Candidate] = []
    smallest: tuple[float, Layout] | None = None
    budget = memory_fraction * device.memory
    for layout in _layouts(model, work, gpus, device.gpus_per_node, fixed):
        try:
            shape = layout_shape(model, layout)
        except ValueError:
            continue  # a shape plait's schedules refuse
        memory = peak_memory(model, layout, work, shape)
        if smallest is None or memory.total < smallest[0]:
            smallest = (memory.total, layout)
        if memory.total > budget:
            continue
        timing = predict_time(model, layout, work, device, shape, efficiency)
        fitting.append(Candidate(layout, memory, timing, True))
    if smallest is None:
        raise PlanError(
            f"no layout of {gpus} devices can run {model.name} with --global-batch "
            f"{work.global_batch}: the batch must divide over the data-parallel ranks "
            "(use a multiple of the device count), and fixed flags must leave a valid grid"
        )
    if not fitting:
        need, layout = smallest
        raise PlanError(
            f"{model.name} fits in no layout of {gpus} x {device.name}: the smallest peak "
            f"memory per rank is {need / _GIB:.1f} GiB ({describe(layout)}), the device has "
            f"{budget / _GIB:.1f} GiB usable ({memory_fraction:.0%} of {device.memory / _GIB:.1f}"
            " GiB): use more or larger devices, a shorter sequence or a smaller batch"
        )
    fitting.sort(key=lambda c: (-c.timing.tokens_per_s_per_device, c.memory.total))
    return fitting


def describe(layout: Layout) -> str:
    """A one-line summary of ``layout``, e.g. ``dp_shard=128 tp=8 ac=selective``."""
    parts = [f"{name}={getattr(layout, name)}" for name in ("pp", "dp_replicate", "dp_shard", "tp")]
    parts = [p for p in parts if not p.endswith("=1")]
    if layout.pp > 1:
        parts.append(f"{layout.schedule}x{layout.stages_per_rank}")
    if layout.microbatches > 1:
        parts.append(f"mb={layout.microbatches}")
    parts.append(f"ac={layout.ac}")
    if layout.dp_shard > 1 and not layout.reshard_after_forward:
        parts.append("no-reshard")
    return " ".join(parts) or "single device"
