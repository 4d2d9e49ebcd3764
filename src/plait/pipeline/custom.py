"""Custom functions: user code the runtime runs in place of an action, torch's
``_PipelineScheduleRuntime.register_custom_function``.

``schedule.register_custom_function(computation_type, fn)``, with ``computation_type``
one of F, B, I, W, ``OVERLAP_F_B``, UNSHARD, RESHARD, REDUCE_GRAD (plait's
:class:`~plait.pipeline.actions.ActionKind` members, the string ``"OVERLAP_F_B"``, or
torch's own ``_ComputationType`` values, read by their text), makes every later ``step``
and ``eval`` call ``fn(action, ctx)`` for each action of that type in this rank's order,
*instead of* running the action: ``fn`` does the work. Registering a type again replaces
its function (with a warning, as torch); any other type raises ValueError.

``ctx`` is a :class:`_PipelineContext` (torch's fields: ``schedule_ref``, the step's
``arg_mbs`` / ``kwarg_mbs`` / ``target_mbs`` per microbatch, and the ``losses`` list the
caller passed), plus plait's :meth:`_PipelineContext.run_action`, which runs an action
the way the runtime does without a custom function (waiting for its received inputs,
computing the loss on the last stage, handing results to a neighbour stage on this rank).
A custom function typically wraps it, or, for an overlapped pair, runs the pair's two
halves its own way (in another order, on two threads or streams) with it.

``OVERLAP_F_B`` is DualPipeV's overlapped pair (an
:class:`~plait.pipeline.actions.OverlappedPair`, ``sub_actions`` = (F, B)). Without a
function for it, the runtime runs the pair's F then its B by itself, and, as in torch,
functions registered for F or B are not called for a pair's halves. With one, the pair
runs as one step, ordered as torch orders it: the receives of both halves are posted
before the function is called and their sends leave after it returns
(:func:`~plait.pipeline.ordering.pair_steps`). A pair's halves are independent (different
stages and microbatches), so the function may run them in either order or at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch

from plait.pipeline.actions import OVERLAP_F_B, Action, ActionKind, OverlappedPair

__all__ = ["CUSTOM_TYPES", "CustomFunction", "_PipelineContext", "custom_type", "register"]

logger = logging.getLogger(__name__)
K = ActionKind

CUSTOM_TYPES: tuple[str, ...] = (
    K.FORWARD.value,
    K.FULL_BACKWARD.value,
    K.BACKWARD_INPUT.value,
    K.BACKWARD_WEIGHT.value,
    OVERLAP_F_B,
    K.UNSHARD.value,
    K.RESHARD.value,
    K.REDUCE_GRAD.value,
)
"""The text of every computation type a custom function may replace (torch's list)."""


@dataclass
class _PipelineContext:
    """What a custom function gets beside its action, torch's ``_PipelineContext``:
    ``schedule_ref`` (the schedule), ``arg_mbs`` / ``kwarg_mbs`` / ``target_mbs`` (this
    rank's microbatches of the step; ``target_mbs`` None off the last stage) and
    ``losses`` (the list passed to ``step``, filled when the step ends).

    plait adds :meth:`run_action`, the runtime's own way to run an action."""

    schedule_ref: Any
    arg_mbs: list[tuple[Any, ...]] | None = None
    kwarg_mbs: list[dict[str, Any]] | None = None
    target_mbs: list[Any] | None = None
    losses: list[torch.Tensor] | None = None
    runner: Callable[[Action | OverlappedPair], None] | None = field(
        default=None, repr=False, kw_only=True
    )

    def run_action(self, action: Action | OverlappedPair) -> None:
        """Run ``action`` (a compute or FSDP action, or a pair: its F then its B) as the
        runtime does when no custom function replaces it. RuntimeError outside a step."""
        if self.runner is None:
            raise RuntimeError("run_action is only available inside a pipeline step")
        self.runner(action)


class CustomFunction(Protocol):
    """``fn(action, ctx)``: does the work of ``action`` (see the module docstring)."""

    def __call__(self, action: Any, ctx: _PipelineContext) -> None: ...


def custom_type(computation_type: object) -> str:
    """The text of ``computation_type`` (an ActionKind, a string, or torch's
    ``_ComputationType``); ValueError unless a custom function may replace it."""
    text = computation_type.value if isinstance(computation_type, Enum) else computation_type
    if not isinstance(text, str) or text not in CUSTOM_TYPES:
        raise ValueError(
            f"Invalid computation type {computation_type!r}. Only FORWARD, FULL_BACKWARD, "
            "BACKWARD_INPUT, BACKWARD_WEIGHT, OVERLAP_F_B, UNSHARD, RESHARD and REDUCE_GRAD "
            "are supported."
        )
    return text


def register(
    registry: dict[str, CustomFunction], computation_type: object, fn: CustomFunction
) -> None:
    """Add ``fn`` to ``registry`` under ``computation_type`` (see :func:`custom_type`); a
    second function for a type replaces the first, with a warning."""
    key = custom_type(computation_type)
    if key in registry:
        logger.warning(
            "Computation type %s is already registered. Overwriting the existing custom function.",
            key,
        )
    registry[key] = fn
