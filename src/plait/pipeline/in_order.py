"""Replay a lowered order under NCCL's rules for point-to-point messages, on paper.

NCCL ignores tags and matches the messages between two ranks in the order they were
posted; it runs each rank's operations one batch after another on one stream, every
operation of a batch progressing on its own once the batch has started; and a computation
waits for the batch holding the receive it consumes. An order can then hang (a batch
waits for a peer whose stream waits for it) or cross its messages (the k-th message from
one rank to another is not the transfer the receiver posted k-th: the data lands in the
wrong buffer). gloo does neither, so CPU runs cannot show it: :func:`check_in_order` finds
both, naming the ranks and actions. :mod:`plait.pipeline.lowering` places receives so that
neither happens; orders handed over already lowered are checked with this before they run
on such a backend (:func:`plait.pipeline.ordering.install`).
"""

from __future__ import annotations

from collections.abc import Mapping

from plait.pipeline.actions import Action, ActionKind, Schedule, ScheduleError, input_receive

__all__ = ["check_in_order"]

K = ActionKind
_Link = tuple[int, int]  # (sending rank, receiving rank)
_Op = tuple[bool, _Link, int]  # (is a send, link, its index among the link's messages)


def check_in_order(schedule: Schedule, owners: Mapping[int, int], *, first_step: bool) -> None:
    """Raise :class:`~plait.pipeline.actions.ScheduleError` if ``schedule`` (lowered: with
    sends and receives) would hang or cross messages under NCCL's rules (module docstring).

    Each rank's consecutive send / receive actions form one batch, posted when its program
    reaches it. ``owners``: each stage's rank. ``first_step``: as the runtime's first step,
    whose activation receives have no agreed metadata yet: each ends its batch, and the
    program waits for that batch right there.
    """
    replay = _Replay(schedule, owners, first_step)
    replay.run()
    if replay.crossed:
        raise ScheduleError(
            "the order crosses its messages on a backend that matches them in posting "
            "order (NCCL): " + "; ".join(replay.crossed[:4])
        )
    stuck = replay.stuck()
    if stuck:
        raise ScheduleError(
            "the order hangs on a backend that matches messages in posting order and runs "
            "a rank's operations one batch after another (NCCL): " + "; ".join(stuck)
        )


class _Replay:
    def __init__(self, schedule: Schedule, owners: Mapping[int, int], first_step: bool) -> None:
        self.owners = owners
        # Per rank: ("batch", [actions]), ("compute", action) or ("settle", receive).
        self.programs: dict[int, list[tuple[str, Action | list[Action]]]] = {}
        for rank, actions in schedule.items():
            items: list[tuple[str, Action | list[Action]]] = []
            for a in actions:
                if a.kind.is_comm:
                    if not items or items[-1][0] != "batch":
                        items.append(("batch", []))
                    batch = items[-1][1]
                    assert isinstance(batch, list)
                    batch.append(a)
                    if first_step and a.kind is K.RECV_F:
                        items.append(("settle", a))
                elif a.kind.is_compute:
                    items.append(("compute", a))
            self.programs[rank] = items
        self.position = dict.fromkeys(self.programs, 0)
        self.streams: dict[int, list[list[_Op]]] = {r: [] for r in self.programs}
        self.running = dict.fromkeys(self.programs, 0)  # each stream's first unfinished batch
        self.messages: dict[tuple[bool, _Link], list[tuple[int, int | None, bool]]] = {}
        self.batch_of: dict[tuple[int, Action], int] = {}  # a receive's batch on its rank
        self.done: set[_Op] = set()
        self.crossed: list[str] = []

    def post(self, rank: int, actions: list[Action]) -> None:
        ops: list[_Op] = []
        for a in actions:
            send = a.kind in (K.SEND_F, K.SEND_B)
            forward = a.kind in (K.SEND_F, K.RECV_F)
            step = 1 if forward == send else -1  # towards the other end's stage
            peer = self.owners[a.stage + step]
            link = (rank, peer) if send else (peer, rank)
            # The transfer both ends name: (sending stage, microbatch, direction).
            transfer = (a.stage if send else a.stage + step, a.microbatch, forward)
            mine = self.messages.setdefault((send, link), [])
            mine.append(transfer)
            theirs = self.messages.get((not send, link), [])
            k = len(mine) - 1
            if k < len(theirs) and theirs[k] != transfer:
                self.crossed.append(
                    f"message {k} from rank {link[0]} to rank {link[1]} is "
                    f"{_name(transfer)} at one end and {_name(theirs[k])} at the other"
                )
            ops.append((send, link, k))
            if not send:
                self.batch_of[(rank, a)] = len(self.streams[rank])
        self.streams[rank].append(ops)

    def blocked(self, rank: int, kind: str, item: Action | list[Action]) -> bool:
        """Whether the program of ``rank`` must wait at ``item``."""
        if kind == "settle":
            assert isinstance(item, Action)
            return self.running[rank] <= self.batch_of[(rank, item)]
        if kind != "compute":
            return False
        assert isinstance(item, Action)
        receive = input_receive(item)
        if receive is None:
            return False
        batch = self.batch_of.get((rank, receive))
        return batch is not None and self.running[rank] <= batch

    def run(self) -> None:
        moved = True
        while moved and not self.crossed:
            moved = False
            for rank, items in self.programs.items():
                while self.position[rank] < len(items):
                    kind, item = items[self.position[rank]]
                    if self.blocked(rank, kind, item):
                        break
                    if kind == "batch":
                        assert isinstance(item, list)
                        self.post(rank, item)
                    self.position[rank] += 1
                    moved = True
            posted = {
                op
                for rank, stream in self.streams.items()
                if self.running[rank] < len(stream)
                for op in stream[self.running[rank]]
            }
            for rank, stream in self.streams.items():
                if self.running[rank] == len(stream):
                    continue
                for send, link, k in stream[self.running[rank]]:
                    if (not send, link, k) in posted and (send, link, k) not in self.done:
                        self.done.add((send, link, k))
                        moved = True
                if all(op in self.done for op in stream[self.running[rank]]):
                    self.running[rank] += 1
                    moved = True

    def stuck(self) -> list[str]:
        out = []
        for rank, items in self.programs.items():
            stream = self.streams[rank]
            if self.position[rank] == len(items) and self.running[rank] == len(stream):
                continue
            at = items[self.position[rank]][1] if self.position[rank] < len(items) else None
            where = "at its end" if at is None else f"at {_text(at)}"
            waiting = [op for op in stream[self.running[rank]] if op not in self.done]
            ops = ", ".join(
                f"{'send to' if send else 'receive from'} rank {link[1] if send else link[0]}"
                for send, link, _ in waiting
            )
            out.append(f"rank {rank} is {where}, its stream waiting on: {ops or 'nothing'}")
        return out


def _name(transfer: tuple[int, int | None, bool]) -> str:
    stage, microbatch, forward = transfer
    what = "activations" if forward else "gradients"
    return f"the {what} of stage {stage} microbatch {microbatch}"


def _text(item: Action | list[Action]) -> str:
    return " ".join(map(str, item)) if isinstance(item, list) else str(item)
