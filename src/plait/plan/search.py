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
:func:`stages_options` (:func:`_other_stages`). ZeRO data parallelism and Megatron-LM's
activations (:class:`~plait.plan.spec.PlanLayout`) only when asked (``zero``, ``recipe``):
plait train runs neither. Fixed flags pin their field.
A layout fits when its peak rank's memory is at most ``memory_fraction`` of the
device's (the rest: allocator, CUDA context, workspaces). Memory is predicted first and
timing only for what fits; the pipeline's figures (makespan, bubble, activation peaks)
are closed-form for every schedule but ZBVZeroBubble below ``2 pp`` microbatches and
cached by (schedule, pp, stages, microbatches) (:mod:`plait.plan.schedule`), so no
schedule of a hundred thousand actions is generated; the ``ep`` sizes come from the
divisors of a gcd and layouts are copied without :func:`dataclasses.replace`. A cold
10,240-device search of Llama 3.1 405B (``plait plan --preset llama3-405b --gpus
10240``) takes about 1 s of CPU (``tests/test_plan_speed.py`` holds it under 2 s), most
of it the memory of its 20,000 layouts; 1,024 devices of Llama 3.1 8B under 1 s. Every
shortcut gives the same candidates, figures to the bit, as the search without it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from plait.layout import (
    CP,
    CP_METHODS,
    DP_SHARD,
    EP,
    LAYOUT_FIELDS,
    PP,
    TP,
    Layout,
    ModelShape,
    Reason,
    World,
    check,
    check_batch,
    check_cp,
    check_ep,
    check_microbatches,
    check_schedule,
    check_sizes,
    check_stages,
    check_stages_per_rank,
    check_tp,
    check_world,
    cp_shard,
    default_stages_per_rank,
    fewest_microbatches,
    find_schedule,
    grids,
    moe_tp_width,
    tp_splits,
)
from plait.pipeline.schedules import SCHEDULES
from plait.plan.memory import peak_memory
from plait.plan.schedule import layout_shape
from plait.plan.shards import fsdp_ranks
from plait.plan.spec import (
    RECIPES,
    ZERO_STAGES,
    DeviceSpec,
    MemoryBreakdown,
    ModelSpec,
    PlanLayout,
    Software,
    Workload,
    zero_stage,
)
from plait.plan.spec import recipe as recipe_of
from plait.plan.timing import EFFICIENCY, Timing, predict_time

__all__ = [
    "AC_SEARCHED",
    "CP_METHOD_RETRIES",
    "CP_MIN_TOKENS",
    "CP_SEARCH_MIN_SEQ",
    "STAGES_RETRIES",
    "Candidate",
    "PlanError",
    "evaluate",
    "model_shape",
    "plan",
    "stages_options",
]

AC_SEARCHED = ("none", "selective", "full")
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


class PlanError(ValueError):
    """Input the planner cannot plan for; the message says what to change."""


@dataclass(frozen=True)
class Candidate:
    """One evaluated layout: its peak rank's memory, predicted time, and whether it fits."""

    layout: Layout
    memory: MemoryBreakdown
    timing: Timing
    fits: bool


@dataclass(frozen=True)
class _Pricing:
    """What pricing a layout needs besides the layout: the model, its work, the device,
    the memory budget and the cost model's settings (one for :func:`plan`'s grid and its
    retries alike, so they price the same way)."""

    model: ModelSpec
    work: Workload
    device: DeviceSpec
    budget: float
    efficiency: float
    software: Software | None

    def price(self, layout: Layout) -> tuple[float, Candidate | None] | None:
        """``layout``'s peak memory per rank and, when it fits the budget, its candidate
        (timed only then); None for a pipeline shape plait's schedules refuse."""
        try:
            pipeline = layout_shape(self.model, layout)
        except ValueError:
            return None
        memory = peak_memory(self.model, layout, self.work, pipeline)
        if memory.total > self.budget:
            return memory.total, None
        timing = predict_time(
            self.model,
            layout,
            self.work,
            self.device,
            pipeline,
            self.efficiency,
            software=self.software,
        )
        return memory.total, Candidate(layout, memory, timing, True)

    def fitting(
        self, layouts: Iterator[Layout], shape: ModelShape, world: World
    ) -> list[Candidate]:
        """The candidates of ``layouts`` that the rules allow and that fit."""
        found = []
        for layout in layouts:
            if check(layout, shape, self.work.global_batch, world, SCHEDULES):
                continue
            priced = self.price(layout)
            if priced is not None and priced[1] is not None:
                found.append(priced[1])
        return found


