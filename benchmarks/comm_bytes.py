"""Count the bytes a rank all-gathers and reduce-scatters, by wrapping c10d's functions.

plait (and torch's ``fully_shard``) look these collectives up on ``torch.distributed`` at
call time, so replacing the attributes while a step runs sees every call. A wrapper adds a
Python call and an addition per collective: negligible beside the collective itself.

Counted per rank: an all-gather's output (the bytes this rank receives, its own share
included) and a reduce-scatter's input (the bytes this rank contributes); both are the
size of the unsharded tensors, which is what an all-gather extension shrinks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

# name -> (kind, (position, keyword) of the tensor counted)
_COUNTED: dict[str, tuple[str, tuple[int, str]]] = {
    "all_gather_single": ("all_gather", (0, "output_tensor")),
    "all_gather_into_tensor": ("all_gather", (0, "output_tensor")),
    "reduce_scatter_single": ("reduce_scatter", (1, "input")),
    "reduce_scatter_tensor": ("reduce_scatter", (1, "input")),
}


@contextlib.contextmanager
def count_comm_bytes() -> Iterator[dict[str, int]]:
    """Yield ``{"all_gather": bytes, "reduce_scatter": bytes}``, growing as collectives run."""
    totals = {"all_gather": 0, "reduce_scatter": 0}
    originals = {name: getattr(dist, name) for name in _COUNTED if hasattr(dist, name)}

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        kind, (position, keyword) = _COUNTED[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = args[position] if len(args) > position else kwargs[keyword]
            if isinstance(tensor, torch.Tensor):
                totals[kind] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    try:
        yield totals
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
