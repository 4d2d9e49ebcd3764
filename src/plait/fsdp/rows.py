"""The row layout of a shard: torch.chunk semantics along one dim, each rank's rows at the
start of an equally sized, zero-padded chunk (see ``param.py`` for how a parameter uses
it), and the copies between a full tensor and the (world, chunk) padded matrix.

Stateless tensor arithmetic, no communication: the all-gather output is copied out, and the
gradients copied in before the reduce-scatter, through these functions.
"""

from __future__ import annotations

import math

import torch

__all__ = ["copy_full_to_padded", "copy_padded_to_full", "shard_rows"]


def shard_rows(rows: int, rank: int, world: int) -> tuple[int, int, int]:
    """``(chunk_rows, start, local_rows)``: torch.chunk layout of ``rows`` over ``world``.

    Every rank stores ``chunk_rows`` rows (padded); rank ``rank`` owns ``local_rows`` of
    them, from global row ``start`` (``local_rows`` may be less than ``chunk_rows`` or 0).
    """
    if rows < 1 or world < 1 or not 0 <= rank < world:
        raise ValueError(
            f"shard_rows: need rows >= 1 and 0 <= rank < world, got {rows=} {rank=} {world=}"
        )
    chunk_rows = -(-rows // world)
    start = min(rank * chunk_rows, rows)
    return chunk_rows, start, min(chunk_rows, rows - start)


def _row_pairs(
    full: torch.Tensor, padded: torch.Tensor, chunk_rows: int, dim: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Matching views of ``full`` (contiguous) and ``padded`` (world, chunk_rows * row_numel).

    Rows are the slices of ``full`` along ``dim``; rank ``r``'s rows lie contiguous at the
    start of ``padded[r]``. Returns ``(pairs, padding)``: each pair is a (full part, padded
    part) of the same shape, together covering every row of ``full``; ``padding`` are the
    padded elements no row of ``full`` maps to. At most two pairs (the ranks with a whole
    chunk, then the tail rank), so a copy is at most two kernels.
    """
    world, rows = padded.shape[0], full.shape[dim]
    outer = math.prod(full.shape[:dim])
    by_rows = full.view(outer, rows, -1)  # (outer, rows, inner)
    inner = by_rows.shape[2]
    whole = rows // chunk_rows
    pairs = []
    if whole:
        # (whole, outer, chunk, inner) on both sides; a transpose, free when outer is 1.
        chunks = by_rows[:, : whole * chunk_rows].view(outer, whole, chunk_rows, inner)
        blocks = padded[:whole].view(whole, outer, chunk_rows, inner)
        pairs.append((chunks.transpose(0, 1), blocks))
    padding = []
    if whole < world:
        tail_numel = (rows - whole * chunk_rows) * outer * inner
        tail = padded[whole, :tail_numel].view(outer, -1, inner)
        pairs.append((by_rows[:, whole * chunk_rows :], tail))
        padding = [padded[whole, tail_numel:], padded[whole + 1 :]]
    return pairs, padding


def _coincide(full: torch.Tensor, padded: torch.Tensor, chunk_rows: int, dim: int) -> bool:
    """No padding and rows outermost: ``full`` viewed as ``padded``'s shape is the layout."""
    world = padded.shape[0]
    return full.shape[dim] == world * chunk_rows and (
        world == 1 or math.prod(full.shape[:dim]) == 1
    )


def copy_full_to_padded(
    full: torch.Tensor, dest: torch.Tensor, chunk_rows: int, dim: int = 0
) -> None:
    """Scatter ``full`` into ``dest`` (world, chunk_rows * row_numel), zero-padded."""
    if _coincide(full, dest, chunk_rows, dim):
        dest.copy_(full.reshape(dest.shape))
        return
    pairs, padding = _row_pairs(full.contiguous(), dest, chunk_rows, dim)
    for src_rows, dest_rows in pairs:
        dest_rows.copy_(src_rows)
    for rows in padding:
        rows.zero_()


def copy_padded_to_full(
    src: torch.Tensor, full: torch.Tensor, chunk_rows: int, dim: int = 0
) -> None:
    """Gather ``src`` (world, chunk_rows * row_numel) into ``full`` (contiguous)."""
    if _coincide(full, src, chunk_rows, dim):
        full.view(src.shape).copy_(src)
        return
    pairs, _ = _row_pairs(full, src, chunk_rows, dim)
    for full_rows, src_rows in pairs:
        full_rows.copy_(src_rows)
