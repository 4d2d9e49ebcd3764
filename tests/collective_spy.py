"""Record the collectives a block of code issues, by patching ``torch.distributed``.

plait looks collectives up on ``torch.distributed`` at call time (docs/architecture.md),
so replacing the attribute sees every call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

Call = tuple[torch.dtype, int]  # (dtype, numel) of the collective's first tensor argument


@contextlib.contextmanager
def spy_collectives(*names: str) -> Iterator[dict[str, list[Call]]]:
    """Yield ``{name: [(dtype, numel), ...]}``, filled as the named collectives run."""
    calls: dict[str, list[Call]] = {name: [] for name in names}
    originals = {name: getattr(dist, name) for name in names}

    def spy(name: str) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls[name].append((tensor.dtype, tensor.numel()))
            return originals[name](tensor, *args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, spy(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
