"""Peak live tensor memory, measured: what the planner's memory model is checked against.

:class:`LiveTensors` is a dispatch mode that watches every tensor an operator returns and
keeps the bytes of the distinct storages still alive. Views share their base's storage and
count once. The count is kept exactly and cheaply:

* a storage leaves the count when it is freed (torch keeps one Python object per storage
  for as long as the storage lives, so a weak reference to it says when it goes);
* a storage that changes size outside any operator (``fully_shard`` frees an unsharded
  parameter with ``UntypedStorage.resize_(0)`` and regrows it to gather into it) is
  followed through ``resize_``, which the mode wraps while it is active.

The peak is the largest count after an operator that allocated, or a ``resize_`` that grew
a storage. It works the same on real CPU tensors and on fake tensors (sizes, no data), so
one measure serves real runs and dry runs. Tensors created before the mode began are
invisible unless :meth:`LiveTensors.watch` is given them. The mode never keeps memory
alive. Garbage held in reference cycles counts until Python's collector frees it, as it
does for the allocator.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from plait.mesh import buffer_of

__all__ = ["LiveTensors"]


class LiveTensors(TorchDispatchMode):
    """Counts live tensor storages on ``device_type`` (``None``: every device).

    ``current``: the bytes alive now; ``peak``: the largest seen; ``reset_peak()`` starts a
    new peak from ``current``. Use as a context manager around the code to measure.
    """

    def __init__(self, device_type: str | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.current = 0
        self.peak = 0
        # id(storage) -> (a weak reference to it, the bytes counted for it)
        self._counted: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self._resize: Callable[..., Any] | None = None

    def watch(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors``' storages from now on (tensors made before the mode began)."""
        for t in tensors:
            self._add(t)
        self.peak = max(self.peak, self.current)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __enter__(self) -> LiveTensors:
        super().__enter__()
        original = self._resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            before = storage.nbytes()
            out = original(storage, size)
            tracker._resized(storage, before)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[assignment,method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[assignment,method-assign]
        super().__exit__(*exc)

    def _resized(self, storage: torch.UntypedStorage, before: int) -> None:
        entry = self._counted.get(id(storage))
        if entry is None or entry[0]() is not storage:
            return  # not one of ours
        now = storage.nbytes()
        self._counted[id(storage)] = (entry[0], now)
        self.current += now - before
        self.peak = max(self.peak, self.current)

    def _freed(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        entry = self._counted.get(key)
        if entry is not None and entry[0] is ref:  # not a newer storage at the same address
            del self._counted[key]
            self.current -= entry[1]

    def _add(self, t: object) -> bool:
        """Count ``t``'s storage; whether it is new (an allocation)."""
        if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
            return False
        if self.device_type is not None and t.device.type != self.device_type:
            return False
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            # A tensor subclass (DTensor): its storage is the inner tensors'.
            names, _ = t.__tensor_flatten__()
            return any([self._add(getattr(t, name)) for name in names])
        storage = buffer_of(t.untyped_storage())  # a shard's piece counts as its buffer
        key = id(storage)
        entry = self._counted.get(key)
        if entry is not None and entry[0]() is storage:
            return False  # already counted (a view, or the same tensor again)
        if entry is not None:  # a dead storage whose callback has not run yet
            self._freed(key, entry[0])
        nbytes = storage.nbytes()
        self._counted[key] = (weakref.ref(storage, functools.partial(self._freed, key)), nbytes)
        self.current += nbytes
        return True

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if any([self._add(t) for t in tree_leaves(out)]):
            self.peak = max(self.peak, self.current)
        return out
