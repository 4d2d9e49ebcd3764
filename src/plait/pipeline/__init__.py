"""Pipeline parallelism: schedules as data, checkable and simulated without processes.

* :mod:`~plait.pipeline.actions`: the schedule IR (``Action``, text form ``0F3``).
* :mod:`~plait.pipeline.schedules`: pure generators (GPipe, 1F1B, Interleaved1F1B,
  LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) and the lowering passes that
  add communication and FSDP actions.
* :mod:`~plait.pipeline.schedule_csv`: schedules as CSV files in torch's layout.
* :mod:`~plait.pipeline.validate`: :func:`validate`, which names the rank and action at
  fault.
* :mod:`~plait.pipeline.simulate`: timing, bubble fraction, activation memory, charts.

Running them (torch's names):

* :mod:`~plait.pipeline.microbatch`: ``TensorChunkSpec``, ``split_args_kwargs_into_chunks``,
  ``merge_chunks``;
* :mod:`~plait.pipeline.split`: ``split_model``, stage modules that keep parameter names;
* :mod:`~plait.pipeline.stage`: ``PipelineStage``;
* :mod:`~plait.pipeline.trace`: the tracing frontend, ``pipeline(module, mb_args,
  split_spec=...)`` returning a ``Pipe``, ``SplitPoint``, ``pipe_split``, ``build_stage``;
* :mod:`~plait.pipeline.schedule_classes`: ``ScheduleGPipe``, ``Schedule1F1B``, ... (torch's
  names and positional orders) over :mod:`~plait.pipeline.pipeline_schedule`'s
  ``PipelineSchedule``, whose ``step`` runs this rank's order through
  :mod:`~plait.pipeline.runtime`; ``SCHEDULE_CLASSES`` maps each name of ``SCHEDULES`` to its
  class, ``get_schedule_class`` finds one by torch's (case-insensitive) name;
  ``_ScheduleForwardOnly`` runs forwards only; ``_load_csv`` / ``_dump_csv`` read and write a
  schedule's order as CSV; ``register_custom_function`` runs user code in place of an
  action (:mod:`~plait.pipeline.custom`, DualPipeV's ``OVERLAP_F_B`` pairs included).

Behind them, pure and checkable in one process: :mod:`~plait.pipeline.ordering` (a
schedule's order, from generated or given to what each rank runs) and
:mod:`~plait.pipeline.step_inputs` (a step's inputs to this rank's microbatches); with
processes: :mod:`~plait.pipeline.agreement` (the ranks agree on the schedule at its first
run) and :mod:`~plait.pipeline.stage` / :mod:`~plait.pipeline.p2p`.
"""

from typing import TYPE_CHECKING, Any

from plait.lazy import LazyExports
from plait.pipeline.actions import (
    OVERLAP_F_B,
    Action,
    ActionKind,
    OverlappedPair,
    Schedule,
    ScheduleError,
    Style,
    format_schedule,
    parse_action,
    parse_schedule,
    requirements,
    stage_to_rank,
    stages_of_rank,
)
from plait.pipeline.schedule_csv import dump_csv, format_csv, load_csv, parse_csv
from plait.pipeline.schedules import (
    SCHEDULES,
    ScheduleSpec,
    add_communication,
    add_fsdp_actions,
    dualpipe_v,
    dualpipe_v_pairs,
    generate,
    schedule_spec,
)
from plait.pipeline.simulate import (
    Simulation,
    TimedAction,
    format_timeline,
    plot_timeline,
    simulate,
)
from plait.pipeline.validate import validate

if TYPE_CHECKING:
    from plait.pipeline.microbatch import (
        TensorChunkSpec,
        merge_chunks,
        split_args_kwargs_into_chunks,
    )
    from plait.pipeline.p2p import PipelineAbort
    from plait.pipeline.schedule_classes import (
        SCHEDULE_CLASSES,
        PipelineSchedule,
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleLoopedBFS,
        ScheduleZBVZeroBubble,
        _PipelineContext,
        _PipelineScheduleRuntime,
        _ScheduleForwardOnly,
        get_schedule_class,
    )
    from plait.pipeline.split import SkippedLayer, split_model, stage_layers
    from plait.pipeline.stage import PipelineStage
    from plait.pipeline.trace import Pipe, PipeInfo, SplitPoint, build_stage, pipe_split, pipeline

__all__ = [
    "OVERLAP_F_B",
    "SCHEDULES",
    "SCHEDULE_CLASSES",
    "Action",
    "ActionKind",
    "OverlappedPair",
    "Pipe",
    "PipeInfo",
    "PipelineAbort",
    "PipelineSchedule",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "PipelineStage",
    "Schedule",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleError",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleSpec",
    "ScheduleZBVZeroBubble",
    "Simulation",
    "SkippedLayer",
    "SplitPoint",
    "Style",
    "TensorChunkSpec",
    "TimedAction",
    "_PipelineContext",
    "_PipelineScheduleRuntime",
    "_ScheduleForwardOnly",
    "add_communication",
    "add_fsdp_actions",
    "build_stage",
    "dualpipe_v",
    "dualpipe_v_pairs",
    "dump_csv",
    "format_csv",
    "format_schedule",
    "format_timeline",
    "generate",
    "get_schedule_class",
    "load_csv",
    "merge_chunks",
    "parse_action",
    "parse_csv",
    "parse_schedule",
    "pipe_split",
    "pipeline",
    "plot_timeline",
    "requirements",
    "schedule_spec",
    "simulate",
    "split_args_kwargs_into_chunks",
    "split_model",
    "stage_layers",
    "stage_to_rank",
    "stages_of_rank",
    "validate",
]

#: The names that run schedules (they import torch), imported on first use (PEP 562): the
#: schedules as data above serve ``plait plan`` without torch.
_MODULES = {
    "plait.pipeline.microbatch": (
        "TensorChunkSpec",
        "merge_chunks",
        "split_args_kwargs_into_chunks",
    ),
    "plait.pipeline.p2p": ("PipelineAbort",),
    "plait.pipeline.schedule_classes": (
        "SCHEDULE_CLASSES",
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
    ),
    "plait.pipeline.split": ("SkippedLayer", "split_model", "stage_layers"),
    "plait.pipeline.stage": ("PipelineStage",),
    "plait.pipeline.trace": (
        "Pipe",
        "PipeInfo",
        "SplitPoint",
        "build_stage",
        "pipe_split",
        "pipeline",
    ),
}
_LAZY = LazyExports(__name__, _MODULES)


def __getattr__(name: str) -> Any:
    return _LAZY.attribute(name)


def __dir__() -> list[str]:
    return _LAZY.names()
