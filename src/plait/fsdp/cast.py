"""The containers torch's ``fully_shard`` looks into for the tensors of forward inputs and
outputs: mixed precision's casts and the pre-backward hooks on outputs.

torch reaches tensors inside lists, tuples, sets, dicts (``OrderedDict`` keeping its
class), namedtuples and dataclasses (rebuilt with ``dataclasses.replace``, so frozen ones
work too); anything else, ``PackedSequence`` included, is passed through unchanged. A pytree
``tree_map`` alone would miss dataclasses that are not registered as pytree nodes, which is
the common case.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch


def _is_namedtuple(x: object) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_asdict") and hasattr(x, "_fields")


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``tree`` rebuilt with ``fn`` applied to every tensor in it (containers never mutated)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {
            f.name: map_tensors(getattr(tree, f.name), fn)
            for f in dataclasses.fields(tree)
            if f.init  # replace() accepts only init fields
        }
        return dataclasses.replace(tree, **changes)
    if isinstance(tree, OrderedDict):
        return type(tree)((k, map_tensors(v, fn)) for k, v in tree.items())
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if _is_namedtuple(tree):
        return type(tree)(*(map_tensors(x, fn) for x in tree))
    if isinstance(tree, list | tuple | set):
        return type(tree)(map_tensors(x, fn) for x in tree)
    return tree


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor ``map_tensors`` would reach, in order (``tree`` itself is untouched)."""
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(tree, collect)
    return found


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (autograd-visible); a
    tensor already in ``dtype`` is kept as is."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return map_tensors(tree, cast)
