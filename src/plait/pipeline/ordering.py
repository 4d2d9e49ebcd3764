"""A schedule's order, from what a schedule class is given to what every rank runs.

Pure: functions over actions and placements, no process group and no tensors, so every
rule here is checked in one process. A schedule class gets its order from one of three
sources, and each ends in the same :func:`install`:

* :func:`generated`: a name of :data:`~plait.pipeline.schedules.SCHEDULES` (its compute
  order, placement and, for DualPipeV, overlapped pairs);
* :func:`forward_only`: torch's private forward-only schedule;
* :func:`given`: an order handed over as data, torch's ``_prepare_schedule_with_comms``
  (plait actions, torch ``_Action`` objects or CSV cells, read by their text form, with
  ``None`` gaps), compute-only or already lowered.

:func:`install` lowers a compute-only order (sends and receives between ranks, and FSDP
actions when a stage does data parallelism), derives the forward-only order that ``eval``
runs, and checks both: a training order with
:func:`~plait.pipeline.validate.validate`, a forward-only one by simulation (both raise
:class:`~plait.pipeline.actions.ScheduleError` naming the rank and action at fault).

:func:`pair_steps` regroups a lowered order around its overlapped pairs, for a custom
function registered for ``OVERLAP_F_B`` (:mod:`~plait.pipeline.custom`), the way torch's
order stands around its ``OVERLAP_F_B`` actions; :func:`check_pair_steps` checks the
regrouped order cannot deadlock.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from plait.pipeline.actions import (
    Action,
    ActionKind,
    OverlappedPair,
    Schedule,
    ScheduleError,
    stage_to_rank,
)
from plait.pipeline.in_order import check_in_order
from plait.pipeline.schedule_csv import format_csv, parse_cell, parse_pair
from plait.pipeline.schedules import SCHEDULES, add_communication, add_fsdp_actions, generate
from plait.pipeline.simulate import simulate, stage_owners
from plait.pipeline.validate import validate

__all__ = [
    "CsvFormat",
    "Lowering",
    "Order",
    "Pairs",
    "Placement",
    "Shape",
    "check_format",
    "check_pair_steps",
    "check_placement",
    "forward_only",
    "generated",
    "given",
    "install",
    "order_checksum",
    "pair_steps",
]

K = ActionKind
Placement = Mapping[int, int]
"""Where each stage lives: ``{stage: pipeline rank}``."""
Pairs = Mapping[int, Sequence[OverlappedPair]]
"""Per pipeline rank, the overlapped pairs (torch's ``OVERLAP_F_B``) of its order."""
CsvFormat = Literal["compute_only", "compute_comms"]
_FORMATS = ("compute_only", "compute_comms")
# A pair runs once its inputs are in and its stages gathered: these move before it.
_BEFORE_PAIR = (K.RECV_F, K.RECV_B, K.UNSHARD)


@dataclass(frozen=True)
class Shape:
    """The pipeline an order is for: ranks of the pipeline group, stages, microbatches."""

    n_ranks: int
    n_stages: int
    n_microbatches: int


@dataclass(frozen=True)
class Lowering:
    """How an order is lowered for the run that holds it: ``fsdp``, with FSDP actions, at
    most ``max_active_stages`` stages unsharded at once
    (:func:`~plait.pipeline.schedules.add_fsdp_actions`); ``in_order``, for a backend that
    matches messages in posting order (:mod:`~plait.pipeline.lowering`)."""

    fsdp: bool = False
    in_order: bool = False
    max_active_stages: int | None = None


@dataclass(frozen=True)
class Order:
    """Every pipeline rank's actions, in the forms a schedule needs.

    ``compute``: compute actions only (torch's ``pipeline_order``); ``train``: lowered, as
    ``step`` runs it; ``eval``: the lowered forwards, as ``eval`` runs it; ``placement``:
    each stage's rank; ``pairs``: per rank, the overlapped pairs of ``compute`` (empty but
    for DualPipeV-like orders).
    """

    compute: Schedule
    train: Schedule
    eval: Schedule
    placement: dict[int, int]
    pairs: dict[int, tuple[OverlappedPair, ...]]


def generated(name: str, shape: Shape, lowering: Lowering = Lowering()) -> Order:
    """The order of the schedule ``name`` (a key of SCHEDULES), lowered as ``lowering``
    says and checked. Raises ValueError for a shape the schedule cannot run."""
    spec = SCHEDULES[name]
    compute = generate(name, shape.n_ranks, shape.n_stages, shape.n_microbatches)
    placement = {s: stage_to_rank(s, shape.n_ranks, spec.style) for s in range(shape.n_stages)}
    pairs = {} if spec.pairs is None else spec.pairs(shape.n_ranks, shape.n_microbatches)
    return install(compute, placement, shape, lowering, pairs)


def forward_only(name: str, shape: Shape, lowering: Lowering = Lowering()) -> Order:
    """torch's forward-only order: one stage per rank, every microbatch's forward in turn.
    Raises ValueError (naming ``name``) unless there are as many stages as ranks."""
    if shape.n_stages != shape.n_ranks:
        raise ValueError(
            f"{name} holds 1 stage per rank, so num_stages must be {shape.n_ranks} for "
            f"{shape.n_ranks} pipeline ranks, got {shape.n_stages}"
        )
    m = range(shape.n_microbatches)
    compute = {r: [Action(r, K.FORWARD, i) for i in m] for r in range(shape.n_ranks)}
    placement = {s: s for s in range(shape.n_stages)}
    return install(compute, placement, shape, lowering)


def given(
    name: str,
    actions: Mapping[int, Sequence[object | None]],
    format: CsvFormat,
    shape: Shape,
    lowering: Lowering = Lowering(),
) -> Order:
    """An order handed over as data (rank -> actions), torch's
    ``_prepare_schedule_with_comms``: plait actions or pairs, or objects read by their text
    form (torch's ``_Action``, CSV cells; ``(0F3;3B1)OVERLAP_F_B`` is a pair); ``None``
    and empty cells are skipped.

    ``"compute_only"``: F / B / I / W only (ValueError naming a communication action
    found), lowered here; ``"compute_comms"``: already lowered (FSDP actions are added if
    ``lowering.fsdp`` and there are none). The placement is read from the actions (each stage on
    the rank running most of them). Raises NotImplementedError for another format, and
    ScheduleError naming the rank and action if the order cannot run.
    """
    check_format(format)
    schedule: Schedule = {}
    pairs: dict[int, list[OverlappedPair]] = {}
    for rank, items in actions.items():
        schedule[rank] = [a for item in items if item is not None for a in _as_actions(item)]
        pairs[rank] = [p for item in items if (p := _as_pair(item)) is not None]
    if format == "compute_only":
        for rank, acts in schedule.items():
            for pos, a in enumerate(acts):
                if not a.kind.is_compute:
                    raise ValueError(
                        f"Expected a compute-only schedule but found {a} at rank {rank}, "
                        f"position {pos}: load it with format='compute_comms'"
                    )
    owners = stage_owners(schedule)
    missing = [s for s in range(shape.n_stages) if s not in owners]
    if missing:
        raise ScheduleError(f"{name}: the schedule never runs stages {missing} of {shape.n_stages}")
    return install(schedule, owners, shape, lowering, pairs)


def check_format(format: str) -> None:
    """Raise NotImplementedError unless ``format`` is one of torch's two CSV formats."""
    if format not in _FORMATS:
        raise NotImplementedError(
            f"{format=} is not implemented: use 'compute_only' or 'compute_comms'"
        )


def install(
    schedule: Schedule,
    placement: Placement,
    shape: Shape,
    lowering: Lowering = Lowering(),
    pairs: Pairs | None = None,
) -> Order:
    """Adopt ``schedule`` (compute-only, or already lowered with communication actions):
    lower it as ``lowering`` says (adding FSDP actions if ``lowering.fsdp``), derive the
    forward-only order, check both, and check that each of ``pairs`` is a forward followed,
    among its rank's compute actions, by its backward. With ``lowering.in_order`` (the
    backend matches messages in posting order, NCCL) a compute-only order is lowered for
    it, and one already lowered must pass :func:`~plait.pipeline.in_order.check_in_order`."""
    compute = {r: [a for a in acts if a.kind.is_compute] for r, acts in schedule.items()}
    if any(a.kind.is_comm for acts in schedule.values() for a in acts):
        train = schedule
        if lowering.fsdp and not any(a.kind.is_fsdp for acts in train.values() for a in acts):
            train = add_fsdp_actions(train, lowering.max_active_stages)
        forward_kinds = (K.FORWARD, K.SEND_F, K.RECV_F, K.UNSHARD, K.RESHARD)
        forwards = {r: [a for a in a_s if a.kind in forward_kinds] for r, a_s in train.items()}
        _check(train, placement, shape)
        simulate(forwards)  # a subsequence of a deadlock-free order: checked all the same
        if lowering.in_order:  # lowered elsewhere: it must not hang or cross messages on NCCL
            for order in (train, forwards):
                for first_step in (True, False):
                    check_in_order(order, placement, first_step=first_step)
    else:
        train = _lower(compute, placement, shape, lowering, pairs)
        forwards = {r: [a for a in acts if a.kind is K.FORWARD] for r, acts in compute.items()}
        forwards = _lower(forwards, placement, shape, lowering)
    checked = {r: tuple(ps) for r, ps in (pairs or {}).items() if ps}
    for rank, rank_pairs in checked.items():
        _check_pairs(rank, compute.get(rank, []), rank_pairs)
    return Order(compute, train, forwards, dict(placement), checked)


def _lower(
    compute: Schedule,
    placement: Placement,
    shape: Shape,
    lowering: Lowering,
    pairs: Pairs | None = None,
) -> Schedule:
    """Add communication (and FSDP) actions to ``compute`` and check the result."""
    schedule = add_communication(
        compute, shape.n_ranks, placement, shape.n_stages, in_order=lowering.in_order, pairs=pairs
    )
    if lowering.fsdp:  # each rank lowers its own FSDP actions: they involve no other rank
        schedule = add_fsdp_actions(schedule, lowering.max_active_stages)
    _check(schedule, placement, shape)
    return schedule


def _check(schedule: Schedule, placement: Placement, shape: Shape) -> None:
    """validate a training order; a forward-only one (validate wants backwards) is
    simulated, which still raises on a deadlock."""
    backward = (K.FULL_BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT)
    if any(a.kind in backward for acts in schedule.values() for a in acts):
        n_ranks, n_stages, m = shape.n_ranks, shape.n_stages, shape.n_microbatches
        validate(schedule, n_ranks, n_stages, m, style=placement)
    else:
        simulate(schedule)


def _check_pairs(rank: int, compute: list[Action], pairs: Iterable[OverlappedPair]) -> None:
    following = dict(itertools.pairwise(compute))
    for pair in pairs:
        if following.get(pair.forward) != pair.backward:
            raise ScheduleError(
                f"rank {rank}: the overlapped pair {pair} is not its F immediately followed "
                "by its backward among the rank's compute actions"
            )


def check_placement(
    name: str, placement: Placement, shape: Shape, rank: int, stages: Iterable[int]
) -> list[int]:
    """Each stage's pipeline rank, in stage order; raises ValueError unless ``rank`` was
    given exactly the stages ``placement`` puts on it."""
    rank_of_stage = [placement[s] for s in range(shape.n_stages)]
    expected = [s for s, r in enumerate(rank_of_stage) if r == rank]
    if sorted(stages) != expected:
        raise ValueError(
            f"{name} with {shape.n_stages} stages on {shape.n_ranks} pipeline ranks places "
            f"stages {expected} on pipeline rank {rank} "
            f"({_describe(placement, shape.n_ranks)}), but this rank was given stages "
            f"{sorted(stages)}"
        )
    return rank_of_stage


def _describe(placement: Placement, n_ranks: int) -> str:
    """Name ``placement`` by its style when it has one (for error messages)."""
    n = len(placement)
    for style in ("loop", "v"):
        try:
            if all(placement[s] == stage_to_rank(s, n_ranks, style) for s in range(n)):
                return f"{style!r} placement"
        except (KeyError, ValueError):
            continue
    return f"placement {dict(placement)}"


def order_checksum(order: Order) -> int:
    """A checksum of the compute order (ranks that loaded different orders differ here)."""
    return zlib.crc32(format_csv(order.compute).encode())


def pair_steps(
    actions: Sequence[Action], pairs: Iterable[OverlappedPair]
) -> list[Action | OverlappedPair]:
    """This rank's lowered ``actions`` with each of ``pairs`` as one step, as torch orders
    around an ``OVERLAP_F_B``: of the actions between the pair's F and its backward,
    receives and UNSHARDs move before the pair (it starts once both inputs are in) and
    sends and the rest after it (its outputs leave once both halves ran). Raises
    ScheduleError if a pair's halves are missing or apart."""
    by_forward = {p.forward: p for p in pairs}
    actions = list(actions)
    steps: list[Action | OverlappedPair] = []
    i = 0
    while i < len(actions):
        pair = by_forward.get(actions[i])
        if pair is None:
            steps.append(actions[i])
            i += 1
            continue
        end = actions.index(pair.backward, i) if pair.backward in actions[i:] else -1
        between = actions[i + 1 : end]
        if end < 0 or any(a.kind.is_compute for a in between):
            raise ScheduleError(
                f"the overlapped pair {pair} is not consecutive: its backward must follow its "
                "F with no compute action between them"
            )
        steps += [a for a in between if a.kind in _BEFORE_PAIR]
        steps.append(pair)
        steps += [a for a in between if a.kind not in _BEFORE_PAIR]
        i = end + 1
    return steps


def check_pair_steps(order: Order) -> None:
    """Raise ScheduleError if the training order, with every rank's pairs run as one step
    (:func:`pair_steps`), can deadlock."""
    flat: Schedule = {}
    for rank, acts in order.train.items():
        steps = pair_steps(acts, order.pairs.get(rank, ()))
        flat[rank] = [a for s in steps for a in _as_actions(s)]
    try:
        simulate(flat)
    except ScheduleError as error:
        raise ScheduleError(f"with its overlapped pairs run as one step each: {error}") from None


def _as_actions(item: object) -> list[Action]:
    """``item`` itself, a pair's two actions, or the actions its text form names."""
    if isinstance(item, Action):
        return [item]
    if isinstance(item, OverlappedPair):
        return list(item.sub_actions)
    return parse_cell(str(item))


def _as_pair(item: object) -> OverlappedPair | None:
    if isinstance(item, OverlappedPair):
        return item
    return None if item is None or isinstance(item, Action) else parse_pair(str(item))
