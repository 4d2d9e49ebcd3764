"""The pipeline schedule IR: actions, their text form, and where stages live.

A schedule is data: for every pipeline rank, the ordered list of actions that rank runs.
An action names a stage, a kind and (for compute and communication) a microbatch, and
prints compactly, as torch's schedules do: ``0F3`` is stage 0's forward of microbatch 3,
``1B2`` a full backward, ``2I0`` / ``2W0`` the input / weight halves of a split backward,
``0SEND_F1`` / ``1RECV_F1`` moving an activation, ``0UNSHARD`` / ``0RESHARD`` /
``0REDUCE_GRAD`` the per-stage FSDP steps.

A whole schedule prints one rank per line (``rank 0: 0F0 0F1 0B0 0B1``);
:func:`parse_schedule` reads that back, and also torch-style CSV rows (one row per rank,
actions separated by commas; :mod:`~plait.pipeline.schedule_csv` reads and writes torch's
CSV files exactly, empty cells and empty rows included).

There is no kind for torch's ``OVERLAP_F_B`` (DualPipeV's forward of one chunk paired with
a backward of another): in a schedule the pair is its F action followed by its B action.
torch's runtime runs the two one after the other as well, so the arithmetic is the same,
and every pass (communication, FSDP, validation, simulation) works on pairs unchanged.
Which consecutive F and B form a pair is kept beside the schedule, as
:class:`OverlappedPair` values, for a custom function registered for ``OVERLAP_F_B``
(:mod:`~plait.pipeline.custom`) to run the two as one unit.

Actions also answer to torch's ``_Action`` field names (``stage_index``,
``computation_type``, ``microbatch_index``, ``sub_actions``), so a custom function written
against torch's actions reads plait's unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Final, Literal

__all__ = [
    "OVERLAP_F_B",
    "Action",
    "ActionKind",
    "OverlappedPair",
    "Schedule",
    "ScheduleError",
    "Style",
    "format_schedule",
    "input_receive",
    "parse_action",
    "parse_schedule",
    "requirements",
    "stage_to_rank",
    "stages_of_rank",
]

Style = Literal["loop", "v"]
"""Stage placement: ``"loop"`` puts stage s on rank s % n_ranks; ``"v"`` gives rank r the
two stages r and 2 * n_ranks - 1 - r (the V shape of ZB-V)."""


class ActionKind(Enum):
    """What an action does; the value is its text form.

    Flags (plain attributes, cheap to read): ``is_compute`` (F, B, I, W: runs part of the
    model), ``is_comm`` (a send or receive between neighbour stages), ``is_fsdp``
    (UNSHARD, RESHARD, REDUCE_GRAD: whole-stage actions without a microbatch),
    ``produces_input_grad`` (B or I: the backward whose result the previous stage needs).
    """

    is_compute: bool
    is_comm: bool
    is_fsdp: bool
    produces_input_grad: bool

    FORWARD = "F"
    FULL_BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"

    def __init__(self, text: str) -> None:
        self.is_compute = text in ("F", "B", "I", "W")
        self.is_comm = text in ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
        self.is_fsdp = text in ("UNSHARD", "RESHARD", "REDUCE_GRAD")
        self.produces_input_grad = text in ("B", "I")


K = ActionKind  # shorthand inside this package


class ScheduleError(ValueError):
    """A schedule that cannot run correctly; the message names the rank and the action."""


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``stage`` (global stage index), ``kind``, ``microbatch``.

    Contract: compute and communication actions carry a microbatch index, FSDP actions
    (UNSHARD, RESHARD, REDUCE_GRAD) carry ``None``; indices are non-negative. Actions are
    immutable and hashable, and ``parse_action(str(a)) == a``.
    """

    stage: int
    kind: ActionKind
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ValueError(f"Action stage must be >= 0, got {self.stage}")
        if self.kind.is_fsdp and self.microbatch is not None:
            raise ValueError(f"{self.kind.value} acts on a whole stage: microbatch must be None")
        if not self.kind.is_fsdp and (self.microbatch is None or self.microbatch < 0):
            raise ValueError(
                f"{self.kind.value} needs a microbatch index >= 0, got {self.microbatch}"
            )

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    # torch's ``_Action`` field names, read-only.
    @property
    def stage_index(self) -> int:
        return self.stage

    @property
    def computation_type(self) -> ActionKind:
        return self.kind

    @property
    def microbatch_index(self) -> int | None:
        return self.microbatch

    @property
    def sub_actions(self) -> None:
        """torch's: only an overlapped pair has sub-actions."""
        return None


