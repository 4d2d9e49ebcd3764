"""What plait's pipeline schedule does to each rank: layers held, microbatches in flight,
and the bubble, read from plait's own schedule generator and simulator
(:mod:`plait.pipeline.schedules`, :mod:`plait.pipeline.simulate`), or from the simulator's
closed form where one is exact (below), not from a textbook formula.

Stages get blocks as :func:`plait.pipeline.stage_layers` gives them (contiguous runs,
earlier stages one more when they do not divide); the embeddings go with the first stage,
the final norm and head with the last. The simulation is compute-only with uniform stages,
``F = 1`` and ``B = 2`` (split backwards: ``I = W = 1``); the makespan is reported in units
of one stage's forward plus backward for one microbatch, so a step lasts ``makespan x
(F + B)`` of the slowest stage. Checkpointing makes backward longer than twice the forward;
the makespan is scaled, not re-simulated, which is exact for GPipe and 1F1B and close for
the others.

Speed (a search over 10,000 devices meets hundreds of pipeline shapes, some with a
hundred thousand actions): the makespan under these costs has a closed form for every
schedule but InterleavedZeroBubble with fewer microbatches than ranks
(:func:`closed_form_makespan`, checked against the simulator), so only those are
simulated; peaks of live activations have closed forms for every schedule
(:func:`_closed_form_peaks`, checked against the generated orders in
``tests/test_plan_speed.py``) but ZBVZeroBubble below ``2 p`` microbatches, whose order
is generated and read; besides those, only InterleavedZeroBubble below ``p`` microbatches
(simulated) is generated at all.
Results are cached by what they depend on: the schedule's figures by (schedule, ranks,
stages, microbatches), whatever the number of blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from plait.layout.schedule import stage_blocks
from plait.pipeline.actions import ActionKind, Schedule, stage_to_rank
from plait.pipeline.schedules import add_fsdp_actions, generate, schedule_spec
from plait.pipeline.simulate import DEFAULT_COSTS, peak_live, simulate
from plait.plan.spec import Layout, ModelSpec

__all__ = [
    "PipelineShape",
    "RankLoad",
    "closed_form_makespan",
    "layout_gathers",
    "layout_shape",
    "pipeline_shape",
    "pipeline_stages",
    "stage_gathers",
    "stage_makespan",
]


@dataclass(frozen=True)
class RankLoad:
    """One pipeline rank's share: what its memory and time depend on."""

    rank: int
    layers: int  # blocks held, over all its stages
    stage_layers: int  # blocks of its largest stage
    embedding: bool  # holds the first stage (token and position embeddings)
    head: bool  # holds the last stage (final norm, head, loss)
    in_flight: int  # (stage, microbatch) activations held at once, at most
    head_in_flight: int  # of those, microbatches of the last stage (logits saved)
    in_flight_after_backward: int = 0  # at most, once the rank's first backward ended


@dataclass(frozen=True)
class PipelineShape:
    """``ranks``: the pipeline ranks whose memory can be the largest (the others hold less
    of everything than one of these); ``makespan``: the step in units of one stage's forward
    plus backward of one microbatch; ``bubble``: idle fraction of the ranks' time (0
    without a pipeline)."""

    ranks: tuple[RankLoad, ...]
    makespan: float
    bubble: float


