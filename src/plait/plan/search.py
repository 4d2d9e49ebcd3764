"""The layout search: enumerate what plait can run on ``gpus`` devices, keep what fits,
rank by predicted tokens/s per device.

Candidates: every factorisation ``pp x dp_replicate x dp_shard x cp x tp`` of the devices with
``tp`` at most a node, that ``plait train`` runs (the rules of :mod:`plait.layout`: ``tp``
dividing the heads, widths and vocabulary, and the sequence under sequence parallelism;
``pp x stages_per_rank`` at most the blocks; the global batch divisible by ``dp``, and so
on); for pipelines every schedule with a few microbatch counts
(the fewest the schedule takes, then doubling up to one sequence per microbatch); without
one, gradient accumulation over a few microbatch counts; checkpointing none / selective /
full; ``reshard_after_forward`` both ways under ``fully_shard``; for a model with routed
experts, every expert-parallel size ``ep`` that divides both ``dp_shard x cp`` and the experts
(``ep`` takes its ranks from ``dp_shard x cp``: :func:`plait.layout.check_ep`); context
parallelism ``cp`` over the divisors the sequence allows (:func:`plait.layout.check_cp`),
only from :data:`CP_SEARCH_MIN_SEQ` tokens on and leaving each rank at least
:data:`CP_MIN_TOKENS` of a sequence (else ``cp`` is 1 unless ``--cp`` is given: see
there), searched with ``ring`` attention; the other methods (``--cp-method``) are then
tried on the best layouts found (:func:`_other_cp_methods`); interleaved schedules are
searched at their least stages per rank (2), then the best of them again at every other
:func:`stages_options` (:func:`_other_stages`), then the best pipelines with the embedding
and the head weighing a block each (:func:`_weighted_ends`). Pipelines hold every local
stage gathered (``max_active_stages`` 0) unless no layout fits so: then the pipelined ones
are tried again at each bound of :data:`BOUNDS` below their stages per rank. ZeRO data
parallelism and Megatron-LM's activations (:class:`~plait.plan.spec.PlanLayout`) only when
asked (``zero``, ``recipe``): plait train runs neither. Fixed flags pin their field.
A layout fits when its peak rank's memory is at most ``memory_fraction`` of the
device's (the rest: allocator, CUDA context, workspaces). Memory is predicted first and
timing only for what fits; the pipeline's figures (makespan, bubble, activation peaks)
are closed-form for every schedule but ZBVZeroBubble below ``2 pp`` microbatches and
cached by (schedule, pp, stages, microbatches) (:mod:`plait.plan.schedule`), so no
schedule of a hundred thousand actions is generated; the ``ep`` sizes come from the
divisors of a gcd and layouts are copied without :func:`dataclasses.replace`. A cold
10,240-device search of Llama 3.1 405B (``plait plan --preset llama3-405b --gpus
10240``) takes 1-3 s of CPU on a 2-core machine (``benchmarks/plan_speed.py`` reports
it), most of it the memory of its 20,000 layouts. Every shortcut gives the same
candidates, figures to the bit, as the search without it (``tests/test_plan_speed.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

from plait.layout import (
    CP,
    CP_METHODS,
    DP_SHARD,
    EP,
    TP,
    Layout,
    ModelShape,
    World,
    check,
    check_batch,
    check_cp,
    check_tp,
    cp_shard,
    default_stages_per_rank,
    fewest_microbatches,
    find_schedule,
    grids,
)
from plait.pipeline.schedules import SCHEDULES
from plait.plan.candidate import Candidate, Pricing, describe, evaluate, fastest
from plait.plan.pinned import AC_SEARCHED, Pinned, check_pinned, pin
from plait.plan.plan_error import PlanError
from plait.plan.spec import (
    RECIPES,
    ZERO_STAGES,
    DeviceSpec,
    ModelSpec,
    PlanLayout,
    Software,
    Workload,
)
from plait.plan.timing import EFFICIENCY

__all__ = [
    "AC_SEARCHED",
    "BOUNDS",
    "CP_METHOD_RETRIES",
    "CP_MIN_TOKENS",
    "CP_SEARCH_MIN_SEQ",
    "STAGES_RETRIES",
    "Candidate",
    "PlanError",
    "describe",
    "evaluate",
    "model_shape",
    "plan",
    "stages_options",
]

#: The shortest sequence for which the search tries context parallelism unasked. Shorter
#: sequences fit without it (activations are what cp divides, and at 8k tokens checkpointing
#: and tp already hold them in a device's memory for the presets), its exchange costs more
#: than it saves there, and each cp size multiplies the grids (three methods each): keeping
#: cp at 1 below this keeps the search as fast as before and its answers for the usual
#: sequence lengths unchanged. ``--cp`` (``plan(cp=...)``) asks for it at any length.
CP_SEARCH_MIN_SEQ = 16384
#: The fewest tokens of a sequence the search leaves a cp rank unasked (the size it tries
#: goes up to ``seq_len / CP_MIN_TOKENS``): smaller shares make attention's blocks small,
#: where kernels run below the calibrated efficiency (not modelled), and every cp size
#: multiplies the grids searched.
CP_MIN_TOKENS = 8192
#: How many of the best layouts with context parallelism :func:`_other_cp_methods` tries
#: the other attention methods on.
CP_METHOD_RETRIES = 64
#: How many of the best interleaved layouts :func:`_other_stages` tries other stages per
#: rank on.
STAGES_RETRIES = 16
_GIB = 2.0**30


def model_shape(model: ModelSpec, work: Workload) -> ModelShape:
    """What the layout rules need of ``model`` running ``work``: :meth:`ModelSpec.shape`,
    the derivation ``plait train`` uses too (the MLP width tp must divide:
    :attr:`ModelSpec.tp_mlp_width`)."""
    return model.shape(work.seq_len)


@functools.lru_cache(maxsize=1024)
def _microbatch_options(local: int, fewest: int) -> tuple[int, ...]:
    """Microbatch counts to try: the fewest allowed, doubling, and one sequence each."""
    ok = [d for d in range(1, local + 1) if local % d == 0 and d >= fewest]
    if not ok:
        return ()
    picks = {ok[0], ok[-1]}
    m = ok[0]
    while m * 2 <= ok[-1] and len(picks) < 3:
        m *= 2
        if local % m == 0:
            picks.add(m)
    return tuple(sorted(picks))


def _with(layout: Layout, **changes: Any) -> Layout:
    """``dataclasses.replace(layout, **changes)`` for the plain :class:`Layout` s the
    enumeration builds (every field an ``__init__`` argument, no ``__post_init__``),
    without ``replace``'s scan of the fields on every call: the search builds tens of
    thousands."""
    return Layout(**{**layout.__dict__, **changes})


def _layouts(
    shape: ModelShape, work: Workload, world: World, per_node: int, pinned: Pinned
) -> Iterator[Layout]:
    sp, ends = pinned.layout.sequence_parallel, pinned.layout.end_blocks
    active = pinned.layout.max_active_stages
    for grid in grids(pinned.sizes, world.size):
        base = Layout(sequence_parallel=sp, end_blocks=ends, max_active_stages=active)
        base = base.with_sizes(grid)
        assert type(base) is Layout  # what _with copies
        if base.tp > per_node and not pinned.given(TP):
            continue
        # What every variant of this grid shares: a grid that breaks it is skipped whole
        # (tp splits each cp rank's share of the sequence).
        if check_cp(shape, base.cp, "ring") or check_batch(work.global_batch, base):
            continue
        if not pinned.given(CP) and base.cp > 1 and work.seq_len < base.cp * CP_MIN_TOKENS:
            continue
        if check_tp(cp_shard(shape, base.cp), base.tp, sp):
            continue
        for method in _cp_methods(shape, base, pinned):
            for ep in _ep_options(shape, base.dp_shard * base.cp, pinned):
                layout = _with(base, cp_method=method, ep=ep)
                yield from _variants(shape, work, world, layout, pinned)


def _cp_methods(shape: ModelShape, base: Layout, pinned: Pinned) -> list[str]:
    """Context-parallel attention methods to search on grid ``base``: the fixed one, else
    ``ring`` (any cp the sequence allows takes it). Ring saves nothing beyond the local q,
    k, v and output (as little as alltoall, less than allgather's gathered keys and
    values), and it hides its exchange behind attention: the best start. The others can still win
    where their exchange is cheaper (all-to-all sends a share of the tokens that does not
    grow with cp); :func:`_other_cp_methods` tries them on the best layouts found."""
    if pinned.given("cp_method") or base.cp == 1:
        return [pinned.layout.cp_method]
    return ["ring"]


def _other_cp_methods(found: list[Candidate]) -> Iterator[Layout]:
    """The other attention methods of the first :data:`CP_METHOD_RETRIES` layouts of
    ``found`` (fastest first) with context parallelism."""
    for layout in [c.layout for c in found if c.layout.cp > 1][:CP_METHOD_RETRIES]:
        for method in CP_METHODS:
            if method != layout.cp_method:
                yield dataclasses.replace(layout, cp_method=method)


def _ep_options(shape: ModelShape, dp_shard: int, pinned: Pinned) -> list[int]:
    """Expert-parallel sizes to try on a grid of ``dp_shard``: the fixed one, else every
    divisor of ``dp_shard`` that divides the experts (1 for a dense model): the sizes
    :func:`plait.layout.check_ep` takes, in increasing order, found among the divisors of
    the two counts' greatest common divisor rather than by asking it of every size up
    to ``dp_shard``."""
    if pinned.given(EP):
        return [pinned.layout.ep]
    common = math.gcd(shape.experts, dp_shard) if shape.experts else 1
    return [d for d in range(1, common + 1) if common % d == 0]


def _variants(
    shape: ModelShape, work: Workload, world: World, base: Layout, pinned: Pinned
) -> Iterator[Layout]:
    """The schedules, stages per rank and microbatch counts of grid ``base`` that can
    run (the layout rules decide), each with the checkpointing and resharding options."""
    local = work.global_batch // base.dp
    if base.pp == 1:
        names = [base.schedule]  # without a pipeline the schedule does not matter
    elif pinned.given("schedule"):
        names = [pinned.layout.schedule]
    else:
        names = list(SCHEDULES)
    for name in names:
        spec = find_schedule(SCHEDULES, name)
        assert spec is not None  # plan() refused an unknown one
        v = pinned.layout.stages_per_rank
        if not pinned.given("stages_per_rank"):
            v = default_stages_per_rank(spec, base.pp)
        staged = _with(base, schedule=spec.name, stages_per_rank=v)
        counts: tuple[int, ...] = (pinned.layout.microbatches,)
        if not pinned.given("microbatches"):
            counts = _microbatch_options(local, max(fewest_microbatches(staged, spec), base.pp))
        for m in counts:
            layout = _with(staged, microbatches=m)
            if not check(layout, shape, work.global_batch, world, SCHEDULES):
                yield from _options(layout, pinned)


def stages_options(layout: Layout, layers: int) -> list[int]:
    """Stages per rank to try on pipelined ``layout`` besides its own: none for a
    schedule of a fixed number (one stage per rank, the V schedules' 2) or without a
    pipeline; for an interleaved one, from its least (2) doubling, and one block per stage
    (``layers // pp``). More stages shrink the bubble and cost more sends and more
    activations in flight, which the prediction weighs."""
    spec = find_schedule(SCHEDULES, layout.schedule)
    if layout.pp == 1 or spec is None or spec.stages_per_rank is not None:
        return []
    least = default_stages_per_rank(spec, layout.pp)
    most = (layers + 2 * layout.end_blocks) // layout.pp
    options = {least, most} if most >= least else set()
    v = least * 2
    while v < most:
        options.add(v)
        v *= 2
    return sorted(options - {layout.stages_per_rank})


def _other_stages(found: list[Candidate], layers: int) -> Iterator[Layout]:
    """The other stages per rank (:func:`stages_options`) of the first
    :data:`STAGES_RETRIES` interleaved layouts of ``found`` (fastest first), at their
    microbatch counts. Searched after the rest, not with it: every new pipeline shape is a
    schedule to generate, and most are far from the best."""
    tried = [c.layout for c in found if stages_options(c.layout, layers)]
    for layout in tried[:STAGES_RETRIES]:
        for v in stages_options(layout, layers):
            yield dataclasses.replace(layout, stages_per_rank=v)


def _weighted_ends(found: list[Candidate], layers: int, stages: bool) -> Iterator[Layout]:
    """The first :data:`STAGES_RETRIES` pipelined layouts of ``found`` (fastest first)
    with the embedding and the head weighing a block each (``end_blocks=1``, torchtitan's
    default: the end stages lighter, and one block per stage reachable with two stages
    more, as in Llama 3 405B's 126 blocks over 16 x 8), at their own stages per rank and,
    with ``stages`` (not fixed), the others (:func:`stages_options`). Searched after the
    other stages per rank, for the same reason."""
    piped = [c.layout for c in found if c.layout.pp > 1 and c.layout.end_blocks == 0]
    seen = {c.layout for c in found}  # two layouts' variants may meet (x2 and x7 give x8)
    for layout in piped[:STAGES_RETRIES]:
        ended = dataclasses.replace(layout, end_blocks=1)
        for v in [layout.stages_per_rank, *(stages_options(ended, layers) if stages else [])]:
            variant = dataclasses.replace(ended, stages_per_rank=v)
            if variant not in seen:
                seen.add(variant)
                yield variant


BOUNDS = (1, 2, 3)
"""The bounds on a pipeline rank's gathered stages (``max_active_stages``) tried when no
layout fits without one: below the rank's stages, up to torch's runtime's 3."""


def _bounded(layouts: Iterator[Layout]) -> Iterator[Layout]:
    """The pipelined ``layouts`` of more than one stage per rank, with each bound of
    :data:`BOUNDS` below their stages per rank."""
    for layout in layouts:
        if layout.pp > 1:
            for bound in BOUNDS:
                if bound < layout.stages_per_rank:
                    yield _with(layout, max_active_stages=bound)


def _options(layout: Layout, pinned: Pinned) -> Iterator[Layout]:
    """``layout`` with each checkpointing mode and each ``reshard_after_forward`` that
    matters (only ``fully_shard`` without a pipeline reshards between the passes)."""
    acs = [pinned.layout.ac] if pinned.given("ac") else AC_SEARCHED
    sharded = layout.dp_shard * layout.cp > 1  # fully_shard shards over dp_shard x cp
    reshards = [True] if not sharded or layout.pp > 1 else [True, False]
    if pinned.given("reshard_after_forward"):
        reshards = [pinned.layout.reshard_after_forward]
    for ac in acs:
        for reshard in reshards:
            yield _with(layout, ac=ac, reshard_after_forward=reshard)


def plan(
    model: ModelSpec,
    work: Workload,
    device: DeviceSpec,
    gpus: int,
    *,
    memory_fraction: float = 0.9,
    efficiency: float = EFFICIENCY,
    zero: int = 0,
    recipe: str = "plait",
    software: Software | None = None,
    **fixed: int | str | bool | None,
) -> list[Candidate]:
    """Every layout of ``gpus`` devices that fits, fastest first (module docstring).

    ``zero`` (1 or 2): also search ZeRO data parallelism (:class:`PlanLayout`: every
    layout with ``dp_shard`` 1, ``ep`` 1 and more than one ``dp_replicate x cp`` rank gets
    a ZeRO variant beside plait's own); ``recipe``: whose activations the memory model
    counts (``"megatron"``: every layout is a :class:`PlanLayout` of that recipe). Both
    describe other frameworks: ``plait train`` runs neither (the default, 0 and
    ``"plait"``, searches only what it runs).

    ``fixed``: fields of :class:`~plait.layout.Layout` (``tp=8``, ``ac="full"``); those
    given fix that part of the layout, those left out or ``None`` are searched (TypeError
    for other names). ``device.gpus_per_node`` bounds tp. Raises :class:`PlanError` for
    fixed fields no layout can have (sizes that do not divide ``gpus``, a ``tp`` that does
    not divide the model, ...), no possible layout, or no layout that fits (the message
    gives the smallest peak memory found).
    """
    pinned = pin(fixed)
    _check_frameworks(zero, recipe, pinned)
    shape = model_shape(model, work)
    world = World(gpus, "--gpus", "devices", named=f"--gpus {gpus}")
    check_pinned(model, shape, world, pinned)
    if not pinned.given(CP) and work.seq_len < CP_SEARCH_MIN_SEQ:
        pinned = Pinned(pinned.layout, pinned.names | {CP})  # cp 1: see CP_SEARCH_MIN_SEQ
    budget = memory_fraction * device.memory
    pricing = Pricing(model, work, device, budget, efficiency, software)
    grid = _layouts(shape, work, world, device.gpus_per_node, pinned)
    fitting, smallest = _price_all(pricing, _flavours(grid, zero, recipe))
    if not fitting and not pinned.given("max_active_stages"):
        # Nothing fits with every local stage gathered: bound how many are (as torch's
        # runtime holds 3), at the price of gathering stages again.
        grid = _layouts(shape, work, world, device.gpus_per_node, pinned)
        fitting, least = _price_all(pricing, _flavours(_bounded(grid), zero, recipe))
        if least is not None and (smallest is None or least[0] < smallest[0]):
            smallest = least
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
    fitting.sort(key=fastest)
    stages = not pinned.given("stages_per_rank")
    if stages:
        fitting += pricing.fitting(_other_stages(fitting, model.layers), shape, world)
        fitting.sort(key=fastest)
    if not pinned.given("end_blocks"):
        fitting += pricing.fitting(_weighted_ends(fitting, model.layers, stages), shape, world)
        fitting.sort(key=fastest)
    if not pinned.given("cp_method"):
        fitting += pricing.fitting(_other_cp_methods(fitting), shape, world)
        fitting.sort(key=fastest)
    return fitting


def _check_frameworks(zero: int, recipe: str, pinned: Pinned) -> None:
    """PlanError for a ZeRO stage or recipe the planner does not know, or ZeRO with fixed
    fields it cannot have (it keeps parameters whole)."""
    if zero not in ZERO_STAGES or recipe not in RECIPES:
        raise PlanError(
            f"--zero {zero} --recipe {recipe}: ZeRO stages are 0, 1, 2; recipes "
            f"{', '.join(RECIPES)}"
        )
    if zero and (
        (pinned.given(DP_SHARD) and pinned.layout.dp_shard > 1)
        or (pinned.given(EP) and pinned.layout.ep > 1)
    ):
        raise PlanError(
            f"--zero {zero} shards the optimizer over dp_replicate x cp and keeps parameters "
            "whole: it needs --dp-shard 1 and --ep 1 (drop them, or drop --zero)"
        )


def _price_all(
    pricing: Pricing, layouts: Iterator[Layout]
) -> tuple[list[Candidate], tuple[float, Layout] | None]:
    """The candidates of ``layouts`` that fit, and the smallest peak memory of any layout
    with its layout (None when plait's schedules refuse every one)."""
    fitting: list[Candidate] = []
    smallest: tuple[float, Layout] | None = None
    for layout in layouts:
        priced = pricing.price(layout)
        if priced is None:
            continue  # a shape plait's schedules refuse
        peak, candidate = priced
        if smallest is None or peak < smallest[0]:
            smallest = (peak, layout)
        if candidate is not None:
            fitting.append(candidate)
    return fitting, smallest


def _flavours(layouts: Iterator[Layout], zero: int, recipe: str) -> Iterator[Layout]:
    """``layouts`` as :func:`plan`'s ``zero`` and ``recipe`` ask: as they are (plait's),
    as :class:`PlanLayout` s of ``recipe``, and with ``zero`` a ZeRO variant of each that
    can have one (``dp_shard`` 1, ``ep`` 1, a ``dp_replicate x cp`` group; one of the
    ``reshard_after_forward`` twins, which ZeRO does not have)."""
    if recipe == "plait" and not zero:
        yield from layouts  # plait's own: as they are
        return
    for layout in layouts:
        fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(Layout)}
        yield layout if recipe == "plait" else PlanLayout(**fields, recipe=recipe)
        zeroable = layout.dp_shard == 1 and layout.ep == 1 and layout.reshard_after_forward
        if zero and zeroable and layout.dp_replicate * layout.cp > 1:
            yield PlanLayout(**fields, zero=zero, recipe=recipe)
