"""Peak live tensor memory, measured: what the planner's memory model is checked against.

:class:`LiveTensors` is a dispatch mode that watches every tensor an operator returns and
counts the bytes of the distinct storages still alive. It samples after every operator,
so its peak is the largest sum of live storage bytes seen at an operator boundary; the
bytes are re-read at each sample, so a storage that ``fully_shard`` frees with
``resize_(0)`` (or regrows) counts at its current size. Views share their base's storage
and count once. It works the same on real CPU tensors, on ``meta`` tensors and on fake
tensors (which have sizes but no data), so one measure serves real runs and dry runs.

Tensors created before the mode was entered are invisible unless :meth:`LiveTensors.watch`
is given them (a model built earlier, say). Storages are held weakly: the mode never keeps
memory alive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveTensors"]


class LiveTensors(TorchDispatchMode):
    """Counts live tensor storages on ``device_type`` (``None``: every device).

    ``peak`` is the largest total seen; ``current`` the total now; ``mark(label)`` records
    the current total under ``label`` (``marks``), and ``reset_peak()`` starts a new peak
    from the current total. Use as a context manager around the code to measure.
    """

    def __init__(self, device_type: str | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        # storage key -> a weak handle that can rebuild the storage while it is alive
        self._live: dict[int, Any] = {}
        self.peak = 0
        self.marks: dict[str, int] = {}

    def watch(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors``' storages from now on (tensors made before the mode began)."""
        for t in tensors:
            self._add(t)
        self._sample()

    def mark(self, label: str) -> int:
        """Record and return the live bytes now."""
        self.marks[label] = self.current
        return self.marks[label]

    def reset_peak(self) -> None:
        self.peak = self.current

    @property
    def current(self) -> int:
        total = 0
        dead = []
        for key, weak in self._live.items():
            if torch.UntypedStorage._expired(weak):
                dead.append(key)
                continue
            total += torch.UntypedStorage._new_with_weak_ptr(weak).nbytes()
        for key in dead:
            torch.UntypedStorage._free_weak_ref(self._live.pop(key))
        return total

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
        storage = t.untyped_storage()
        key = storage._cdata
        old = self._live.get(key)
        if old is not None and not torch.UntypedStorage._expired(old):
            return False  # already counted (a view, or the same tensor again)
        if old is not None:  # a dead storage's address, reused
            torch.UntypedStorage._free_weak_ref(old)
        self._live[key] = storage._weak_ref()
        return True

    def _sample(self) -> None:
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        # Memory only grows by allocation: sample after operators that made a storage.
        # (A storage regrown by ``resize_`` is counted at the next one, while it is still
        # in use: fully_shard regrows a unit's storage to gather into it and compute.)
        if any([self._add(t) for t in tree_leaves(out)]):
            self._sample()
        return out