def closed_form_makespan(
    schedule: str, pp: int, stages_per_rank: int, microbatches: int
) -> float | None:
    """The makespan :func:`plait.pipeline.simulate.simulate` finds for ``schedule`` (``F =
    1``, ``B = 2``, ``I = W = 1``, no communication, uniform stages) on ``pp`` ranks of
    ``stages_per_rank`` stages over ``microbatches``, without simulating; None for the
    shapes that have none here (InterleavedZeroBubble with fewer microbatches than ranks).

    With ``p`` ranks, ``v`` stages per rank and ``m`` microbatches, every rank computes
    ``3 v m`` (each (stage, microbatch) costs F + B = F + I + W = 3), and:

    * GPipe, 1F1B, Interleaved1F1B, LoopedBFS: ``3 (v max(m, p) + min(m, p) - 1)``. With
      ``m >= p`` a rank idles ``p - 1`` forward slots while the first microbatch fills the
      pipeline and ``p - 1`` backward slots while the last one drains (``3 (p - 1)``); with
      ``m < p`` a looped schedule's microbatches come back to the first rank after ``p``
      slots, not ``m``, so each of the ``v`` rounds takes ``p`` slots.
    * InterleavedZeroBubble (``m >= p``), ZBVZeroBubble (``m >= 3p / 2``) and DualPipeV:
      ``3 v m + p - 1``, the lower bound (the last pipeline rank gets its first input
      after ``p - 1`` forwards, then has ``3 v m`` to do), which their deferred weight
      gradients reach. ZBVZeroBubble below ``3p / 2`` microbatches: ``4 m + 4 p - 2``,
      the V's round trip (``2 p`` forwards and ``2 p`` input gradients) plus 4 per
      further microbatch and the first rank's two trailing weight gradients.

    Each formula equals the simulator (makespan and idle fraction, to the bit) on every
    shape up to 16 ranks, 4 stages per rank and 4 microbatches per rank, and at 24 and 32
    ranks on spot checks up to 8 microbatches per rank; ``tests/test_plan_scale.py``
    repeats the check up to 8 ranks.
    """
    name = schedule_spec(schedule).name
    v, m, p = stages_per_rank, microbatches, pp
    if name in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"):
        return 3.0 * (v * max(m, p) + min(m, p) - 1)
    if name == "InterleavedZeroBubble":
        return 3.0 * v * m + p - 1 if m >= p else None
    if name == "ZBVZeroBubble":
        return 3.0 * v * m + max(p - 1, 4 * p - 2 - 2 * m)
    if name == "DualPipeV":
        return 3.0 * v * m + p - 1
    return None


@dataclass(frozen=True)
class _Figures:
    """What a schedule does, whatever the blocks: per rank, the peak of live activations
    and of the last stage's; the makespan (F = 1, B = 2) and the idle fraction."""

    in_flight: tuple[int, ...]
    head_in_flight: tuple[int, ...]  # 0 on ranks without the last stage
    after_backward: tuple[int, ...]  # per rank, once its first backward has ended
    makespan: float
    bubble: float


def _closed_form_peaks(
    name: str, pp: int, v: int, m: int
) -> tuple[tuple[int, ...], int, tuple[int, ...]] | None:
    """Per rank, the peak of live activations, the last stage's peak on its rank, and per
    rank the peak once its first backward has ended, for the schedules whose action order
    makes them plain (None for the others): GPipe runs every forward before any backward
    (``m``, then ``m - 1``); 1F1B's rank ``r`` warms up with ``w = min(p - r, m)`` forwards,
    then alternates (``w``; the last rank ``1``; after the first backward ``w`` again while
    microbatches remain to start, else ``w - 1``); LoopedBFS runs every forward of every
    local stage first (``v m``, then ``v m - 1``; the last stage ``m``); Interleaved1F1B and
    InterleavedZeroBubble: :func:`_megatron_peaks`; ZBVZeroBubble and DualPipeV:
    :func:`_v_peaks`. For a shape the generator takes (:func:`_runs`)."""
    if name == "GPipe":
        return (m,) * pp, m, (m - 1,) * pp
    if name == "1F1B":
        warm = [min(pp - r, m) for r in range(pp)]
        after = tuple(w if m > w else w - 1 for w in warm)
        return tuple(warm), 1, after
    if name == "LoopedBFS":
        return (v * m,) * pp, m, (v * m - 1,) * pp
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return _megatron_peaks(pp, v, m, split=name == "InterleavedZeroBubble")
    return _v_peaks(name, pp, m)


