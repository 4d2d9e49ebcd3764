"""Pipeline schedules as pure functions: (ranks, stages, microbatches) -> per-rank actions.

No process group, no tensors: each generator returns the compute order of every rank
(F / B, or F / I / W for split backward), the same on every rank, so a schedule can be
printed, validated and simulated anywhere. Two passes lower it for the runtime:
:func:`add_communication` (sends and receives between ranks) and :func:`add_fsdp_actions`
(unshard, reshard, gradient reduction). :func:`generate` dispatches by torch's names.

Microbatches: every schedule but DualPipeV accepts any ``n_microbatches >= 1`` (DualPipeV
needs one per stage, as in torch). The interleaved ones run
microbatches depth-first in ``max(1, m // n_ranks)`` groups, each group through every local
stage in turn (Megatron's order). torch requires equal groups (m a multiple of the group
count) and then generates exactly this order; plait also takes other counts by making the
first ``m % groups`` groups one microbatch larger. Larger groups first keeps the warm-up,
sized by the first group, deadlock-free (checked exhaustively up to 8 ranks, 4 stages per
rank, 32 microbatches).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from plait.pipeline.actions import (
    Action,
    ActionKind,
    OverlappedPair,
    Schedule,
    Style,
)
from plait.pipeline.lowering import add_communication

__all__ = [
    "SCHEDULES",
    "ScheduleSpec",
    "add_communication",
    "add_fsdp_actions",
    "dualpipe_v",
    "dualpipe_v_pairs",
    "generate",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "looped_bfs",
    "one_f_one_b",
    "schedule_spec",
    "zbv_zero_bubble",
]

K = ActionKind


def _run(stage: int, kind: ActionKind, microbatches: Iterable[int]) -> list[Action]:
    return [Action(stage, kind, i) for i in microbatches]


def _interleave(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then one forward and one backward at a time, then the rest."""
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for fwd, bwd in zip(forwards[warmup:], backwards, strict=False):
        order += [fwd, bwd]
    return order + backwards[len(forwards) - warmup :]


def _delay_weights(order: list[Action], lag: int) -> list[Action]:
    """Add the W of every I, ``lag`` I's later (to fill bubbles); left-overs go at the end."""
    inputs = [a for a in order if a.kind is K.BACKWARD_INPUT]
    weights = [Action(a.stage, K.BACKWARD_WEIGHT, a.microbatch) for a in inputs]
    out: list[Action] = []
    seen = 0
    for action in order:
        out.append(action)
        if action.kind is K.BACKWARD_INPUT:
            seen += 1
            if seen > lag:
                out.append(weights[seen - lag - 1])
    return out + weights[max(0, len(inputs) - lag) :]


def gpipe(n_ranks: int, n_microbatches: int) -> Schedule:
    """All forwards, then all backwards; one stage per rank. Peak memory: every microbatch."""
    m = range(n_microbatches)
    return {r: _run(r, K.FORWARD, m) + _run(r, K.FULL_BACKWARD, m) for r in range(n_ranks)}


def one_f_one_b(n_ranks: int, n_microbatches: int) -> Schedule:
    """Rank r runs n_ranks - 1 - r warm-up forwards, then alternates F and B, then drains.

    One stage per rank; at most n_ranks activations live on any rank.
    """
    m = range(n_microbatches)
    return {
        r: _interleave(_run(r, K.FORWARD, m), _run(r, K.FULL_BACKWARD, m), n_ranks - 1 - r)
        for r in range(n_ranks)
    }


