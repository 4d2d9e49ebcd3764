"""Run a schedule on paper: timing, bubble, activation memory, and pictures of it.

The model: every rank runs its actions in order, one at a time. An action starts once the
rank is free and every requirement (:func:`~plait.pipeline.actions.requirements`) that
lives on another rank has finished, plus ``comm_cost`` for the hop; requirements on the
same rank are met by program order (:func:`~plait.pipeline.validate.validate` checks them).
Sends are asynchronous (they take their cost, 0 by default, and never wait for the
receiver); a receive blocks its rank from the moment it is reached until the data arrives,
and that wait counts as idle time. If no rank can move, the schedule deadlocks and
:class:`~plait.pipeline.actions.ScheduleError` lists every rank's blocked action.

Activation memory: the activation of (stage, microbatch) is live from its ``F`` until its
``B``, or, for a split backward, until its ``W`` (the weight gradient still needs the
saved inputs); ``I`` frees nothing.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from plait.pipeline.actions import Action, ActionKind, Schedule, ScheduleError, requirements

__all__ = [
    "DEFAULT_COSTS",
    "Simulation",
    "TimedAction",
    "format_timeline",
    "peak_live",
    "plot_timeline",
    "simulate",
    "stage_owners",
]

DEFAULT_COSTS: Mapping[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
"""Time units per compute kind; every other kind costs 0 unless given."""


class TimedAction(NamedTuple):
    """When one action ran: ``[start, end)`` in the simulator's time units."""

    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class Simulation:
    """The outcome of :func:`simulate`.

    ``bubble_fraction`` is idle compute time over ``n_ranks * makespan``, where busy time is
    the time spent in F, B, I and W; ``peak_activations[rank]`` is the largest number of
    (stage, microbatch) activations a rank holds at once.
    """

    timeline: dict[int, list[TimedAction]]
    makespan: float
    bubble_fraction: float
    peak_activations: dict[int, int]


def stage_owners(schedule: Schedule) -> dict[int, int]:
    """For each stage, the rank holding most of its actions (ties go to the lowest rank)."""
    votes: dict[int, Counter[int]] = {}
    for rank in sorted(schedule):
        for action in schedule[rank]:
            votes.setdefault(action.stage, Counter())[rank] += 1
    return {stage: max(c, key=lambda r: (c[r], -r)) for stage, c in votes.items()}


def simulate(
    schedule: Schedule, costs: Mapping[str, float] | None = None, comm_cost: float = 0.0
) -> Simulation:
    """Time ``schedule`` (with or without communication actions) under the model above.

    ``costs`` maps kind text (``"F"``, ``"B"``, ``"I"``, ``"W"``, ``"SEND_F"``, ``"UNSHARD"``,
    ...) to a duration and is laid over :data:`DEFAULT_COSTS`; ``comm_cost`` delays every
    cross-rank dependency. Placement is read from the schedule (:func:`stage_owners`).
    Raises ScheduleError on deadlock, ValueError on an unknown cost key.
    """
    known = {k.value for k in ActionKind}
    if unknown := set(costs or {}) - known:
        raise ValueError(f"Unknown cost keys {sorted(unknown)}; known kinds: {sorted(known)}")
    cost = {**DEFAULT_COSTS, **(costs or {})}
    timeline = _execute(schedule, cost, comm_cost)
    makespan = max((t[-1].end for t in timeline.values() if t), default=0.0)
    busy = sum(
        t.end - t.start for row in timeline.values() for t in row if t.action.kind.is_compute
    )
    total = len(schedule) * makespan
    return Simulation(
        timeline=timeline,
        makespan=makespan,
        bubble_fraction=(total - busy) / total if total else 0.0,
        peak_activations={rank: peak_live(actions) for rank, actions in schedule.items()},
    )


def _execute(
    schedule: Schedule, cost: Mapping[str, float], comm_cost: float
) -> dict[int, list[TimedAction]]:
    owner = stage_owners(schedule)
    n_stages = max(owner, default=-1) + 1
    finished: dict[Action, float] = {}
    free = dict.fromkeys(schedule, 0.0)
    timeline: dict[int, list[TimedAction]] = {rank: [] for rank in schedule}
    while any(len(timeline[r]) < len(schedule[r]) for r in schedule):
        progressed = False
        for rank in sorted(schedule):
            while len(timeline[rank]) < len(schedule[rank]):
                action = schedule[rank][len(timeline[rank])]
                ready = _ready_time(action, rank, owner, n_stages, finished, comm_cost)
                if ready is None:
                    break
                waits = action.kind in (ActionKind.RECV_F, ActionKind.RECV_B)
                start = free[rank] if waits else max(free[rank], ready)
                end = max(free[rank], ready) + cost.get(action.kind.value, 0.0)
                timeline[rank].append(TimedAction(start, end, action))
                finished.setdefault(action, end)
                free[rank] = end
                progressed = True
        if not progressed:
            raise ScheduleError(_deadlock_report(schedule, timeline, owner, n_stages, finished))
    return timeline


