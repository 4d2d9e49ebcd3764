"""What the root of a ``fully_shard`` tree tracks across forward and backward passes.

Per-unit state lives in ``state.FSDPState``; a pass spans every unit under the root, and
its bookkeeping lives here, once, in the root's :class:`RootPass`: which unit began the
forward pass, the order units ran in during the first pass (the implicit prefetch order),
the gradient reductions in flight across units, and the end-of-backward callback.

The pass drives the units through the few per-unit operations of :class:`PassMember`
(``FSDPState`` implements them); it never reads a unit's fields.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any, Generic, Protocol, TypeVar

from plait import spmd
from plait.fsdp.group import FSDPParamGroup
from plait.hooks import CompiledAutogradError, queue_end_of_backward, traced


class PassMember(Protocol):
    """What a root's pass asks of each unit under it (see ``state.FSDPState``)."""

    def abandon_forward(self) -> None: ...

    def finish_reductions(self) -> None: ...

    def finish_unrun_forward(self, output: Any, grad: bool) -> Any: ...

    def catch_up_backward(self) -> None: ...

    def end_backward(self, finish_reductions: bool) -> None: ...

    def forget_step(self) -> None: ...


S = TypeVar("S", bound=PassMember)


class RootPass(Generic[S]):
    """The root's bookkeeping of its passes over ``states`` (pre-order, the root first).

    Held by the root's state only (``FSDPState.root_pass``); the units reach it through
    their ``root``. The root's lazy initialisation fills in ``states`` and starts recording
    the order of the first pass. Before that, a setter called on a module that may still
    become the root (``set_is_last_backward``, ``set_post_optim_event``) creates it early
    to keep the value; lazy initialisation drops those of the units that are not the root.
    """

    def __init__(self) -> None:
        self.states: list[S] = []
        self.forward_root: S | None = None  # the unit whose forward began the current pass
        # The first pass records the order units run in; the prefetch targets follow.
        self.recording_order = False
        self.forward_order: list[S] = []  # pre-forward order of units with parameters
        self.post_forward_order: list[S] = []  # its reverse is the backward order
        self.next_in_forward: dict[int, S] = {}
        self.next_in_backward: dict[int, S] = {}
        self.callback_queued = False
        self.api_name = "fully_shard"  # the root's API, named when compiled autograd is refused
        self.is_last_backward = True  # False: leave the last reductions in flight
        self.post_optim_event: Any = None  # waited on once, at the next forward pass
        self.max_reductions_in_flight = 1  # the largest of the units' max_input_buffers
        self.reducing: list[FSDPParamGroup] = []  # units whose reduction is in flight
        self.across: list[FSDPParamGroup] = []  # units with only an all-reduce in flight (HSDP)

    @property
    def root(self) -> S:
        return self.states[0]

    # --- forward ------------------------------------------------------------------------------

    def begin(self, starter: S) -> None:
        """A forward pass starts at ``starter`` (the root, or a unit run on its own)."""
        self.forward_root = starter
        if starter is self.root:  # drop what an abandoned pass of a unit alone left behind
            for state in self.states:
                if state is not self.root:
                    state.abandon_forward()
        event, self.post_optim_event = self.post_optim_event, None
        if event is not None:  # the optimizer step's work must finish before we gather
            event.wait()
        for state in self.states:  # reductions left open by set_is_last_backward(False)
            state.finish_reductions()

    def record_forward(self, state: S) -> None:
        if self.recording_order:
            self.forward_order.append(state)

    def record_post_forward(self, state: S) -> None:
        if self.recording_order:
            self.post_forward_order.append(state)

    def end(self, output: Any, grad: bool) -> Any:
        """The pass is over. Units of several modules some of which did not run finish
        their forward now; their backward starts with the pass output's gradient."""
        for state in reversed(self.states):
            if state is not self.forward_root:
                output = state.finish_unrun_forward(output, grad)
        self.forward_root = None
        if self.recording_order:  # the first pass recorded the order units run in
            self.recording_order = False
            fwd, post = self.forward_order, self.post_forward_order
            self.next_in_forward = {id(a): b for a, b in pairwise(fwd)}
            self.next_in_backward = {id(b): a for a, b in pairwise(post)}
        return output

    def next_unit(self, state: S, forward: bool) -> S | None:
        """The unit after ``state`` in forward (or backward) order: its implicit prefetch.

        None while the order is still being recorded, and in forward when a unit runs on
        its own (nothing runs after it).
        """
        if self.recording_order or (forward and self.forward_root is not self.root):
            return None
        return (self.next_in_forward if forward else self.next_in_backward).get(id(state))

    # --- backward -----------------------------------------------------------------------------

    def reduce(self, unit: FSDPParamGroup) -> None:
        """Start ``unit``'s gradient reduction. First, the units whose all-reduce across
        replicas (HSDP) the previous call issued finish; then, while
        ``max_reductions_in_flight`` reductions are in flight, the oldest's reduce-scatter
        is waited for and its all-reduce issued, left in flight until the next call (the
        backward in between hides it), or it finishes: memory stays bounded."""
        for older in self.across:
            older.finish_reduce()
        self.across = []
        while len(self.reducing) >= self.max_reductions_in_flight:
            oldest = self.reducing.pop(0)
            if oldest.reduce_across():
                self.across.append(oldest)
        unit.reduce_grads()
        self.reducing.append(unit)

    def queue_finish(self) -> None:
        """Make sure :meth:`finish_backward` runs once at the end of this backward."""
        if not self.callback_queued:
            try:
                queue_end_of_backward(self.finish_backward, self.api_name)
            except CompiledAutogradError:  # refused: forget the step's forward, reshard
                self.reset()
                raise
            self.callback_queued = True

    def finish_backward(self) -> None:
        """The end-of-backward callback: units this backward reached whose post-backward
        never fired (their inputs needed no gradient) and conditional units reduce now;
        then every unit waits for its reductions (unless ``is_last_backward`` is False)
        and reshards, in a fixed order so all ranks issue the same collectives."""
        with traced("plait.fsdp.finish_backward"):
            for state in reversed(self.states):
                state.catch_up_backward()
            for state in self.states:
                state.end_backward(finish_reductions=self.is_last_backward)
        if self.is_last_backward:
            self.reducing, self.across = [], []
        self.forward_root = None
        self.callback_queued = False
        spmd.check("end of a fully_shard backward")

    def reset(self) -> None:
        """Recover after an exception in forward or backward (see
        ``FSDPModule.reset_iter_state``). In-flight gradient reductions are dropped."""
        for state in self.states:
            state.forget_step()
        self.reducing, self.across = [], []
        self.forward_root = None
        self.callback_queued = False
