"""Cut a batch into microbatches, and glue per-microbatch outputs back together.

Names and behaviour follow ``torch.distributed.pipelining.microbatch``:

* :class:`TensorChunkSpec` says along which dimension an argument is split;
* :func:`split_args_kwargs_into_chunks` splits every tensor (also tensors nested in
  lists, tuples and dicts) of every positional and keyword argument with
  ``torch.tensor_split`` semantics: a batch of ``n`` rows in ``m`` microbatches gives the
  first ``n % m`` microbatches one extra row, so the last microbatch may be smaller.
  Non-tensor values, and arguments whose spec is ``None``, go whole to every microbatch;
* :func:`merge_chunks` concatenates the tensors of per-microbatch outputs.

Each tensor is cut on its own, as torch does: arguments may hold different numbers of rows
(a ``(256, d)`` input beside a ``(4, 1)`` per-microbatch value in 4 microbatches), each
giving every microbatch its own share.

Where plait differs from torch, on purpose: a tensor too small to give every microbatch at
least one row raises ``ValueError`` naming the argument (torch silently makes fewer
microbatches, and the schedule fails later with a less helpful message).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "DEFAULT_CHUNK_DIM",
    "ChunkSpec",
    "TensorChunkSpec",
    "merge_chunks",
    "split_args_kwargs_into_chunks",
]

DEFAULT_CHUNK_DIM = 0


@dataclass(frozen=True)
class TensorChunkSpec:
    """Split (and merge) the tensors of one argument along ``split_dim``."""

    split_dim: int

    @staticmethod
    def from_tuple(dims: Sequence[int]) -> tuple[TensorChunkSpec, ...]:
        """One spec per positional argument: ``from_tuple((0, 1))``."""
        return tuple(TensorChunkSpec(d) for d in dims)

    @staticmethod
    def from_dict(dims: Mapping[str, int]) -> dict[str, TensorChunkSpec]:
        """One spec per keyword argument: ``from_dict({"mask": 0})``."""
        return {name: TensorChunkSpec(d) for name, d in dims.items()}


ChunkSpec = TensorChunkSpec | None
"""How one argument is cut: a :class:`TensorChunkSpec`, or ``None`` to pass it whole to
every microbatch (torch's ``_Replicate``)."""


def split_args_kwargs_into_chunks(
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    chunks: int,
    args_chunk_spec: Sequence[ChunkSpec] | None = None,
    kwargs_chunk_spec: Mapping[str, ChunkSpec] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Cut ``args`` / ``kwargs`` into ``chunks`` microbatches (see the module docstring).

    Returns ``(args_per_microbatch, kwargs_per_microbatch)``, both of length ``chunks``.
    Specs default to dimension 0 for every argument; a spec applies to every tensor inside
    its argument, and each tensor is cut on its own (sizes may differ between tensors).
    Raises ValueError for ``chunks < 1``, a spec list of the wrong length, or a tensor with
    fewer rows than ``chunks``.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks (the number of microbatches) must be an int >= 1, got {chunks}")
    kwargs = kwargs or {}
    if args_chunk_spec is not None and len(args_chunk_spec) != len(args):
        raise ValueError(
            f"args_chunk_spec has {len(args_chunk_spec)} entries but {len(args)} positional "
            "arguments were given: give one TensorChunkSpec (or None) per argument"
        )
    default = TensorChunkSpec(DEFAULT_CHUNK_DIM)
    args_split = [
        _split_value(
            value,
            default if args_chunk_spec is None else args_chunk_spec[i],
            chunks,
            f"positional argument {i}",
        )
        for i, value in enumerate(args)
    ]
    kwargs_split = {
        name: _split_value(
            value,
            (kwargs_chunk_spec or {}).get(name, default),
            chunks,
            f"keyword argument {name!r}",
        )
        for name, value in kwargs.items()
    }
    return (
        [tuple(parts[i] for parts in args_split) for i in range(chunks)],
        [{name: parts[i] for name, parts in kwargs_split.items()} for i in range(chunks)],
    )


def _split_value(value: Any, spec: ChunkSpec, chunks: int, name: str) -> list[Any]:
    """``value`` cut into ``chunks`` pieces: its tensors split along ``spec``, the rest shared."""
    if spec is None:
        return [value] * chunks
    if not isinstance(spec, TensorChunkSpec):
        raise TypeError(f"the spec of {name} must be a TensorChunkSpec or None, got {spec!r}")
    leaves, tree = tree_flatten(value)
    pieces: list[list[Any]] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            pieces.append(list(_split_tensor(leaf, spec.split_dim, chunks, name)))
        else:
            pieces.append([leaf] * chunks)
    return [tree_unflatten([p[i] for p in pieces], tree) for i in range(chunks)]


def _split_tensor(t: torch.Tensor, dim: int, chunks: int, name: str) -> tuple[torch.Tensor, ...]:
    if t.dim() == 0:
        raise ValueError(
            f"{name} is a 0-dim tensor and cannot be split into microbatches: pass a spec "
            "of None for it to give every microbatch the whole value"
        )
    if not -t.dim() <= dim < t.dim():
        raise ValueError(
            f"{name} has {t.dim()} dims; its TensorChunkSpec split_dim={dim} is out of range"
        )
    size = t.shape[dim]
    if size < chunks:
        raise ValueError(
            f"{name} has {size} rows along dim {dim}, fewer than the {chunks} microbatches: "
            f"every microbatch needs at least one row. Use a batch of at least {chunks} or "
            "fewer microbatches."
        )
    return torch.tensor_split(t, chunks, dim)


def merge_chunks(chunks: Sequence[Any], chunk_spec: Any = None) -> Any:
    """Merge per-microbatch values (same structure each) into one whole-batch value.

    ``chunk_spec`` is ``None`` (concatenate every tensor along dim 0), one
    :class:`TensorChunkSpec` for every tensor, or a structure matching the values with a
    spec (or ``None``: take the first microbatch's value) per leaf. Non-tensor leaves must
    be equal in every microbatch. Raises ValueError on mismatched structures or values.
    """
    if not chunks:
        raise ValueError("merge_chunks needs at least one chunk")
    flat = [tree_flatten(c) for c in chunks]
    leaves0, tree = flat[0]
    for i, (_, other) in enumerate(flat[1:], start=1):
        if other != tree:
            raise ValueError(f"microbatch {i}'s output has structure {other}, expected {tree}")
    specs = _leaf_specs(chunk_spec, len(leaves0))
    merged = [
        _merge_leaf([leaves[j] for leaves, _ in flat], spec, j) for j, spec in enumerate(specs)
    ]
    return tree_unflatten(merged, tree)


def _leaf_specs(chunk_spec: Any, n_leaves: int) -> list[ChunkSpec]:
    if chunk_spec is None:
        return [TensorChunkSpec(DEFAULT_CHUNK_DIM)] * n_leaves
    if isinstance(chunk_spec, TensorChunkSpec):
        return [chunk_spec] * n_leaves
    specs, _ = tree_flatten(chunk_spec, is_leaf=lambda x: x is None)
    if len(specs) != n_leaves:
        raise ValueError(
            f"output merge spec has {len(specs)} entries but the output has {n_leaves} leaves"
        )
    return specs


def _merge_leaf(values: list[Any], spec: ChunkSpec, index: int) -> Any:
    first = values[0]
    if spec is None:
        return first
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError(
                f"output leaf {index} is a 0-dim tensor and cannot be concatenated: give it a "
                "merge spec of None, or return a batched tensor"
            )
        return torch.cat(values, dim=spec.split_dim)
    for i, v in enumerate(values[1:], start=1):
        if v != first:
            raise ValueError(
                f"output leaf {index} is {first!r} in microbatch 0 but {v!r} in microbatch {i}"
            )
    return first