OVERLAP_F_B: Final = "OVERLAP_F_B"
"""torch's computation type of an overlapped forward / backward pair (its text form too)."""


@dataclass(frozen=True)
class OverlappedPair:
    """DualPipeV's overlapped pair, torch's ``OVERLAP_F_B`` action: the forward of one
    stage and the backward (B or I) of another stage of the same rank, independent of each
    other, which a custom function may run as one unit (e.g. one's compute hiding the
    other's communication). In a schedule the pair is ``forward`` immediately followed,
    among compute actions, by ``backward``.

    Prints as torch does, ``(0F3;3B1)OVERLAP_F_B``; ``sub_actions`` is ``(forward,
    backward)``. Raises ValueError for other kinds, or for one stage.
    """

    forward: Action
    backward: Action

    def __post_init__(self) -> None:
        if self.forward.kind is not K.FORWARD or not self.backward.kind.produces_input_grad:
            raise ValueError(
                f"an {OVERLAP_F_B} pair is a forward (F) then a backward (B or I), got "
                f"{self.forward} then {self.backward}"
            )
        if self.forward.stage == self.backward.stage:
            raise ValueError(
                f"an {OVERLAP_F_B} pair runs two different stages, got {self} (one stage)"
            )

    def __str__(self) -> str:
        return f"({self.forward};{self.backward}){OVERLAP_F_B}"

    @property
    def sub_actions(self) -> tuple[Action, Action]:
        return (self.forward, self.backward)

    @property
    def computation_type(self) -> str:
        return OVERLAP_F_B

    @property
    def stage_index(self) -> int:
        """torch's placeholder: a pair has no single stage."""
        return -1

    @property
    def microbatch_index(self) -> None:
        return None


Schedule = dict[int, list[Action]]
"""Per pipeline rank, the actions it runs in order."""


def requirements(action: Action, n_stages: int) -> list[tuple[Action, ...]]:
    """What must have run before ``action`` can start, for a pipeline of ``n_stages``.

    Each entry is satisfied by any one of its actions (a backward's input gradient comes
    from the next stage's B or I). The entries are: the previous stage's forward for a
    forward; the own forward and the next stage's backward for B / I; I for W; the
    producing compute for a send; the matching send of the neighbour stage for a receive.
    FSDP actions require nothing. Where an entry lives (same rank or another) is for the
    caller to decide from the placement.
    """
    s, i, kind = action.stage, action.microbatch, action.kind
    if i is None:
        return []
    if kind is K.FORWARD:
        return [(Action(s - 1, K.FORWARD, i),)] if s > 0 else []
    if kind.produces_input_grad:
        needs: list[tuple[Action, ...]] = [(Action(s, K.FORWARD, i),)]
        if s < n_stages - 1:
            needs.append((Action(s + 1, K.FULL_BACKWARD, i), Action(s + 1, K.BACKWARD_INPUT, i)))
        return needs
    if kind is K.BACKWARD_WEIGHT:
        return [(Action(s, K.BACKWARD_INPUT, i),)]
    if kind is K.SEND_F:
        return [(Action(s, K.FORWARD, i),)]
    if kind is K.SEND_B:
        return [(Action(s, K.FULL_BACKWARD, i), Action(s, K.BACKWARD_INPUT, i))]
    if kind is K.RECV_F:
        return [(Action(s - 1, K.SEND_F, i),)] if s > 0 else []
    return [(Action(s + 1, K.SEND_B, i),)]  # RECV_B