def _megatron_peaks(
    pp: int, v: int, m: int, split: bool
) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """:func:`_closed_form_peaks` of Megatron's order
    (:func:`plait.pipeline.schedules.interleaved_1f1b`, and with ``split`` backwards
    :func:`~plait.pipeline.schedules.interleaved_zero_bubble`), without generating it.

    Rank ``r`` runs ``w`` warm-up forwards (``(v - 1) g + h (p - 1 - r)``, at most ``v m``;
    ``g`` the first microbatch group, ``h`` 2, or 1 when split), then ``P = v m - w`` pairs
    (a forward, then a backward: B, or I followed by the W of the I ``lag`` I's earlier,
    ``lag`` 0, or ``r`` when split), then the remaining backwards. A forward adds one live
    activation, a B or a W frees one, so right after pair ``j``'s forward ``w + j + 1 -
    max(0, j - lag)`` are live: the peak is ``w + 1 + min(lag, P - 1)`` (``v m`` without
    pairs). The first free is pair ``lag``'s, leaving ``w + lag`` live, and every later
    pair's forward brings it back to ``w + lag + 1``; without that pair it is in the
    drain, after every forward (``v m - 1``). The last stage (rank ``p - 1``'s last local
    stage): its live count right after pair ``j``'s forward is its forwards among the
    first ``w + j + 1`` minus its frees among the first ``max(0, j - lag)`` backwards,
    counted from the depth-first orders (each group: ``(v - 1) g_k`` forwards of the other
    stages then ``g_k`` of it; ``g_k`` backwards of it, then the others'), maximised over
    ``j``. Equal to :func:`plait.pipeline.simulate.peak_live` on the generated order
    (``tests/test_plan_speed.py``)."""
    rounds = max(1, m // pp)
    size, extra = divmod(m, rounds)
    groups = [size + 1] * extra + [size] * (rounds - extra)
    hops = 1 if split else 2
    vm = v * m
    in_flight, after = [], []
    for r in range(pp):
        w = min(vm, (v - 1) * groups[0] + hops * (pp - 1 - r))
        lag = r if split else 0
        pairs = vm - w
        in_flight.append(w + 1 + min(lag, pairs - 1) if pairs else vm)
        if pairs >= lag + 1:
            after.append(w + lag + (1 if pairs >= lag + 2 else 0))
        else:
            after.append(vm - 1)
    # The last stage on rank p - 1: cumulative counts of its forwards and backwards.
    lag = pp - 1 if split else 0
    w = min(vm, (v - 1) * groups[0])
    forwards, backwards = [0], [0]
    for g in groups:
        f, b = forwards[-1], backwards[-1]
        forwards += [f] * ((v - 1) * g) + [f + i for i in range(1, g + 1)]
        backwards += [b + i for i in range(1, g + 1)] + [b + g] * ((v - 1) * g)
    if w == vm:
        head = m
    else:
        head = max(forwards[w + j + 1] - backwards[max(0, j - lag)] for j in range(vm - w))
    return tuple(in_flight), head, tuple(after)


def _v_peaks(name: str, pp: int, m: int) -> tuple[tuple[int, ...], int, tuple[int, ...]] | None:
    """:func:`_closed_form_peaks` of the V schedules from ``2 p`` microbatches on (None
    below, or for another schedule). ZBVZeroBubble's rank ``r`` fills ``2 (p - r) - 1 + 2 r
    = 2 p - 1`` forwards, then each round's forward makes ``2 p`` before its W frees one
    (F1 I1 W1, then the steady F0 I0 W0 F1 I1 W1, which frees what it adds): ``2 p``,
    also after the first W (a further round follows it). DualPipeV's fills ``2 p`` (``2 (p
    - 1 - r)`` F0, ``r + 1`` F0 F1, then I1 W1 F1 rounds), and its steady rounds (F0 B1 F1
    B0, at least one from ``2 p`` microbatches on) start with a forward: ``2 p + 1``, also
    after the first free (the first W1, or the first steady B1 on the last rank). The last
    stage (rank 0's second) frees each of its microbatches before its next forward: 1."""
    if m < 2 * pp:
        return None
    if name == "ZBVZeroBubble":
        return (2 * pp,) * pp, 1, (2 * pp,) * pp
    if name == "DualPipeV":
        return (2 * pp + 1,) * pp, 1, (2 * pp + 1,) * pp
    return None


def _runs(name: str, pp: int, n_stages: int, microbatches: int) -> bool:
    """Whether the generator takes this shape: its own checks
    (:func:`plait.pipeline.schedules.generate`), without generating."""
    spec = schedule_spec(name)
    fixed = spec.stages_per_rank
    return (
        min(pp, n_stages, microbatches) >= 1
        and (fixed is None or n_stages == fixed * pp)
        and n_stages % pp == 0
        and microbatches >= spec.min_microbatches(n_stages)
    )


@functools.lru_cache(maxsize=4096)
def _figures(name: str, pp: int, n_stages: int, microbatches: int) -> _Figures:
    """The figures of ``name`` (canonical) for one shape. The makespan is closed-form
    where known, else simulated; the peaks are closed-form where known (every schedule
    but ZBVZeroBubble below ``2 p`` microbatches), else read from the generated action
    order, which is then the only one generated. ValueError (from the generator) for
    refused shapes."""
    v = n_stages // pp
    makespan = closed_form_makespan(name, pp, v, microbatches)
    peaks = None
    if _runs(name, pp, n_stages, microbatches):
        peaks = _closed_form_peaks(name, pp, v, microbatches)
    if peaks is None or makespan is None:
        plan: Schedule = generate(name, pp, n_stages, microbatches)  # raises if refused
    owner = stage_to_rank(n_stages - 1, pp, schedule_spec(name).style)
    if peaks is None:
        in_flight = tuple(peak_live(plan[rank]) for rank in range(pp))
        head = peak_live(plan[owner], n_stages - 1)
        after = tuple(peak_live(plan[rank], after_backward=True) for rank in range(pp))
    else:
        in_flight, head, after = peaks
    heads = tuple(head if rank == owner else 0 for rank in range(pp))
    if makespan is not None:
        # Busy time is 3 per (stage, microbatch) (F + B or F + I + W), computed as
        # simulate computes its idle fraction, so the two agree to the bit.
        total = pp * makespan
        busy = 3.0 * n_stages * microbatches
        bubble = (total - busy) / total
    else:
        sim = simulate(plan, DEFAULT_COSTS)
        makespan, bubble = sim.makespan, sim.bubble_fraction
    return _Figures(in_flight, heads, after, makespan, bubble)


def _pareto(loads: list[RankLoad]) -> tuple[RankLoad, ...]:
    """The loads not dominated by another (memory grows with every field)."""

    def key(r: RankLoad) -> tuple[int, ...]:
        fields = (r.layers, r.stage_layers, r.embedding, r.head, r.in_flight, r.head_in_flight)
        return (*fields, r.in_flight_after_backward)

    keys = {key(r): r for r in loads}  # one rank per distinct load
    out = [
        r
        for k, r in keys.items()
        if not any(o != k and all(a >= b for a, b in zip(o, k, strict=True)) for o in keys)
    ]
    return tuple(sorted(out, key=lambda r: r.rank))


@functools.lru_cache(maxsize=4096)
def pipeline_shape(
    layers: int,
    pp: int,
    schedule: str = "1F1B",
    stages_per_rank: int = 1,
    microbatches: int = 1,
    end_blocks: int = 0,
) -> PipelineShape:
    """The pipeline ranks' loads and the bubble of ``schedule`` (see the module docstring),
    the blocks split as :func:`plait.layout.stage_blocks` splits them.

    Without a pipeline (``pp == 1``): one rank holding everything, one microbatch in flight
    (gradient accumulation runs microbatches one after another). ValueError (from the
    generator) for shapes plait's schedules refuse.
    """
    if pp == 1:
        return PipelineShape((RankLoad(0, layers, layers, True, True, 1, 1, 1),), 1.0, 0.0)
    stages = pipeline_stages(layers, pp, schedule, stages_per_rank, end_blocks)
    n_stages = len(stages)
    sizes = [size for size, _ in stages]
    figures = _figures(schedule_spec(schedule).name, pp, n_stages, microbatches)
    held: list[list[int]] = [[] for _ in range(pp)]  # per rank, its stages in order
    for s, (_, rank) in enumerate(stages):
        held[rank].append(s)
    loads = []
    for rank, mine in enumerate(held):
        loads.append(
            RankLoad(
                rank=rank,
                layers=sum(sizes[s] for s in mine),
                stage_layers=max(sizes[s] for s in mine),
                embedding=0 in mine,
                head=n_stages - 1 in mine,
                in_flight=figures.in_flight[rank],
                head_in_flight=figures.head_in_flight[rank] if n_stages - 1 in mine else 0,
                in_flight_after_backward=figures.after_backward[rank],
            )
        )
    return PipelineShape(_pareto(loads), figures.makespan / 3, figures.bubble)


def layout_shape(model: ModelSpec, layout: Layout) -> PipelineShape:
    """:func:`pipeline_shape` of ``model`` under ``layout``."""
    return pipeline_shape(
        model.layers,
        layout.pp,
        layout.schedule,
        layout.stages_per_rank,
        layout.microbatches,
        layout.end_blocks,
    )


@functools.lru_cache(maxsize=4096)
def pipeline_stages(
    layers: int, pp: int, schedule: str = "1F1B", stages_per_rank: int = 1, end_blocks: int = 0
) -> tuple[tuple[int, int], ...]:
    """Per pipeline stage, in order: its blocks (:func:`plait.layout.stage_blocks`'s split,
    as :func:`plait.pipeline.stage_layers` makes it) and the rank that runs it (the
    schedule's placement: looped or V)."""
    n_stages = pp * stages_per_rank
    style = schedule_spec(schedule).style
    sizes = stage_blocks(layers, n_stages, end_blocks)
    return tuple((size, stage_to_rank(s, pp, style)) for s, size in enumerate(sizes))


def stage_makespan(
    durations: tuple[float, ...],
    owners: tuple[int, ...],
    pp: int,
    microbatches: int,
    uniform: float,
) -> float:
    """The step of a pipeline whose stages last ``durations`` (forward plus backward of one
    microbatch; stage ``s`` on rank ``owners[s]``), from the schedule's makespan with
    uniform stages ``uniform`` (in stage units, :attr:`PipelineShape.makespan`).

    A rank's own work, ``m x`` the sum of its stages' durations, is done whatever the
    schedule; the rest of the uniform makespan, ``uniform - v m`` stage units, is the fill
    and drain, which the first microbatch's forwards and the last one's backwards spend
    passing through the *other* stages. So the makespan is the busiest rank's work plus
    that many stage units, each at the mean duration of the stages but the longest one:
    with uniform stages exactly the schedule's makespan; for GPipe and 1F1B (``m >= p``)
    ``sum(d) + (m - 1) max(d)``, the classic bound of a pipeline whose slowest stage sets
    the pace; embeddings and the head weigh on their own stages only.
    """
    n_stages = len(durations)
    v = n_stages // pp
    busy = [0.0] * pp
    for d, rank in zip(durations, owners, strict=True):
        busy[rank] += microbatches * d
    rest = uniform - v * microbatches
    if n_stages < 2 or rest <= 0:
        return max(busy)
    others = (sum(durations) - max(durations)) / (n_stages - 1)
    return max(busy) + rest * others


@functools.lru_cache(maxsize=256)
def stage_gathers(
    schedule: str, pp: int, stages_per_rank: int, microbatches: int, max_active_stages: int
) -> float:
    """How many times a pipeline rank gathers each of its stages per step, on average, the
    busiest rank's: 1 without a bound on the stages gathered at once (``0``) or with one of
    at least the stages a rank holds; else the UNSHARDs of the schedule as plait lowers it
    (:func:`plait.pipeline.add_fsdp_actions`) over the rank's stages."""
    v = stages_per_rank
    if max_active_stages <= 0 or max_active_stages >= v or pp == 1:
        return 1.0
    order = add_fsdp_actions(generate(schedule, pp, pp * v, microbatches), max_active_stages)
    unshard = ActionKind.UNSHARD
    return max(sum(a.kind is unshard for a in acts) for acts in order.values()) / v


def layout_gathers(layout: Layout) -> float:
    """:func:`stage_gathers` of ``layout`` (1 at once without a bound: the search prices
    tens of thousands of layouts, nearly all without one)."""
    if layout.max_active_stages <= 0:
        return 1.0
    return stage_gathers(
        layout.schedule,
        layout.pp,
        layout.stages_per_rank,
        layout.microbatches,
        layout.max_active_stages,
    )
