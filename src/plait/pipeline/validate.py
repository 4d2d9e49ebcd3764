"""Check a schedule before running it: complete, well placed, well ordered, deadlock-free.

:func:`validate` raises :class:`ScheduleError` (a ValueError) whose message names the rank
and the action (in text form) and says what is wrong. The checks, in order:

1. shape: ranks are 0..n_ranks-1, stages and microbatches in range;
2. completeness: every (stage, microbatch) has exactly one F and either one B or one I
   and one W; nothing runs twice (UNSHARD / RESHARD may repeat);
3. placement: every action runs on the rank that holds its stage; sends and receives go
   to a neighbour stage on another rank;
4. pairing: every send has its receive on the peer rank, and every receive its send;
5. order on each rank: a forward after the previous stage's forward when both stages are
   local, a backward after its own forward and after the next stage's backward (if
   local), W after I, a send after the compute it sends; with communication actions, a
   compute fed from another rank after its receive; with FSDP actions, compute only while
   the stage is unsharded and no B / W after its REDUCE_GRAD;
6. deadlock: the schedule is executed (:func:`~plait.pipeline.simulate.simulate`) with
   blocking receives and, without communication actions, cross-rank dependency waits; if
   no rank can progress, each rank's blocked action is reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from plait.pipeline.actions import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    Style,
    requirements,
    stage_to_rank,
)
from plait.pipeline.simulate import simulate, stage_owners

__all__ = ["ScheduleError", "validate"]

K = ActionKind
_Where = dict[Action, list[tuple[int, int]]]  # action -> [(rank, position)]


def validate(
    schedule: Schedule,
    n_ranks: int,
    n_stages: int,
    n_microbatches: int,
    *,
    style: Style | Mapping[int, int] | None = None,
) -> None:
    """Raise ScheduleError unless ``schedule`` is a correct, deadlock-free pipeline schedule.

    ``style`` fixes the placement (:func:`~plait.pipeline.actions.stage_to_rank`, or an
    explicit ``{stage: rank}``); without it, each stage belongs to the rank that runs most
    of its actions. Works with or without communication and FSDP actions.
    """
    _check_shape(schedule, n_ranks, n_stages, n_microbatches)
    where: _Where = {}
    for rank, actions in schedule.items():
        for pos, action in enumerate(actions):
            where.setdefault(action, []).append((rank, pos))
    if style == "v" and n_stages != 2 * n_ranks:
        raise ScheduleError(f"'v' placement needs n_stages == 2 * n_ranks, got {n_stages}")
    if style is None:
        owner = stage_owners(schedule)
        how = "the rank running most of its actions"
    elif isinstance(style, Mapping):
        owner, how = dict(style), "the given placement"
    else:
        owner = {s: stage_to_rank(s, n_ranks, style) for s in range(n_stages)}
        how = f"placement {style!r}"
    _check_complete(where, owner, n_stages, n_microbatches)
    _check_placement(schedule, owner, n_stages, how)
    _check_pairs(schedule, where, owner)
    comm_mode = any(a.kind.is_comm for a in where)
    for rank, actions in schedule.items():
        _check_order(rank, actions, owner, n_stages, comm_mode)
        _check_fsdp(rank, actions)
    simulate(schedule)  # raises ScheduleError on deadlock


def _check_shape(schedule: Schedule, n_ranks: int, n_stages: int, m: int) -> None:
    if sorted(schedule) != list(range(n_ranks)):
        raise ScheduleError(f"schedule has ranks {sorted(schedule)}, expected 0..{n_ranks - 1}")
    for rank, actions in schedule.items():
        for action in actions:
            if not isinstance(action, Action):
                raise ScheduleError(f"rank {rank}: {action!r} is not an Action")
            if action.stage >= n_stages:
                raise ScheduleError(
                    f"rank {rank}: {action} names stage {action.stage}, but the pipeline has "
                    f"{n_stages} stages (0..{n_stages - 1})"
                )
            if action.microbatch is not None and action.microbatch >= m:
                raise ScheduleError(
                    f"rank {rank}: {action} names microbatch {action.microbatch}, but there "
                    f"are {m} microbatches (0..{m - 1})"
                )


def _check_complete(where: _Where, owner: Mapping[int, int], n_stages: int, m: int) -> None:
    for action, places in where.items():
        if len(places) > 1 and action.kind not in (K.UNSHARD, K.RESHARD):
            at = ", ".join(f"rank {r} position {p}" for r, p in places)
            raise ScheduleError(f"rank {places[0][0]}: {action} is duplicated ({at})")
    for s in range(n_stages):
        rank = f"rank {owner[s]}" if s in owner else f"stage {s} (which no rank runs)"
        for i in range(m):
            f, b, ia, w = (
                Action(s, kind, i)
                for kind in (K.FORWARD, K.FULL_BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT)
            )
            if f not in where:
                raise ScheduleError(f"{rank}: {f} is missing (stage {s} never runs microbatch {i})")
            if b in where and ia in where:
                raise ScheduleError(f"{rank}: both {b} and {ia} run; a backward is B or I + W")
            if b not in where and ia not in where:
                raise ScheduleError(f"{rank}: {b} is missing (or {ia} + {w}): no backward")
            if (ia in where) != (w in where):
                raise ScheduleError(
                    f"{rank}: {w} is missing; {ia} runs but not its weight gradient"
                    if ia in where
                    else f"{rank}: {w} runs but {ia} never does"
                )


def _check_placement(schedule: Schedule, owner: Mapping[int, int], n_stages: int, how: str) -> None:
    for rank, actions in schedule.items():
        for action in actions:
            if owner.get(action.stage) != rank:
                raise ScheduleError(
                    f"rank {rank}: {action} runs stage {action.stage}, which belongs to rank "
                    f"{owner.get(action.stage)} ({how})"
                )
            peer = _peer_stage(action)
            if peer is None:
                continue
            if not 0 <= peer < n_stages:
                raise ScheduleError(
                    f"rank {rank}: {action} talks to stage {peer}, which does not exist"
                )
            if owner.get(peer) == rank:
                raise ScheduleError(
                    f"rank {rank}: {action} talks to stage {peer} on its own rank; "
                    "neighbour stages on one rank exchange nothing"
                )


_PEER_STEP = {K.SEND_F: 1, K.RECV_F: -1, K.SEND_B: -1, K.RECV_B: 1}


def _peer_stage(action: Action) -> int | None:
    """The stage a send / receive talks to (None for other kinds)."""
    step = _PEER_STEP.get(action.kind)
    return None if step is None else action.stage + step


_MATCH = {K.SEND_F: K.RECV_F, K.RECV_F: K.SEND_F, K.SEND_B: K.RECV_B, K.RECV_B: K.SEND_B}


def _check_pairs(schedule: Schedule, where: _Where, owner: Mapping[int, int]) -> None:
    for rank, actions in schedule.items():
        for action in actions:
            peer = _peer_stage(action)
            if peer is None:
                continue
            match = Action(peer, _MATCH[action.kind], action.microbatch)
            if match not in where:
                raise ScheduleError(
                    f"rank {rank}: {action} has no matching {match} on rank {owner.get(peer)}"
                )


def _check_order(
    rank: int, actions: list[Action], owner: Mapping[int, int], n_stages: int, comm_mode: bool
) -> None:
    done: set[Action] = set()
    for action in actions:
        for options in requirements(action, n_stages):
            if owner.get(options[0].stage) == rank:
                if not any(o in done for o in options):
                    raise ScheduleError(
                        f"rank {rank}: {action} runs before {' / '.join(map(str, options))}"
                        f", {_why(action, options[0])} (which this rank runs later or never)"
                    )
            elif comm_mode and action.kind.is_compute:
                recv_kind = K.RECV_F if action.kind is K.FORWARD else K.RECV_B
                recv = Action(action.stage, recv_kind, action.microbatch)
                if recv not in done:
                    raise ScheduleError(
                        f"rank {rank}: {action} needs {options[0]} from rank "
                        f"{owner.get(options[0].stage)} but no {recv} runs before it"
                    )
        done.add(action)


def _why(action: Action, needed: Action) -> str:
    if needed.kind.is_comm:
        return "the send it receives"
    if action.kind.is_comm:
        return "the compute whose result it sends"
    if action.kind is K.BACKWARD_WEIGHT:
        return "its input gradient (W before I)"
    if needed.stage == action.stage:
        return "its own forward"
    if action.kind is K.FORWARD:
        return f"the previous stage's forward of microbatch {action.microbatch}"
    return f"the next stage's backward of microbatch {action.microbatch}"


class _Sharding(Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"


def _check_fsdp(rank: int, actions: list[Action]) -> None:
    managed = {a.stage for a in actions if a.kind in (K.UNSHARD, K.RESHARD)}
    state = dict.fromkeys(managed, _Sharding.SHARDED)
    reduced: set[int] = set()
    for action in actions:
        s, kind = action.stage, action.kind
        if kind in (K.UNSHARD, K.RESHARD):
            wanted = _Sharding.SHARDED if kind is K.UNSHARD else _Sharding.UNSHARDED
            if state[s] is not wanted:
                raise ScheduleError(
                    f"rank {rank}: {action} but stage {s} is already {state[s].value}"
                )
            state[s] = _Sharding.UNSHARDED if kind is K.UNSHARD else _Sharding.SHARDED
        elif kind.is_compute and state.get(s) is _Sharding.SHARDED:
            raise ScheduleError(
                f"rank {rank}: {action} runs while stage {s} is sharded; put {s}UNSHARD before it"
            )
        if kind is K.REDUCE_GRAD:
            reduced.add(s)
        elif kind in (K.FULL_BACKWARD, K.BACKWARD_WEIGHT) and s in reduced:
            raise ScheduleError(
                f"rank {rank}: {action} runs after {s}REDUCE_GRAD; reduce once every gradient "
                "of the stage is complete"
            )
