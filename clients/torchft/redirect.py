"""Load the training program with its imports of torch's FSDP2 names pointed at plait.

The only difference between the torch run and the plait run, and it changes imports
only: no argument renamed, no method added, no behaviour adapted.

How: the program module is executed with its own ``__builtins__``, whose ``__import__``
answers ``from torch.distributed.fsdp import ...`` (and the older
``torch.distributed._composable.fsdp``) with a namespace in which the FSDP2 names come
from plait. Nothing global is patched: torch, torchft and plait import as usual, and so
does every other import of the program. Each name the program took is recorded in
:data:`RESOLVED`.
"""

from __future__ import annotations

import builtins
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
FSDP2_NAMES = frozenset(
    {
        "fully_shard",
        "FSDPModule",
        "MixedPrecisionPolicy",
        "CPUOffloadPolicy",
        "OffloadPolicy",
        "register_fsdp_forward_method",
        "UnshardHandle",
    }
)
RESOLVED: dict[str, str] = {}


def _plait_namespace(torch_module: types.ModuleType, names: tuple[str, ...]) -> Any:
    """``torch_module`` as the program sees it: plait's FSDP2 names, torch's otherwise."""
    import plait

    namespace = types.SimpleNamespace()
    for name in names:
        qualname = f"{torch_module.__name__}.{name}"
        if name in FSDP2_NAMES:
            if not hasattr(plait, name):
                raise ImportError(f"plait exports no {name!r} (the program imports {qualname})")
            RESOLVED[qualname] = f"plait.{name}"
            setattr(namespace, name, getattr(plait, name))
        else:
            RESOLVED[qualname] = "torch"
            setattr(namespace, name, getattr(torch_module, name))
    return namespace


def _redirecting_import(
    name: str,
    globals: dict[str, Any] | None = None,
    locals: dict[str, Any] | None = None,
    fromlist: tuple[str, ...] | list[str] | None = (),
    level: int = 0,
) -> Any:
    module = builtins.__import__(name, globals, locals, fromlist, level)
    if level == 0 and fromlist and name in FSDP_MODULES:
        return _plait_namespace(module, tuple(fromlist))
    return module


def load(path: Path, module_name: str, on_plait: bool) -> types.ModuleType:
    """Import the program at ``path``; with ``on_plait``, through the redirection."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if on_plait:
        own_builtins = dict(vars(builtins))
        own_builtins["__import__"] = _redirecting_import
        module.__dict__["__builtins__"] = own_builtins
    sys.modules[module_name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module
