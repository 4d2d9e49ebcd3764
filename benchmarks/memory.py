"""Measure live tensor memory on any device, CPU included, by watching storages.

``LiveTensorBytes`` is a dispatch mode: every tensor an op creates while it is active is
counted until its storage is freed (a weak reference to the storage fires on free; torch
keeps one Python storage object per live storage, so the reference lives exactly as long
as the memory). ``peak`` is the high-water mark of live bytes, ``live`` the current count.
Tensors that existed before the mode started are not counted, so build the model inside it
to include parameters, gradients and optimizer state. It slows every op down: use it on
an untimed step, never inside a timing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref[Any]] = {}

    def _track(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):  # e.g. DTensor: count its local tensors
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._track(inner)
            return
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._refs and self._refs[key]() is storage:
            return
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)

        def on_free(_: object, key: int = key, nbytes: int = nbytes) -> None:
            self.live -= nbytes
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, on_free)

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out