def _ready_time(
    action: Action,
    rank: int,
    owner: Mapping[int, int],
    n_stages: int,
    finished: Mapping[Action, float],
    comm_cost: float,
) -> float | None:
    """When the cross-rank requirements of ``action`` are met, or None if not yet."""
    ready = 0.0
    for options in requirements(action, n_stages):
        if owner.get(options[0].stage) == rank:
            continue
        done = [finished[a] for a in options if a in finished]
        if not done:
            return None
        ready = max(ready, min(done) + comm_cost)
    return ready


def _deadlock_report(
    schedule: Schedule,
    timeline: Mapping[int, list[TimedAction]],
    owner: Mapping[int, int],
    n_stages: int,
    finished: Mapping[Action, float],
) -> str:
    lines = ["deadlock: no rank can make progress"]
    for rank in sorted(schedule):
        if len(timeline[rank]) == len(schedule[rank]):
            continue
        action = schedule[rank][len(timeline[rank])]
        missing = [
            opts
            for opts in requirements(action, n_stages)
            if owner.get(opts[0].stage) != rank and not any(a in finished for a in opts)
        ]
        waits = " and ".join(
            " or ".join(str(a) for a in opts) + _where(owner.get(opts[0].stage)) for opts in missing
        )
        lines.append(f"  rank {rank} is blocked at {action}, waiting for {waits}")
    return "\n".join(lines)


def _where(rank: int | None) -> str:
    return " (which no rank runs)" if rank is None else f" on rank {rank}"


def peak_live(actions: list[Action], stage: int | None = None, after_backward: bool = False) -> int:
    """Most microbatch activations alive at once among ``actions`` (of ``stage`` only, or
    of every stage for None): a forward adds one, a full backward or a weight gradient
    frees one. With ``after_backward``, only from the end of the first backward on (when
    the step's gradients exist): 0 when nothing is alive by then."""
    forward, frees = ActionKind.FORWARD, (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_WEIGHT)
    live = peak = 0
    counting = not after_backward
    for a in actions:  # hot: a planner's search reads a few million actions
        if stage is not None and a.stage != stage:
            continue
        kind = a.kind
        if kind is forward:
            live += 1
            if counting and live > peak:
                peak = live
        elif kind in frees:
            live -= 1
            if not counting:
                counting, peak = True, live
    return peak


def format_timeline(sim: Simulation, unit: float = 1.0) -> str:
    """A text chart: one row per rank, one column per ``unit`` of time.

    A compute action prints its text form (``0F3``) in its first column and ``-`` in the
    columns it continues through; ``.`` is idle (communication and FSDP actions are not
    drawn). Times are rounded to the column grid.
    """
    n_cols = math.ceil(sim.makespan / unit - 1e-9)
    labels = [
        str(t.action) for row in sim.timeline.values() for t in row if t.action.kind.is_compute
    ]
    width = max([len(s) for s in labels] + [len(str(max(n_cols - 1, 0)))])
    names = {rank: f"rank {rank}" for rank in sim.timeline}
    margin = max([len(n) for n in names.values()] + [4])
    lines = [" ".join(["time".ljust(margin)] + [str(c).ljust(width) for c in range(n_cols)])]
    for rank in sorted(sim.timeline):
        cells = ["." * width] * n_cols
        for start, end, action in sim.timeline[rank]:
            if not action.kind.is_compute or end <= start:
                continue
            first = math.floor(start / unit + 1e-9)
            last = max(first, math.ceil(end / unit - 1e-9) - 1)
            cells[first : last + 1] = ["-" * width] * (last + 1 - first)
            cells[first] = str(action).ljust(width)
        lines.append(" ".join([names[rank].ljust(margin), *cells]))
    return "\n".join(line.rstrip() for line in lines) + "\n"


_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}


def plot_timeline(sim: Simulation, path: str, title: str | None = None) -> None:
    """Write a Gantt chart of the compute actions to ``path`` (PNG) with matplotlib.

    Raises RuntimeError when matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise RuntimeError(
            "plot_timeline needs matplotlib: pip install matplotlib (format_timeline gives "
            "a text chart without it)"
        ) from err
    ranks = sorted(sim.timeline)
    fig = Figure(figsize=(max(6.0, sim.makespan * 0.45), 0.6 * len(ranks) + 1.2))
    ax = fig.add_subplot()
    for row, rank in enumerate(ranks):
        for start, end, action in sim.timeline[rank]:
            if not action.kind.is_compute or end <= start:
                continue
            colour = _COLOURS[action.kind.value]
            ax.broken_barh([(start, end - start)], (row - 0.4, 0.8), facecolors=colour)
            ax.text((start + end) / 2, row, str(action), ha="center", va="center", fontsize=7)
    kinds = sorted(
        {t.action.kind.value for row in sim.timeline.values() for t in row} & set(_COLOURS)
    )
    handles = [Patch(facecolor=_COLOURS[k], label=k) for k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, max(sim.makespan, 1.0))
    ax.set_xlabel("time")
    ax.set_title(title or f"makespan {sim.makespan:g}, bubble {sim.bubble_fraction:.1%}")
    fig.tight_layout()
    fig.savefig(path, format="png")
