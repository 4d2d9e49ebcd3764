"""Names a package exports but imports on first use (PEP 562): :class:`LazyExports`.

A package whose exports pull in torch (``plait``, ``plait.pipeline``,
``plait.train.llama``) keeps its torch-free parts importable without torch (``plait plan``
runs on them): it lists where each lazy name lives and delegates its module-level
``__getattr__`` and ``__dir__`` here. The first access imports the name's module and binds
the name in the package, so later accesses are plain attribute reads. Type checkers see
the names through the package's ``if TYPE_CHECKING:`` imports.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["LazyExports"]


class LazyExports:
    """The lazy names of ``package`` (a module name), by the module each lives in."""

    def __init__(self, package: str, modules: Mapping[str, tuple[str, ...]]) -> None:
        self.package = package
        self.where = {name: module for module, names in modules.items() for name in names}

    def attribute(self, name: str) -> Any:
        """The package's ``__getattr__``: ``name`` imported from its module and bound in
        the package; AttributeError for a name it does not export."""
        module = self.where.get(name)
        if module is None:
            raise AttributeError(f"module {self.package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[self.package], name, value)
        return value

    def names(self) -> list[str]:
        """The package's ``__dir__``: what it holds now and every lazy name."""
        return sorted({*vars(sys.modules[self.package]), *self.where})