def model_shape(model: ModelSpec, work: Workload) -> ModelShape:
    """What the layout rules need of ``model`` running ``work``.

    The MLP width tensor parallelism must divide: a MoE block's is its shared experts'
    (its routed experts' matrices are split by ``ep``, not ``tp``: tp splits their rows,
    not their widths; without shared experts none, as ``plait train`` states it), the
    dense blocks' as well when there are some."""
    m = model
    ffn = m.ffn_hidden
    if m.experts:
        shared = moe_tp_width(m.expert_hidden, m.shared_experts, m.d_model)
        ffn = math.gcd(shared, m.ffn_hidden) if m.dense_layers else shared
    shape = (m.layers, m.heads, m.kv_heads, m.d_model, ffn, m.vocab, work.seq_len)
    return ModelShape(*shape, experts=m.experts)


def evaluate(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    *,
    memory_fraction: float = 0.9,
    efficiency: float = EFFICIENCY,
    software: Software | None = None,
) -> Candidate:
    """Memory and time of one layout (no search). ValueError for a shape plait refuses.
    ``software``: the framework's kernels and overlaps (:class:`Software`; plait's)."""
    shape = layout_shape(model, layout)
    memory = peak_memory(model, layout, work, shape)
    timing = predict_time(model, layout, work, device, shape, efficiency, software=software)
    return Candidate(layout, memory, timing, memory.total <= memory_fraction * device.memory)


@dataclass(frozen=True)
class _Pinned:
    """The layout fields the caller fixed: their values in ``layout`` (the others keep
    :class:`Layout`'s defaults), their names in ``names``."""

    layout: Layout
    names: frozenset[str]

    def given(self, name: str) -> bool:
        return name in self.names

    @property
    def sizes(self) -> dict[str, int | None]:
        """The fixed mesh sizes, None for those to search."""
        return {d: size if self.given(d) else None for d, size in self.layout.sizes.items()}


def _pin(fixed: Mapping[str, int | str | bool | None]) -> _Pinned:
    unknown = sorted(set(fixed) - set(LAYOUT_FIELDS))
    if unknown:
        raise TypeError(
            f"plan() got unexpected keyword argument(s) {', '.join(unknown)}: the layout "
            f"fields are {', '.join(LAYOUT_FIELDS)}"
        )
    given: dict[str, Any] = {name: value for name, value in fixed.items() if value is not None}
    return _Pinned(Layout(**given), frozenset(given))


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
    shape: ModelShape, work: Workload, world: World, per_node: int, pinned: _Pinned
) -> Iterator[Layout]:
    sp = pinned.layout.sequence_parallel
    for grid in grids(pinned.sizes, world.size):
        base = Layout(sequence_parallel=sp).with_sizes(grid)
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


def _cp_methods(shape: ModelShape, base: Layout, pinned: _Pinned) -> list[str]:
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


def _ep_options(shape: ModelShape, dp_shard: int, pinned: _Pinned) -> list[int]:
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
    shape: ModelShape, work: Workload, world: World, base: Layout, pinned: _Pinned
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
    most = layers // layout.pp
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


def _options(layout: Layout, pinned: _Pinned) -> Iterator[Layout]:
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


def _check_pinned(model: ModelSpec, shape: ModelShape, world: World, pinned: _Pinned) -> None:
    """PlanError for fixed fields no layout can have."""
    counts = {
        name: getattr(pinned.layout, name) for name in ("stages_per_rank", "microbatches", EP)
    }
    sizes = {**pinned.sizes, **{k: v for k, v in counts.items() if pinned.given(k)}}
    _refuse(check_sizes({"gpus": world.size, **sizes}) or check_world(pinned.sizes, world))
    if pinned.given(CP):
        # The method's own rule only when it is fixed (else another method may do), with
        # the tp it splits the heads with when that is fixed too.
        method = pinned.layout.cp_method if pinned.given("cp_method") else "ring"
        tp = pinned.layout.tp if pinned.given(TP) else 1
        _refuse(check_cp(shape, pinned.layout.cp, method, tp))
    if pinned.given(TP):
        tp = pinned.layout.tp
        local = cp_shard(shape, pinned.layout.cp)  # tp splits a cp rank's share
        for split in tp_splits(local, pinned.layout.sequence_parallel and tp > 1):
            if split.size % tp:
                raise PlanError(
                    f"--tp {tp} does not divide {split.what} of {model.name}: use a --tp "
                    f"that divides {split.size}"
                )
    if pinned.given("ac") and pinned.layout.ac not in AC_SEARCHED:
        raise PlanError(f"--ac {pinned.layout.ac}: the planner models {', '.join(AC_SEARCHED)}")
    if pinned.given("schedule"):
        _refuse(check_schedule(SCHEDULES, pinned.layout.schedule))
    if pinned.given(PP):
        _refuse(_pipeline_reasons(shape, pinned))
    if pinned.given(EP):
        _refuse(_ep_reasons(shape, world, pinned))


