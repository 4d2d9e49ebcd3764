"""torch's ``fully_shard`` / composable modules as the redirected tests see them.

The client rewrites ``from torch.distributed.fsdp[...] import ...`` and ``from
torch.distributed._composable[...] import ...`` in the test files' copies to
``from redirected_fsdp.torch.distributed.fsdp[...] import ...``: the same module path under
this package. Importing this package installs a finder that answers every such name with
a module whose attributes are looked up by :func:`._resolve.resolve` when first imported
(plait's object of the same name; see there for the private modules).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

from ._resolve import resolve

PREFIX = __name__ + "."


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        torch_module = spec.name[len(PREFIX) :]

        def __getattr__(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return resolve(torch_module, name)[0]

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        module.__path__ = []  # a package: deeper torch modules import through it too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(PREFIX + "torch"):
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


sys.meta_path.append(_Finder())