def input_receive(action: Action) -> Action | None:
    """The receive that brings ``action`` its input when the neighbour stage it requires
    (:func:`requirements`) lives on another rank: ``RECV_F`` for a forward, ``RECV_B`` for
    B / I; None for any other kind."""
    if action.kind is K.FORWARD:
        return Action(action.stage, K.RECV_F, action.microbatch)
    if action.kind.produces_input_grad:
        return Action(action.stage, K.RECV_B, action.microbatch)
    return None


_KIND_ALTERNATIVES = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"(\d+)({_KIND_ALTERNATIVES})(\d*)")
_RANK_PREFIX_RE = re.compile(r"\s*rank\s+(\d+)\s*:(.*)", re.IGNORECASE)


def parse_action(text: str) -> Action:
    """Parse the text form (``"0F3"``, ``"1SEND_B2"``, ``"0UNSHARD"``) into an Action.

    Raises ValueError on anything else.
    """
    match = _ACTION_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"Invalid action {text!r}: expected <stage><kind>[<microbatch>] with kind one of "
            f"{[k.value for k in ActionKind]}, e.g. '0F3', '1SEND_F0', '2UNSHARD'"
        )
    stage, kind, mb = match.groups()
    try:
        return Action(int(stage), ActionKind(kind), int(mb) if mb else None)
    except ValueError as err:
        raise ValueError(f"Invalid action {text!r}: {err}") from None


def format_schedule(schedule: Schedule) -> str:
    """One line per rank, in rank order: ``rank 0: 0F0 0F1 0B0 0B1``."""
    lines = []
    for rank in sorted(schedule):
        actions = " ".join(str(a) for a in schedule[rank])
        lines.append(f"rank {rank}: {actions}".rstrip())
    return "\n".join(lines) + "\n"


def parse_schedule(text: str) -> Schedule:
    """Read :func:`format_schedule`'s text back (the round trip is exact).

    Lines are ``rank <r>: <actions>``; actions are separated by spaces and/or commas. Lines
    without the ``rank <r>:`` prefix take the next rank in order, so torch-style CSV rows
    parse too. Blank lines and ``#`` comments are ignored. Raises ValueError on a bad
    action or a rank given twice.
    """
    schedule: Schedule = {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0]
        if not line.strip():
            continue
        prefixed = _RANK_PREFIX_RE.fullmatch(line)
        rank, body = (int(prefixed[1]), prefixed[2]) if prefixed else (len(schedule), line)
        if rank in schedule:
            raise ValueError(f"line {line_no}: rank {rank} appears twice in the schedule")
        tokens = [t for t in re.split(r"[\s,]+", body) if t]
        try:
            schedule[rank] = [parse_action(t) for t in tokens]
        except ValueError as err:
            raise ValueError(f"line {line_no} (rank {rank}): {err}") from None
    return schedule


def stage_to_rank(stage: int, n_ranks: int, style: Style) -> int:
    """The rank that holds global ``stage`` under placement ``style``.

    ``"loop"``: stage s lives on rank s % n_ranks (any number of stages). ``"v"``: exactly
    2 * n_ranks stages, rank r holding r and 2 * n_ranks - 1 - r.
    """
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if style == "loop":
        return stage % n_ranks
    if style == "v":
        if not 0 <= stage < 2 * n_ranks:
            raise ValueError(
                f"'v' placement has 2 * n_ranks = {2 * n_ranks} stages; stage {stage} is outside"
            )
        return stage if stage < n_ranks else 2 * n_ranks - 1 - stage
    raise ValueError(f"Unknown placement style {style!r}: expected 'loop' or 'v'")


def stages_of_rank(rank: int, n_ranks: int, n_stages: int, style: Style) -> list[int]:
    """The global stages that ``rank`` holds under placement ``style``, in increasing order."""
    return [s for s in range(n_stages) if stage_to_rank(s, n_ranks, style) == rank]