def _ep_reasons(shape: ModelShape, world: World, pinned: _Pinned) -> list[Reason]:
    """What rules out a fixed ``ep``: the experts it must split, and the ``dp_shard`` it
    takes its ranks from (fixed, or at most what the devices leave)."""
    ep = pinned.layout.ep
    if pinned.given(DP_SHARD):
        return check_ep(shape, ep, pinned.layout.dp_shard * pinned.layout.cp)
    others = math.prod(size or 1 for d, size in pinned.sizes.items() if d != DP_SHARD)
    room = world.size // others if world.size % others == 0 else world.size
    reasons = check_ep(shape, ep, room)
    if shape.experts and shape.experts % ep == 0 and room % ep:
        # Not check_ep's message: dp_shard is searched, there is no --dp-shard to change.
        message = (
            f"--ep {ep} takes its ranks from dp_shard, but the {world.size} devices leave "
            f"dp_shard {room} (or a divisor of it), not a multiple of {ep}: use an --ep "
            f"that divides {room}"
        )
        reasons = [Reason(EP, message)]
    return reasons


def _pipeline_reasons(shape: ModelShape, pinned: _Pinned) -> list[Reason]:
    """What rules out a fixed pipeline size with the other fixed fields: the blocks, and
    with a fixed schedule (else the others are searched) its stages and microbatches."""
    spec = find_schedule(SCHEDULES, pinned.layout.schedule)
    assert spec is not None  # known: checked, or the default
    if pinned.given("stages_per_rank"):
        v = pinned.layout.stages_per_rank
    elif pinned.given("schedule"):
        v = default_stages_per_rank(spec, pinned.layout.pp)
    else:
        v = 1  # the fewest stages a pipeline of this many ranks has
    staged = dataclasses.replace(pinned.layout, stages_per_rank=v)
    reasons = check_stages(shape, staged)
    if pinned.given("schedule") or staged.pp == 1:
        reasons += check_stages_per_rank(staged, spec, SCHEDULES)
        if pinned.given("microbatches"):
            reasons += check_microbatches(staged, spec)
    return reasons


def _refuse(reasons: list[Reason]) -> None:
    if reasons:
        raise PlanError(reasons[0].message)


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
    pinned = _pin(fixed)
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
    shape = model_shape(model, work)
    world = World(gpus, "--gpus", "devices", named=f"--gpus {gpus}")
    _check_pinned(model, shape, world, pinned)
    if not pinned.given(CP) and work.seq_len < CP_SEARCH_MIN_SEQ:
        pinned = _Pinned(pinned.layout, pinned.names | {CP})  # cp 1: see CP_SEARCH_MIN_SEQ
    fitting: list[Candidate] = []
    smallest: tuple[float, Layout] | None = None
    budget = memory_fraction * device.memory
    pricing = _Pricing(model, work, device, budget, efficiency, software)
    grid = _layouts(shape, work, world, device.gpus_per_node, pinned)
    for layout in _flavours(grid, zero, recipe):
        priced = pricing.price(layout)
        if priced is None:
            continue  # a shape plait's schedules refuse
        peak, candidate = priced
        if smallest is None or peak < smallest[0]:
            smallest = (peak, layout)
        if candidate is not None:
            fitting.append(candidate)
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
    fitting.sort(key=_fastest)
    if not pinned.given("stages_per_rank"):
        fitting += pricing.fitting(_other_stages(fitting, model.layers), shape, world)
        fitting.sort(key=_fastest)
    if not pinned.given("cp_method"):
        fitting += pricing.fitting(_other_cp_methods(fitting), shape, world)
        fitting.sort(key=_fastest)
    return fitting


def _fastest(c: Candidate) -> tuple[float, float]:
    """Sort key: fastest first, then least memory."""
    return (-c.timing.tokens_per_s_per_device, c.memory.total)


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


def describe(layout: Layout) -> str:
    """A one-line summary of ``layout``, e.g. ``dp_shard=128 tp=8 ac=selective``."""
    parts = [f"{name}={size}" for name, size in layout.sizes.items() if size > 1]
    if layout.cp > 1:  # cp=4 -> cp=4/ring
        parts[parts.index(f"{CP}={layout.cp}")] += f"/{layout.cp_method}"
    if layout.ep > 1:
        parts.append(f"ep={layout.ep}")
    if layout.pp > 1:
        parts.append(f"{layout.schedule}x{layout.stages_per_rank}")
    if layout.microbatches > 1:
        parts.append(f"mb={layout.microbatches}")
    parts.append(f"ac={layout.ac}")
    if fsdp_ranks(layout) > 1 and not layout.reshard_after_forward:
        parts.append("no-reshard")
    if zero_stage(layout):
        parts.append(f"zero={zero_stage(layout)}")
    if recipe_of(layout) != "plait":
        parts.append(f"recipe={recipe_of(layout)}")
    return " ".join(parts) or "single device"
