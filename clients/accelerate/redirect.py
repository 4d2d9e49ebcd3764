"""Point accelerate's and transformers' imports of torch's FSDP2 names at plait's.

The only difference between the torch run and the plait run. It changes imports and
nothing else: no argument renamed, no method added, no behaviour adapted.

``builtins.__import__`` is wrapped: when a module of the ``accelerate`` or ``transformers``
package runs ``from <torch module> import <names>`` for a module in :data:`TORCH_MODULES`,
it gets a view of that torch module in which :data:`REDIRECTED` names resolve to plait's
objects (a placeholder raising ``NotImplementedError`` where plait exports no such name).
Every other name (e.g. ``FullyShardedDataParallel``, FSDP1, which is not plait's scope)
stays torch's. torch's and plait's own imports are untouched. Each resolution is recorded
in :data:`RESOLVED`.
"""

from __future__ import annotations

import builtins
import importlib
import types
from typing import Any

CLIENTS = ("accelerate", "transformers")
TORCH_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
PLAIT_HOMES = ("plait", "plait.fsdp")
REDIRECTED = (
    "fully_shard",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "CPUOffloadPolicy",
    "OffloadPolicy",
    "register_fsdp_forward_method",
    "UnshardHandle",
)
RESOLVED: dict[str, str] = {}


def _missing(qualname: str) -> type:
    message = f"plait exports no {qualname.rsplit('.', 1)[1]!r} (imported from {qualname})"

    class _Meta(type):
        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(message)

        def __instancecheck__(cls, obj: object) -> bool:
            return False

    return _Meta("Missing", (), {})


def _resolve(torch_module: str, name: str, real: types.ModuleType) -> Any:
    qualname = f"{torch_module}.{name}"
    if name not in REDIRECTED:
        RESOLVED[qualname] = "torch"
        return getattr(real, name)
    for home in PLAIT_HOMES:
        module = importlib.import_module(home)
        if hasattr(module, name):
            RESOLVED[qualname] = f"{home}.{name}"
            return getattr(module, name)
    RESOLVED[qualname] = "MISSING in plait"
    return _missing(qualname)


class _PlaitView(types.ModuleType):
    """A torch module as the clients see it: plait's FSDP2 names, torch's otherwise."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real = real

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            return getattr(self._real, name)
        value = _resolve(self.__name__, name, self._real)
        setattr(self, name, value)
        return value


_views: dict[str, _PlaitView] = {}


def install() -> None:
    """Redirect the imports of every accelerate / transformers module from now on.

    Works for imports inside functions too (accelerate imports ``fully_shard`` lazily).
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
        if level != 0 or not fromlist or name not in TORCH_MODULES:
            return module
        caller = (globals or {}).get("__name__", "") or ""
        if caller.split(".", 1)[0] not in CLIENTS:
            return module
        if name not in _views:
            _views[name] = _PlaitView(module)
        return _views[name]

    builtins.__import__ = redirecting_import
