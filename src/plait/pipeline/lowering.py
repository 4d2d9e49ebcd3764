"""Sends and receives for a compute-only schedule, placed for the backend that moves them.

A send goes right after the F / B / I that produces it. Where its receive goes depends on
how the backend matches messages (:func:`plait.pipeline.p2p.matches_in_order`):

* **By tag** (gloo): right before the compute action that consumes it. Sends are
  asynchronous and the runtime posts receives a little ahead, so the order runs as the
  compute schedule does (the simulator's timing of it equals the compute-only timing), and
  it deadlocks only if the compute schedule itself does.
* **In posting order** (NCCL): NCCL matches the messages between two ranks in the order
  they were posted and runs each rank's operations one after another on one stream, so a
  receive posted late makes its sender's later operations wait, and one posted early holds
  back this rank's. The receives are placed as torch's ``_add_send_recv`` places them: the
  ranks' compute actions are played in lockstep, one per rank per round (ranks in order),
  each once its input is there (its receive placed, or the stage before it run on the same
  rank), and when an action sends, its receive is appended to the receiving rank's list at
  that moment. Every receive then sits at the same point of one global order as its send:
  the earliest unfinished operation of that order is always posted on both of its ranks,
  every earlier operation of theirs done, so the order cannot hang however long each
  operation waits for its peer. The runtime posts these receives in place and waits for
  them where they are consumed.

A compute order that cannot be played to its end deadlocks whatever the receives; it is
then lowered by tag, so that :func:`~plait.pipeline.validate.validate` reports the cycle
in terms of the compute actions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from plait.pipeline.actions import (
    Action,
    ActionKind,
    OverlappedPair,
    Schedule,
    Style,
    input_receive,
    requirements,
    stage_to_rank,
)

__all__ = ["add_communication"]

K = ActionKind


def add_communication(
    schedule: Schedule,
    n_ranks: int,
    style: Style | Mapping[int, int],
    n_stages: int | None = None,
    *,
    in_order: bool = False,
    pairs: Mapping[int, Iterable[OverlappedPair]] | None = None,
) -> Schedule:
    """Insert the sends and receives a compute-only schedule needs between ranks (module
    docstring): ``in_order`` places the receives for a backend that matches messages in
    posting order (NCCL), else right before their consumers.

    ``style`` is the placement: a :data:`~plait.pipeline.actions.Style`, or an explicit
    ``{stage: rank}`` mapping (for schedules loaded from a file). After every F whose next
    stage lives on another rank: ``SEND_F``; after every B / I whose previous stage lives
    on another rank: ``SEND_B``; and the matching ``RECV_F`` / ``RECV_B`` on the receiving
    rank. Neighbour stages on the same rank (the turn of the V) exchange nothing.
    ``n_stages`` defaults to 1 + the largest stage. ``pairs`` (rank -> its overlapped
    pairs, DualPipeV's): in the lockstep play a pair moves as one action, as torch's
    ``OVERLAP_F_B`` does, once the inputs of both halves are in, its sends after both, so
    that it can also run as one step (:func:`~plait.pipeline.ordering.pair_steps`).
    """
    if any(a.kind.is_comm for actions in schedule.values() for a in actions):
        raise ValueError("add_communication: the schedule already has send / receive actions")
    last = max((a.stage for acts in schedule.values() for a in acts), default=0)
    n = last + 1 if n_stages is None else n_stages
    if isinstance(style, Mapping):
        owners = {s: style.get(s) for s in range(n)}
    else:
        owners = {s: stage_to_rank(s, n_ranks, style) for s in range(n)}
    links = _Links(owners)
    if in_order:
        played = _lockstep(schedule, links, pairs or {})
        if played is not None:
            return played
    out: Schedule = {}
    for rank, actions in schedule.items():
        out[rank] = []
        for a in actions:
            out[rank] += [x for x in links.needs(a, rank) if x.kind.is_comm]
            out[rank].append(a)
            out[rank] += [send for send, _, _ in links.sends(a, rank)]
    return out


class _Links:
    """What an action receives from and sends to other ranks, given each stage's rank."""

    def __init__(self, owners: Mapping[int, int | None]) -> None:
        self.owners = owners

    def needs(self, a: Action, rank: int) -> tuple[Action, ...]:
        """What ``a`` waits for on ``rank``, any one of these: the neighbour stage's action
        it requires (:func:`~plait.pipeline.actions.requirements`) if that stage is on the
        same rank, else its receive; none: nothing."""
        for options in requirements(a, len(self.owners)):
            neighbour = options[0].stage
            if neighbour == a.stage:
                continue  # its own forward: program order
            if self.owners[neighbour] == rank:
                return options
            receive = input_receive(a)
            assert receive is not None
            return (receive,)
        return ()

    def sends(self, a: Action, rank: int) -> list[tuple[Action, int, Action]]:
        """The sends ``a`` makes on ``rank``: (send, receiving rank, its receive)."""
        s, i = a.stage, a.microbatch
        out: list[tuple[Action, int, Action]] = []
        forward, backward = self.owners.get(s + 1), self.owners.get(s - 1)
        if a.kind is K.FORWARD and forward is not None and forward != rank:
            out.append((Action(s, K.SEND_F, i), forward, Action(s + 1, K.RECV_F, i)))
        if a.kind.produces_input_grad and backward is not None and backward != rank:
            out.append((Action(s, K.SEND_B, i), backward, Action(s - 1, K.RECV_B, i)))
        return out


def _lockstep(
    schedule: Schedule, links: _Links, pairs: Mapping[int, Iterable[OverlappedPair]]
) -> Schedule | None:
    """The lockstep play of the module docstring; None if some rank cannot move."""
    out: Schedule = {rank: [] for rank in schedule}
    done: dict[int, set[Action]] = {rank: set() for rank in schedule}
    heads = dict.fromkeys(schedule, 0)
    backward_of = {r: {p.forward: p.backward for p in ps} for r, ps in pairs.items()}

    def ready(a: Action, rank: int) -> bool:
        needs = links.needs(a, rank)
        return not needs or any(x in done[rank] for x in needs)

    moved = True
    while moved:
        moved = False
        for rank in sorted(schedule):
            actions, head = schedule[rank], heads[rank]
            if head == len(actions):
                continue
            step = actions[head : head + 1]
            backward = backward_of.get(rank, {}).get(actions[head])
            if backward is not None and actions[head + 1 : head + 2] == [backward]:
                step.append(backward)  # an overlapped pair moves as one
            if not all(ready(a, rank) for a in step):
                continue
            heads[rank] += len(step)
            moved = True
            out[rank] += step
            done[rank].update(step)
            for send, to, recv in (x for a in step for x in links.sends(a, rank)):
                out[rank].append(send)
                out.setdefault(to, []).append(recv)
                done.setdefault(to, set()).add(recv)
    if any(heads[rank] < len(actions) for rank, actions in schedule.items()):
        return None
    return out
