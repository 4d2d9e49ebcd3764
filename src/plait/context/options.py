"""Process-wide settings of context parallelism, in torch's vocabulary: the default
attention method (``set_rotate_method``), the default layout (``set_load_balance``), and
the document ids of packed sequences (``packed_documents``).

They are process-wide rather than per thread or per context on purpose: a checkpointed
block recomputes its attention during backward, which autograd may run on another thread
(its device threads), and that recompute must see the settings its forward saw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from plait.context.attention import METHODS, Method

__all__ = [
    "current_documents",
    "defaults",
    "packed_documents",
    "set_load_balance",
    "set_rotate_method",
]


@dataclass
class _Defaults:
    method: Method = "allgather"  # torch's default rotate method
    load_balance: bool = True  # torch balances by default


_DEFAULTS = _Defaults()
_DOCUMENTS: list[torch.Tensor | None] = []


def defaults() -> _Defaults:
    """The current defaults (read when a context or module form is entered)."""
    return _DEFAULTS


def set_rotate_method(rotate_method: str) -> None:
    """The attention method context parallelism uses from now on (torch's name).

    ``"allgather"`` (the default): gather the keys and values. ``"alltoall"``: plait runs
    Ulysses (an all-to-all from a sequence split to a head split and back; the heads must
    divide by cp), where torch passes key/value shards round with all-to-alls; both are
    exact. ``"ring"`` (plait's): pass key/value blocks round the ring with point-to-point
    sends. Anything else raises ``NotImplementedError``, as torch.
    """
    if rotate_method not in METHODS:
        raise NotImplementedError(
            f"context parallelism does not support rotate method {rotate_method!r}: choose "
            f"one of {', '.join(repr(m) for m in METHODS)}"
        )
    _DEFAULTS.method = rotate_method  # type: ignore[assignment]


def set_load_balance(enabled: bool) -> None:
    """Whether sequences are split load-balanced (the default) or plainly from now on."""
    _DEFAULTS.load_balance = bool(enabled)


@contextlib.contextmanager
def packed_documents(document_ids: torch.Tensor | None) -> Iterator[None]:
    """Inside, context-parallel attention keeps each query to keys of its own document:
    ``document_ids`` ``(B, T_local)`` is this rank's part of the per-token document ids
    (in the sequence's layout; ``None`` lifts an outer scope's ids).

    Keep the backward inside the scope too when blocks are activation-checkpointed: their
    recomputed attention reads the ids then.
    """
    _DOCUMENTS.append(document_ids)
    try:
        yield
    finally:
        _DOCUMENTS.pop()


def current_documents() -> torch.Tensor | None:
    """The innermost ``packed_documents`` ids, or None."""
    return _DOCUMENTS[-1] if _DOCUMENTS else None