def _groups(n_ranks: int, m: int) -> list[int]:
    """Microbatch group sizes for the interleaved schedules: max(1, m // n_ranks) groups of
    near-equal size, larger first, so every group but a lone one has >= n_ranks."""
    rounds = max(1, m // n_ranks)
    size, extra = divmod(m, rounds)
    return [size + 1] * extra + [size] * (rounds - extra)


def _depth_first(rank: int, n_ranks: int, n_local: int, m: int, kind: ActionKind) -> list[Action]:
    """Megatron's order of (local stage, microbatch): group after group, each group through
    every local stage in turn (last stage first for backwards)."""
    chunks = range(n_local) if kind is K.FORWARD else range(n_local - 1, -1, -1)
    order: list[Action] = []
    first = 0
    for size in _groups(n_ranks, m):
        for c in chunks:
            order += _run(c * n_ranks + rank, kind, range(first, first + size))
        first += size
    return order


def _megatron(n_ranks: int, n_stages: int, m: int, backward: ActionKind, hops: int) -> Schedule:
    """Megatron's order for v = n_stages / n_ranks looped stages per rank: depth-first
    forwards and ``backward`` actions, alternating after rank r's warm-up of
    (v - 1) * group + hops * (n_ranks - 1 - r) forwards (group: the first group's size)."""
    v, first_group = n_stages // n_ranks, _groups(n_ranks, m)[0]
    return {
        r: _interleave(
            _depth_first(r, n_ranks, v, m, K.FORWARD),
            _depth_first(r, n_ranks, v, m, backward),
            min(v * m, (v - 1) * first_group + hops * (n_ranks - 1 - r)),
        )
        for r in range(n_ranks)
    }


def interleaved_1f1b(n_ranks: int, n_stages: int, n_microbatches: int) -> Schedule:
    """Megatron's interleaved 1F1B: v = n_stages / n_ranks looped stages per rank.

    Rank r warms up with (v - 1) * group + 2 * (n_ranks - 1 - r) forwards (group: the
    first microbatch group's size), then alternates F and B in depth-first order. With
    n_microbatches >= n_ranks and equal F / B costs per stage, the bubble fraction is
    (p - 1) / (v * m + p - 1): 1F1B's idle time against v times the work per rank.
    """
    return _megatron(n_ranks, n_stages, n_microbatches, K.FULL_BACKWARD, hops=2)


def interleaved_zero_bubble(n_ranks: int, n_stages: int, n_microbatches: int) -> Schedule:
    """Interleaved zero bubble (ZB1P): interleaved 1F1B with the backward split into I and W.

    Warm-up is one forward per hop shorter than interleaved 1F1B ((v - 1) * group +
    n_ranks - 1 - r), and rank r runs each W r I's after its I, so W's fill the time that
    the next I waits for its gradient.
    """
    order = _megatron(n_ranks, n_stages, n_microbatches, K.BACKWARD_INPUT, hops=1)
    return {r: _delay_weights(actions, lag=r) for r, actions in order.items()}


def looped_bfs(n_ranks: int, n_stages: int, n_microbatches: int) -> Schedule:
    """Breadth-first: per local stage every forward; then per local stage, last first,
    every backward (last microbatch first)."""
    m = range(n_microbatches)
    schedule: Schedule = {}
    for r in range(n_ranks):
        stages = range(r, n_stages, n_ranks)
        schedule[r] = [a for s in stages for a in _run(s, K.FORWARD, m)]
        schedule[r] += [a for s in reversed(stages) for a in _run(s, K.FULL_BACKWARD, reversed(m))]
    return schedule


class _VRank:
    """Emits one rank's ZB-V actions, counting microbatches per (local stage, kind)."""

    def __init__(self, rank: int, n_ranks: int) -> None:
        self.stages = (rank, 2 * n_ranks - 1 - rank)  # down the V, then back up
        self.counts: dict[tuple[int, ActionKind], int] = {}
        self.actions: list[Action] = []

    def count(self, chunk: int, kind: ActionKind) -> int:
        return self.counts.get((chunk, kind), 0)

    def emit(self, *steps: tuple[int, ActionKind]) -> None:
        for chunk, kind in steps:
            mb = self.count(chunk, kind)
            self.counts[chunk, kind] = mb + 1
            self.actions.append(Action(self.stages[chunk], kind, mb))


def zbv_zero_bubble(n_ranks: int, n_microbatches: int) -> Schedule:
    """ZB-V (zero-bubble paper, section 6): two stages per rank in a V, backward split I / W.

    Rank r holds stages r and 2 * n_ranks - 1 - r ("v" placement). The phases follow the
    paper's figure for n = max(n_microbatches, 2 * n_ranks - 1) microbatches; the actions
    of padding microbatches are then dropped. With F, I and W of equal cost and
    n_microbatches >= 2 * n_ranks - 1, each rank idles only the n_ranks - 1 units of
    start-up and drain that no schedule avoids, and holds at most 2 * n_ranks half-size
    activations: 1F1B's memory.
    """
    p, n = n_ranks, max(n_microbatches, 2 * n_ranks - 1)
    fwd, inp, wgt = K.FORWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT
    schedule: Schedule = {}
    for r in range(p):
        v = _VRank(r, p)
        for _ in range(2 * (p - r) - 1):  # fill the way down
            v.emit((0, fwd))
        for _ in range(r):
            v.emit((1, fwd), (0, fwd))
        for _ in range(p - r):  # the first gradients come back up
            v.emit((1, fwd), (1, inp), (1, wgt))
        while v.count(0, fwd) < n or v.count(1, fwd) < v.count(0, fwd):  # steady state
            if v.count(0, fwd) < n:
                v.emit((0, fwd))
            v.emit((0, inp), (0, wgt), (1, fwd), (1, inp), (1, wgt))
        for _ in range(r):  # drain: inputs first, weights fill the gaps
            v.emit((0, inp), (1, inp))
        for _ in range(p - r):
            v.emit((0, inp), (0, wgt))
        while v.count(1, wgt) < v.count(1, inp):
            v.emit((1, wgt))
        while v.count(0, wgt) < v.count(0, inp):
            v.emit((0, wgt))
        schedule[r] = [
            a for a in v.actions if a.microbatch is not None and a.microbatch < n_microbatches
        ]
    return schedule


class _DualVRank:
    """Emits one rank's DualPipeV actions. Forwards and backwards (B or I) are counted per
    local stage; each I queues its W, which the next :meth:`weight` emits (oldest first);
    the overlapped pairs are noted in ``pairs``."""

    def __init__(self, rank: int, n_ranks: int) -> None:
        self.stages = (rank, 2 * n_ranks - 1 - rank)  # down the V, then back up
        self.forwards = [0, 0]
        self.backwards = [0, 0]
        self.weights: deque[Action] = deque()
        self.actions: list[Action] = []
        self.pairs: list[OverlappedPair] = []

    def forward(self, chunk: int) -> None:
        self.actions.append(Action(self.stages[chunk], K.FORWARD, self.forwards[chunk]))
        self.forwards[chunk] += 1

    def backward(self, chunk: int, split: bool = False) -> None:
        """B, or I with its W queued when ``split``."""
        stage, mb = self.stages[chunk], self.backwards[chunk]
        self.actions.append(Action(stage, K.BACKWARD_INPUT if split else K.FULL_BACKWARD, mb))
        if split:
            self.weights.append(Action(stage, K.BACKWARD_WEIGHT, mb))
        self.backwards[chunk] += 1

    def weight(self) -> None:
        """The oldest queued W, if any (a gap with nothing queued stays empty)."""
        if self.weights:
            self.actions.append(self.weights.popleft())

    def overlapped(self, forward_chunk: int, backward_chunk: int, pair: bool = True) -> None:
        """F of one chunk, then B of the other, back to back: an overlapped pair, unless
        ``pair`` is False (torch keeps the last rank's first one apart)."""
        self.forward(forward_chunk)
        self.backward(backward_chunk)
        if pair:
            self.pairs.append(OverlappedPair(self.actions[-2], self.actions[-1]))


def dualpipe_v(n_ranks: int, n_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V): two stages per rank, whose steady
    state runs a forward of one local stage together with a backward of the other.

    Rank r holds stages r and 2 * n_ranks - 1 - r ("v" placement). Phases for rank r of p:
    2 * (p - 1 - r) forwards of stage 0 (local index); r + 1 pairs F0 F1; p - 1 - r rounds
    of I1 W1 F1; m - 2p + 1 + r rounds of the overlapped pairs (F0, B1) and (F1, B0); p - 1 - r
    rounds of B1 then (F1, B0); r + 1 rounds of B1 B0, switching to split backwards (I, W
    queued) half-way; p - 1 - r rounds of W then B0 / I0; r + 1 W's to drain.

    An overlapped pair is plain data here: the F action immediately followed by the B
    action (torch wraps the two in one ``OVERLAP_F_B`` action, which its runtime runs one
    after the other too; :func:`dualpipe_v_pairs` names the pairs). Equal to torch's order
    with each ``OVERLAP_F_B`` expanded. :func:`~plait.pipeline.simulate.simulate` times a
    pair as its F then its B: the overlap DualPipe is after (one chunk's compute hiding the
    other's all-to-all) happens inside the layers, below this cost model. Requires
    n_microbatches >= 2 * n_ranks (torch's constraint: at least one microbatch per stage);
    ValueError otherwise.
    """
    return {r: v.actions for r, v in enumerate(_dualpipe_v_ranks(n_ranks, n_microbatches))}


def dualpipe_v_pairs(n_ranks: int, n_microbatches: int) -> dict[int, list[OverlappedPair]]:
    """Per rank, the overlapped pairs of :func:`dualpipe_v`'s order: torch's
    ``OVERLAP_F_B`` actions (the steady state's pairs, but the last rank's first one,
    which torch runs as a plain F then B)."""
    return {r: v.pairs for r, v in enumerate(_dualpipe_v_ranks(n_ranks, n_microbatches))}


def _dualpipe_v_ranks(p: int, m: int) -> list[_DualVRank]:
    if p < 1 or m < 2 * p:
        raise ValueError(
            f"DualPipeV needs n_microbatches >= n_stages = 2 * n_ranks, got n_ranks={p}, "
            f"n_microbatches={m}: use at least {2 * max(p, 1)} microbatches"
        )
    ranks = []
    for r in range(p):
        v = _DualVRank(r, p)
        for _ in range(2 * (p - 1 - r)):
            v.forward(0)
        for _ in range(r + 1):
            v.forward(0)
            v.forward(1)
        for _ in range(p - 1 - r):  # the first gradients turn at the bottom of the V
            v.backward(1, split=True)
            v.weight()
            v.forward(1)
        for i in range(m - 2 * p + 1 + r):  # steady state: two overlapped pairs a round
            v.overlapped(0, 1, pair=i > 0 or r < p - 1)
            v.overlapped(1, 0)
        for _ in range(p - 1 - r):
            v.backward(1)
            v.overlapped(1, 0)
        split, half = False, (r + 1) // 2
        for i in range(r + 1):  # cool-down: the later backwards split, W's fill the gaps
            split = split or (i == half and r % 2 == 1)
            v.backward(1, split)
            split = split or (i == half and r % 2 == 0)
            v.backward(0, split)
        for _ in range(p - 1 - r):
            v.weight()
            v.backward(0, split)
        for _ in range(r + 1):
            v.weight()
        ranks.append(v)
    return ranks


@dataclass(frozen=True)
class ScheduleSpec:
    """A named schedule: its placement, how many stages each rank holds, and the fewest
    microbatches it takes per stage of the pipeline (DualPipeV: one, as in torch)."""

    name: str
    style: Style
    build: Callable[[int, int, int], Schedule]  # (n_ranks, n_stages, n_microbatches)
    stages_per_rank: int | None  # None: any positive whole number
    min_microbatches_per_stage: int = 0
    pairs: Callable[[int, int], Mapping[int, list[OverlappedPair]]] | None = None
    """(n_ranks, n_microbatches) -> per rank, the overlapped pairs (DualPipeV's only)."""

    def min_microbatches(self, n_stages: int) -> int:
        """The fewest microbatches this schedule runs over ``n_stages`` stages."""
        return max(1, self.min_microbatches_per_stage * n_stages)


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("GPipe", "loop", lambda p, _s, m: gpipe(p, m), 1),
        ScheduleSpec("1F1B", "loop", lambda p, _s, m: one_f_one_b(p, m), 1),
        ScheduleSpec("Interleaved1F1B", "loop", interleaved_1f1b, None),
        ScheduleSpec("LoopedBFS", "loop", looped_bfs, None),
        ScheduleSpec("InterleavedZeroBubble", "loop", interleaved_zero_bubble, None),
        ScheduleSpec("ZBVZeroBubble", "v", lambda p, _s, m: zbv_zero_bubble(p, m), 2),
        ScheduleSpec("DualPipeV", "v", lambda p, _s, m: dualpipe_v(p, m), 2, 1, dualpipe_v_pairs),
    )
}


def schedule_spec(name: str) -> ScheduleSpec:
    """The registry entry for ``name``, case-insensitive; ValueError naming the known ones."""
    by_lower = {key.lower(): spec for key, spec in SCHEDULES.items()}
    if name.lower() not in by_lower:
        raise ValueError(f"Unknown schedule {name!r}; known: {list(SCHEDULES)}")
    return by_lower[name.lower()]


def generate(
    name: str,
    n_ranks: int,
    n_stages: int,
    n_microbatches: int,
    *,
    communication: bool = False,
    fsdp: bool = False,
) -> Schedule:
    """The schedule ``name`` (one of :data:`SCHEDULES`, case-insensitive) as per-rank actions.

    Compute actions only unless ``communication`` (adds sends / receives) or ``fsdp`` (adds
    UNSHARD / RESHARD / REDUCE_GRAD). Raises ValueError for an unknown name or an
    impossible shape: fewer than one rank, stage or microbatch; ``n_stages`` not a multiple
    of ``n_ranks``; a stages-per-rank count the schedule does not support (GPipe and 1F1B
    hold one stage per rank, ZB-V and DualPipeV exactly two); fewer microbatches than the
    schedule needs (DualPipeV: at least ``n_stages``, as torch requires).
    """
    spec = schedule_spec(name)
    if min(n_ranks, n_stages, n_microbatches) < 1:
        raise ValueError(
            f"{spec.name} needs n_ranks, n_stages and n_microbatches >= 1, got "
            f"n_ranks={n_ranks}, n_stages={n_stages}, n_microbatches={n_microbatches}"
        )
    fixed = spec.stages_per_rank
    if fixed is not None and n_stages != fixed * n_ranks:
        *some, last = [s.name for s in SCHEDULES.values() if s.stages_per_rank is None]
        others = f"; {', '.join(some)} and {last} hold any number"
        raise ValueError(
            f"{spec.name} holds {fixed} stage(s) per rank, so n_stages must be "
            f"{fixed * n_ranks} for {n_ranks} ranks, got n_stages={n_stages}"
            + (others if n_stages > n_ranks else "")
        )
    if n_stages % n_ranks:
        raise ValueError(
            f"{spec.name}: n_stages ({n_stages}) must be a multiple of n_ranks ({n_ranks}) "
            "so that every rank holds the same number of stages"
        )
    if n_microbatches < spec.min_microbatches(n_stages):
        raise ValueError(
            f"{spec.name} needs at least as many microbatches as stages: n_microbatches="
            f"{n_microbatches} < n_stages={n_stages}; use n_microbatches >= {n_stages}"
        )
    schedule = spec.build(n_ranks, n_stages, n_microbatches)
    if communication:
        schedule = add_communication(schedule, n_ranks, spec.style)
    return add_fsdp_actions(schedule) if fsdp else schedule


def add_fsdp_actions(schedule: Schedule, max_active_stages: int | None = None) -> Schedule:
    """Insert per-stage FSDP actions: ``REDUCE_GRAD`` right after a stage's last B / W,
    ``RESHARD`` right after its last compute (after REDUCE_GRAD when they coincide), and
    ``UNSHARD`` / ``RESHARD`` before compute actions as ``max_active_stages`` says. Works
    with or without communication.

    ``max_active_stages=None``: a stage is unsharded right before its first compute of the
    step and stays so until its last: one all-gather per stage and step, at the price of
    holding every local stage's full parameters through the middle of the schedule.
    ``max_active_stages=n`` (n >= 1) bounds that, as torch's runtime lowering does (its
    ``_add_unshard_reshard``, n=3 there): before each compute action, the next ``n``
    distinct stages this rank computes are the active ones; any other unsharded stage is
    resharded, and any active one not unsharded is unsharded. At most ``n`` stages are
    full at once, and a stage evicted between its computes is gathered again (its
    gradients accumulated so far stay: only the parameters are freed). Raises ValueError
    for ``n < 1``.
    """
    if max_active_stages is not None and max_active_stages < 1:
        raise ValueError(f"max_active_stages must be >= 1 (or None), got {max_active_stages}")
    if any(a.kind.is_fsdp for actions in schedule.values() for a in actions):
        raise ValueError("add_fsdp_actions: the schedule already has FSDP actions")
    out: Schedule = {}
    for rank, actions in schedule.items():
        compute = [(n, a) for n, a in enumerate(actions) if a.kind.is_compute]
        last = {a.stage: n for n, a in compute}
        grads = (K.FULL_BACKWARD, K.BACKWARD_WEIGHT)
        last_grad = {a.stage: n for n, a in compute if a.kind in grads}
        upcoming = [a.stage for _, a in compute]
        active: list[int] = []  # unsharded stages, in the order they were gathered
        out[rank] = rank_out = []
        computed = 0
        for n, a in enumerate(actions):
            if a.kind.is_compute:
                window = _next_stages(upcoming, computed, max_active_stages)
                computed += 1
                evicted = (
                    [] if max_active_stages is None else [s for s in active if s not in window]
                )
                for stage in evicted:
                    rank_out.append(Action(stage, K.RESHARD))
                    active.remove(stage)
                for stage in window:
                    if stage not in active:
                        rank_out.append(Action(stage, K.UNSHARD))
                        active.append(stage)
            rank_out.append(a)
            if last_grad.get(a.stage) == n:
                rank_out.append(Action(a.stage, K.REDUCE_GRAD))
            if last.get(a.stage) == n:
                rank_out.append(Action(a.stage, K.RESHARD))
                active.remove(a.stage)
    return out


def _next_stages(upcoming: list[int], start: int, limit: int | None) -> list[int]:
    """The first ``limit`` distinct stages of ``upcoming[start:]`` (``None``: just the
    first, the one about to run: without a bound a stage is gathered when first needed,
    never ahead, and never evicted)."""
    if limit is None:
        return upcoming[start : start + 1]
    window: list[int] = []
    for stage in upcoming[start:]:
        if stage not in window:
            window.append(stage)
            if len(window) == limit:
                break
    return window
