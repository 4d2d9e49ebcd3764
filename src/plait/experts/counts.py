"""Row counts on the host: the one place dropless routing reads data to size tensors.

Expert blocks and all-to-all splits are sized by how many rows each expert got, which only
the data says. :func:`host_counts` reads them (one device-to-host sync). Inside
:func:`balanced_counts`, a shape-only run (``plait plan --dry-run``, whose fake tensors
hold no data) takes every count as a perfectly balanced share of the known total instead:
the load a planner assumes, with the code path, the collectives and the tensors' sizes of a
real step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

__all__ = ["balanced_counts", "host_counts", "host_counts_together"]

_BALANCED: ContextVar[bool] = ContextVar("plait_experts_balanced_counts", default=False)


@contextmanager
def balanced_counts() -> Iterator[None]:
    """Within it, :func:`host_counts` splits totals evenly instead of reading tensors."""
    token = _BALANCED.set(True)
    try:
        yield
    finally:
        _BALANCED.reset(token)


def host_counts(counts: torch.Tensor, total: int) -> list[int]:
    """``counts`` (integers, any shape; flattened) as Python ints, summing to ``total``.

    Inside :func:`balanced_counts`: ``total`` split as evenly as integers allow, the first
    entries taking the remainder; ``counts`` is not read.
    """
    if not _BALANCED.get():
        out: list[int] = counts.flatten().tolist()
        return out
    parts = counts.numel()
    share, extra = divmod(total, parts)
    return [share + (i < extra) for i in range(parts)]


def host_counts_together(*pieces: tuple[torch.Tensor, int]) -> list[list[int]]:
    """:func:`host_counts` of each ``(counts, total)`` of ``pieces`` with one
    device-to-host read for all of them (each read waits for the device: on a GPU, every
    read is a stall of the host). The counts may differ in dtype; they are integers."""
    if _BALANCED.get():
        return [host_counts(counts, total) for counts, total in pieces]
    flat = torch.cat([counts.flatten().to(torch.int64) for counts, _ in pieces]).tolist()
    out, start = [], 0
    for counts, _ in pieces:
        out.append(flat[start : start + counts.numel()])
        start += counts.numel()
    return out
