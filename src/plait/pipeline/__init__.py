"""Pipeline parallelism: schedules as data, checkable and simulated without processes.

* :mod:`~plait.pipeline.actions`: the schedule IR (``Action``, text form ``0F3``).
* :mod:`~plait.pipeline.schedules`: pure generators (GPipe, 1F1B, Interleaved1F1B,
  LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble) and the lowering passes that add
  communication and FSDP actions.
* :mod:`~plait.pipeline.validate`: :func:`validate`, which names the rank and action at
  fault.
* :mod:`~plait.pipeline.simulate`: timing, bubble fraction, activation memory, charts.
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
from plait.pipeline.validate import validate

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "Simulation",
    "Style",
    "TimedAction",
    "add_communication",
    "add_fsdp_actions",
    "format_schedule",
    "format_timeline",
    "generate",
    "parse_action",
    "parse_schedule",
    "plot_timeline",
    "requirements",
    "schedule_spec",
    "simulate",
    "stage_to_rank",
    "validate",
]
