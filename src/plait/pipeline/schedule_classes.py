"""torch's schedule classes (the home of ``torch.distributed.pipelining.schedules``' names):
each is :class:`~plait.pipeline.pipeline_schedule.PipelineSchedule` with a name and
torch's positional order of the constructor's parameters.

``ScheduleGPipe``, ``Schedule1F1B`` and ``_ScheduleForwardOnly`` take one stage per rank;
``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` take this rank's list of stages. Each
builds its order once and runs it at every ``step``. ``_PipelineScheduleRuntime`` (and
``PipelineScheduleMulti`` / ``Single`` built directly) start without an order:
``_load_csv(filename, format)`` or ``_prepare_schedule_with_comms(actions, format)`` gives
them one. ``get_schedule_class(name)`` finds a class by torch's case-insensitive name.

The constructor's parameters are written once, on ``PipelineSchedule``. torch binds them
by position in four orders, each declared here as a :class:`_TorchOrder` (names only):
code that passes torch's arguments by position binds them the same on plait, and
``inspect.signature`` shows torch's order.

``_PipelineScheduleRuntime`` and the classes derived from it (the looped and V schedules,
as in torch) take ``register_custom_function(computation_type, fn)``
(:mod:`~plait.pipeline.custom`); torch's computation type names (``FORWARD``, ...,
``OVERLAP_F_B``) and ``_PipelineContext`` are importable from here, as from torch's module.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

import torch

from plait.pipeline.actions import OVERLAP_F_B, ActionKind
from plait.pipeline.custom import CustomFunction, _PipelineContext, register
from plait.pipeline.ordering import Order, check_pair_steps, forward_only
from plait.pipeline.pipeline_schedule import PipelineSchedule
from plait.pipeline.stage import PipelineStage

__all__ = [
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "FORWARD",
    "FULL_BACKWARD",
    "OVERLAP_F_B",
    "REDUCE_GRAD",
    "RESHARD",
    "SCHEDULE_CLASSES",
    "UNSHARD",
    "PipelineSchedule",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
    "_PipelineContext",
    "_PipelineScheduleRuntime",
    "_ScheduleForwardOnly",
    "get_schedule_class",
]

# torch's module-level names of the computation types a custom function may replace.
FORWARD = ActionKind.FORWARD
FULL_BACKWARD = ActionKind.FULL_BACKWARD
BACKWARD_INPUT = ActionKind.BACKWARD_INPUT
BACKWARD_WEIGHT = ActionKind.BACKWARD_WEIGHT
UNSHARD = ActionKind.UNSHARD
RESHARD = ActionKind.RESHARD
REDUCE_GRAD = ActionKind.REDUCE_GRAD

_C = TypeVar("_C", bound=type[PipelineSchedule])


class _TorchOrder:
    """One of torch's positional orders of ``PipelineSchedule``'s parameters: ``names``
    bind by position, in this order, the other parameters by keyword only. A first name
    ``"stage"`` is ``stages`` given as one stage (torch's single-stage classes).

    As a class decorator it shows the order to ``inspect.signature``; :meth:`arguments`
    binds a call made in it."""

    def __init__(self, *names: str) -> None:
        shared = inspect.signature(PipelineSchedule.__init__)
        this, *rest = shared.parameters.values()
        by_name = {p.name: p for p in rest}
        by_name["stage"] = by_name["stages"].replace(name="stage", annotation="PipelineStage")
        positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
        ordered = [by_name[n].replace(kind=positional) for n in names]
        keyword = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in rest
            if p.name not in names and p.name != "stages"
        ]
        self.signature = shared.replace(parameters=[this, *ordered, *keyword])

    def __call__(self, cls: _C) -> _C:
        setattr(cls.__init__, "__signature__", self.signature)  # noqa: B010 - a function
        return cls

    def arguments(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The keyword arguments of ``PipelineSchedule.__init__`` for a call (``self``
        first) in this order; TypeError as Python's for a call that does not bind."""
        bound = dict(self.signature.bind(*args, **kwargs).arguments)
        del bound["self"]
        if "stage" in bound:
            bound["stages"] = [bound.pop("stage")]
        return bound


_SPECS = ("args_chunk_spec", "kwargs_chunk_spec", "output_merge_spec")
_SINGLE = _TorchOrder("stage", "n_microbatches", "loss_fn", *_SPECS, "scale_grads")
_MULTI = _TorchOrder(
    "stages",
    "n_microbatches",
    "loss_fn",
    *_SPECS,
    "use_full_backward",
    "scale_grads",
    "backward_requires_autograd",
)
_RUNTIME = _TorchOrder(
    "stages",
    "n_microbatches",
    "loss_fn",
    *_SPECS,
    "scale_grads",
    "backward_requires_autograd",
    "defer_pp_recv",
)
_LOOPED_BFS = _TorchOrder(
    "stages",
    "n_microbatches",
    "loss_fn",
    "output_merge_spec",  # torch's LoopedBFS takes no chunk specs: dim 0 is cut
    "scale_grads",
    "backward_requires_autograd",
    "defer_pp_recv",
)


@_SINGLE
class PipelineScheduleSingle(PipelineSchedule):
    """A schedule with one stage per rank: ``(stage, n_microbatches, loss_fn=None, ...)``."""

    name = "PipelineScheduleSingle"

    def __init__(self, stage: PipelineStage, *args: Any, **kwargs: Any) -> None:
        if not isinstance(stage, PipelineStage):
            raise TypeError(
                f"{self.name} takes one PipelineStage (one stage per rank), got "
                f"{type(stage).__name__}; for several stages per rank use "
                "ScheduleInterleaved1F1B or ScheduleLoopedBFS"
            )
        super().__init__(**_SINGLE.arguments(self, stage, *args, **kwargs))


@_MULTI
class PipelineScheduleMulti(PipelineSchedule):
    """A schedule over a list of this rank's stages (torch's positional order, in which
    ``use_full_backward`` comes before ``scale_grads``)."""

    name = "PipelineScheduleMulti"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        arguments = _MULTI.arguments(self, *args, **kwargs)
        if isinstance(arguments["stages"], PipelineStage):
            raise TypeError(f"{self.name} takes a list of this rank's stages, got one stage")
        super().__init__(**arguments)


@_RUNTIME
class _PipelineScheduleRuntime(PipelineScheduleMulti):
    """torch's runtime over an order given as data: build it, then give it its order with
    ``_load_csv(filename, format)`` or ``_prepare_schedule_with_comms(actions, format)``.
    The looped and V schedules below derive from it, as in torch, and take its positional
    order (``scale_grads, backward_requires_autograd, defer_pp_recv`` after the specs)."""

    name = "PipelineScheduleRuntime"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(**_RUNTIME.arguments(self, *args, **kwargs))

    def register_custom_function(
        self, computation_type: object, custom_function: CustomFunction
    ) -> None:
        """Run ``custom_function(action, ctx)`` in place of every action of
        ``computation_type`` (F, B, I, W, OVERLAP_F_B, UNSHARD, RESHARD or REDUCE_GRAD)
        from the next step on; see :mod:`~plait.pipeline.custom`. ValueError for another
        type; registering a type again replaces its function, with a warning. For
        ``OVERLAP_F_B``, ScheduleError if the order, with each pair run as one step,
        could deadlock."""
        register(self._custom, computation_type, custom_function)
        if OVERLAP_F_B in self._custom and self._order is not None:
            check_pair_steps(self._order)


class _ScheduleForwardOnly(PipelineScheduleSingle):
    """Forwards only, microbatch after microbatch, one stage per rank (torch's private
    forward-only schedule): ``step`` runs as :meth:`eval` (no graph, no loss) and returns
    the merged output on the last stage's rank. Passing ``target`` or ``losses`` raises
    RuntimeError, as in torch."""

    name = "ForwardOnly"

    def _generate(self) -> Order:
        return forward_only(self.name, self._shape, self._lowering)

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Forwards of every microbatch; the merged output on the last stage's rank."""
        if target is not None or losses is not None or kwargs.get("target_mbs") is not None:
            raise RuntimeError(
                f"{self.name} does not support loss computation: call step() without "
                "target=, target_mbs= and losses= (for losses, use a training schedule such "
                "as ScheduleGPipe, or its eval())"
            )
        return self.eval(*args, **kwargs)


class ScheduleGPipe(PipelineScheduleSingle):
    """All forwards, then all backwards."""

    name = "GPipe"


class Schedule1F1B(PipelineScheduleSingle):
    """Warm-up forwards, then one forward and one backward at a time."""

    name = "1F1B"


class ScheduleInterleaved1F1B(_PipelineScheduleRuntime):
    """1F1B over several looped stages per rank (Megatron's interleaving)."""

    name = "Interleaved1F1B"


@_LOOPED_BFS
class ScheduleLoopedBFS(_PipelineScheduleRuntime):
    """Breadth-first over several looped stages per rank (torch's arguments: no chunk
    specs, whole tensors are cut on dim 0)."""

    name = "LoopedBFS"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(**_LOOPED_BFS.arguments(self, *args, **kwargs))


class ScheduleInterleavedZeroBubble(_PipelineScheduleRuntime):
    """Interleaved 1F1B with the backward split into input (I) and weight (W) halves."""

    name = "InterleavedZeroBubble"


class ScheduleZBVZeroBubble(_PipelineScheduleRuntime):
    """ZB-V: two stages per rank in a V, split backward."""

    name = "ZBVZeroBubble"


class ScheduleDualPipeV(_PipelineScheduleRuntime):
    """DualPipeV (DeepSeek-V3): two stages per rank in a V; in the steady state each rank
    runs a forward of one of its stages with a backward of the other (an overlapped pair,
    torch's ``OVERLAP_F_B``: see :func:`~plait.pipeline.schedules.dualpipe_v`), which a
    custom function registered for ``OVERLAP_F_B`` runs as one unit. Needs
    n_microbatches >= num_stages (ValueError otherwise, as in torch)."""

    name = "DualPipeV"


SCHEDULE_CLASSES: dict[str, type[PipelineSchedule]] = {
    cls.name: cls
    for cls in (
        ScheduleGPipe,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleLoopedBFS,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
        ScheduleDualPipeV,
    )
}
"""The class of every schedule of :data:`~plait.pipeline.schedules.SCHEDULES`, by the same
name (``SCHEDULE_CLASSES[schedule_spec(name).name]`` for a case-insensitive name)."""


def get_schedule_class(schedule_name: str) -> type[PipelineSchedule]:
    """The schedule class named ``schedule_name``, case-insensitive, as torch's
    ``get_schedule_class``: a name of :data:`SCHEDULE_CLASSES` (``"1F1B"``, ``"GPipe"``,
    ``"DualPipeV"``, ...) or ``"PipelineScheduleSingle"`` / ``"PipelineScheduleMulti"``.
    Raises ValueError naming the unknown name and the known ones."""
    known: dict[str, type[PipelineSchedule]] = {
        **SCHEDULE_CLASSES,
        "PipelineScheduleSingle": PipelineScheduleSingle,
        "PipelineScheduleMulti": PipelineScheduleMulti,
    }
    by_lower = {name.lower(): cls for name, cls in known.items()}
    if not isinstance(schedule_name, str) or schedule_name.lower() not in by_lower:
        raise ValueError(
            f"Unknown schedule name {schedule_name!r}. The valid options are {list(known)}"
        )
    return by_lower[schedule_name.lower()]
