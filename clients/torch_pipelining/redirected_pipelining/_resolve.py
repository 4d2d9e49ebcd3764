"""Resolve a name the tests import from torch's pipelining modules to plait's object.

Each torch module maps to the plait modules that hold its counterparts, searched in order
for the same name (nothing is renamed or adapted). A name plait does not have becomes a
:class:`Missing` placeholder: the import succeeds, so the tests that do not use it still
run, and the first use (a call, or an attribute of something built from it) raises
``NotImplementedError`` naming the missing name.
"""

from __future__ import annotations

import importlib
from typing import Any, NoReturn

HOMES: dict[str, tuple[str, ...]] = {
    "torch.distributed.pipelining": ("plait.pipeline",),
    "torch.distributed.pipelining.schedules": (
        "plait.pipeline.schedule_classes",
        "plait.pipeline",
    ),
    "torch.distributed.pipelining.stage": ("plait.pipeline.stage", "plait.pipeline"),
    "torch.distributed.pipelining.microbatch": (
        "plait.pipeline.microbatch",
        "plait.pipeline",
    ),
}


class Missing:
    """Stands for a name plait lacks; any real use raises, naming it."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def _fail(self) -> NoReturn:
        raise NotImplementedError(f"plait has no {self._qualname} (redirected import)")

    def __getattr__(self, name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{self._qualname}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._fail()

    def __instancecheck__(self, obj: object) -> bool:
        return False

    def __mro_entries__(self, bases: tuple[Any, ...]) -> NoReturn:
        self._fail()

    def __repr__(self) -> str:
        return f"<missing in plait: {self._qualname}>"


def resolve(torch_module: str, name: str) -> tuple[Any, str]:
    """``(object, where)``: plait's object for ``torch_module.name`` and its home."""
    for home in HOMES[torch_module]:
        module = importlib.import_module(home)
        if hasattr(module, name):
            return getattr(module, name), f"{home}.{name}"
    return Missing(f"{torch_module}.{name}"), "MISSING"
