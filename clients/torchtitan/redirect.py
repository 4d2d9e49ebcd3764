"""Point torchtitan's imports of torch's composable APIs at plait's names.

This is the only thing that differs between the torch run and the plait run. It changes
imports and nothing else: no argument is renamed, no method added, no behaviour adapted.

How: ``builtins.__import__`` is wrapped. When a module of the ``torchtitan`` package runs
``from <torch module> import <names>`` for one of the modules in :data:`PLAIT_HOMES`, it
gets a view of that torch module in which the names below resolve to plait's objects.
Everything else (torch itself, plait, torch.distributed.checkpoint, ...) keeps seeing
torch's real modules, so torch's internals are untouched.

Which names are redirected, per torch module:

* :data:`REQUIRED` names always come from plait: the names that issue 18 says a torch
  user swaps (``fully_shard`` and its family, the activation-checkpoint wrapper,
  ``PipelineStage`` and the schedule classes). If plait does not export one, torchtitan
  gets a placeholder that raises ``NotImplementedError`` naming it when used (called,
  subclassed or read), so a run fails exactly where torchtitan needs the missing name
  and not at import time.
* any other name that torchtitan imports from these modules comes from plait when plait
  exports that name (e.g. ``DataParallelMeshDims``), else from torch (plain data types
  and helpers plait has no reason to define).

Each resolution is recorded in :data:`RESOLVED` so the driver can write it out.
"""

from __future__ import annotations

import builtins
import importlib
import types
from typing import Any

# torch module -> the plait modules searched, in order, for its names.
PLAIT_HOMES: dict[str, tuple[str, ...]] = {
    "torch.distributed.fsdp": ("plait", "plait.fsdp"),
    "torch.distributed._composable.fsdp": ("plait", "plait.fsdp"),
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper": (
        "plait.checkpoint",
        "plait",
    ),
    "torch.distributed.pipelining": ("plait.pipeline",),
    "torch.distributed.pipelining.schedules": ("plait.pipeline",),
}

_FSDP_NAMES = (
    "fully_shard",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "CPUOffloadPolicy",
    "OffloadPolicy",
)
_SCHEDULE_NAMES = (
    "_PipelineSchedule",
    "_PipelineScheduleRuntime",
    "PipelineScheduleSingle",
    "PipelineScheduleMulti",
    "get_schedule_class",
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)

REQUIRED: dict[str, tuple[str, ...]] = {
    "torch.distributed.fsdp": _FSDP_NAMES,
    "torch.distributed._composable.fsdp": _FSDP_NAMES,
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper": (
        "checkpoint_wrapper",
        "CheckpointImpl",
        "CheckpointWrapper",
    ),
    "torch.distributed.pipelining": ("PipelineStage", *_SCHEDULE_NAMES),
    "torch.distributed.pipelining.schedules": _SCHEDULE_NAMES,
}

RESOLVED: dict[str, str] = {}
"""``"torch.module.name" -> "plait.module.name" | "torch" | "MISSING in plait"``."""


class _MissingMeta(type):
    """Metaclass of placeholders: usable in annotations, fails clearly when used."""

    _message: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(cls._message)

    def __getattr__(cls, attr: str) -> Any:
        raise NotImplementedError(f"{cls._message} (attribute {attr!r} was read)")

    def __instancecheck__(cls, obj: object) -> bool:
        return False

    def __subclasscheck__(cls, sub: type) -> bool:
        return False


def _placeholder(torch_module: str, name: str) -> type:
    message = (
        f"plait exports no {name!r} (torchtitan imports it from {torch_module}; "
        f"searched {', '.join(PLAIT_HOMES[torch_module])})"
    )
    return _MissingMeta(name, (), {"_message": message, "__module__": "plait (missing)"})


def _resolve(torch_module: str, name: str, real: types.ModuleType) -> Any:
    if isinstance(getattr(real, name, None), types.ModuleType):
        return getattr(real, name)  # a submodule: torch's, never plait's namesake
    for home in PLAIT_HOMES[torch_module]:
        module = importlib.import_module(home)
        if hasattr(module, name):
            RESOLVED[f"{torch_module}.{name}"] = f"{home}.{name}"
            return getattr(module, name)
    if name in REQUIRED[torch_module]:
        RESOLVED[f"{torch_module}.{name}"] = "MISSING in plait"
        return _placeholder(torch_module, name)
    RESOLVED[f"{torch_module}.{name}"] = "torch"
    return getattr(real, name)


class _PlaitView(types.ModuleType):
    """A torch module as torchtitan sees it: plait's names first, torch's otherwise."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real = real
        self._cache: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            return getattr(self._real, name)
        if name not in self._cache:
            self._cache[name] = _resolve(self.__name__, name, self._real)
        return self._cache[name]


_views: dict[str, _PlaitView] = {}


def install() -> None:
    """Redirect the imports of every ``torchtitan`` module from now on.

    Must run before torchtitan is imported (the driver calls it first thing).
    """
    original = builtins.__import__

    def redirecting_import(
        name: str,
        globals: dict[str, Any] | None = None,
        locals: dict[str, Any] | None = None,
        fromlist: tuple[str, ...] | list[str] | None = (),
        level: int = 0,
    ) -> Any:
        module = original(name, globals, locals, fromlist, level)
        if level != 0 or not fromlist or name not in PLAIT_HOMES:
            return module
        caller = (globals or {}).get("__name__", "")
        if not (caller == "torchtitan" or caller.startswith("torchtitan.")):
            return module
        if name not in _views:
            _views[name] = _PlaitView(module)
        return _views[name]

    builtins.__import__ = redirecting_import
