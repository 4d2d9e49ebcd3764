"""Pipeline parallelism: schedules as data, checkable and simulated without processes.

* :mod:`~plait.pipeline.actions`: the schedule IR (``Action``, text form ``0F3``).
* :mod:`~plait.pipeline.schedules`: pure generators (GPipe, 1F1B, Interleaved1F1B,
  LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble) and the lowering passes that add
  communication and FSDP actions.
* :mod:`~plait.pipeline.validate`: :func:`validate`, which names the rank and action at
  fault.
* :mod:`~plait.pipeline.simulate`: timing, bubble fraction, activation memory, charts.

Running them (torch's names):

* :mod:`~plait.pipeline.microbatch`: ``TensorChunkSpec``, ``split_args_kwargs_into_chunks``,
  ``merge_chunks``;
* :mod:`~plait.pipeline.split`: ``split_model``, stage modules that keep parameter names;
* :mod:`~plait.pipeline.stage`: ``PipelineStage``;
* :mod:`~plait.pipeline.schedule_classes`: ``ScheduleGPipe``, ``Schedule1F1B``, ... whose
  ``step`` runs the generated action list through :mod:`~plait.pipeline.runtime`;
  ``SCHEDULE_CLASSES`` maps each name of ``SCHEDULES`` to its class.
"""

from plait.pipeline.actions import (
    Action,
    ActionKind,
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
from plait.pipeline.microbatch import (
    TensorChunkSpec,
    merge_chunks,
    split_args_kwargs_into_chunks,
)
from plait.pipeline.schedule_classes import (
    SCHEDULE_CLASSES,
    PipelineSchedule,
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from plait.pipeline.schedules import (
    SCHEDULES,
    ScheduleSpec,
    add_communication,
    add_fsdp_actions,
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
from plait.pipeline.split import split_model, stage_layers
from plait.pipeline.stage import PipelineStage
from plait.pipeline.validate import validate

__all__ = [
    "SCHEDULES",
    "SCHEDULE_CLASSES",
    "Action",
    "ActionKind",
    "PipelineSchedule",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "PipelineStage",
    "Schedule",
    "Schedule1F1B",
    "ScheduleError",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleSpec",
    "ScheduleZBVZeroBubble",
    "Simulation",
    "Style",
    "TensorChunkSpec",
    "TimedAction",
    "add_communication",
    "add_fsdp_actions",
    "format_schedule",
    "format_timeline",
    "generate",
    "merge_chunks",
    "parse_action",
    "parse_schedule",
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
