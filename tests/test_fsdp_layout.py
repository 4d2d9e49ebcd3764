"""Property tests of the sharding layout: every element has exactly one owner, copies
between the full and the padded per-rank layout are exact inverses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.fsdp.param import copy_full_to_padded, copy_padded_to_full, shard_rows


@given(rows=st.integers(1, 300), world=st.integers(1, 64))
def test_every_row_has_exactly_one_owner(rows: int, world: int) -> None:
    owners = [0] * rows
    chunks = set()
    for rank in range(world):
        chunk, start, local = shard_rows(rows, rank, world)
        chunks.add(chunk)
        assert 0 <= local <= chunk and 0 <= start <= rows
        for row in range(start, start + local):
            owners[row] += 1
    assert owners == [1] * rows
    assert chunks == {-(-rows // world)}  # every rank pads to the same size (torch.chunk)
    expected = [len(c) for c in torch.arange(rows).chunk(world)]
    assert [shard_rows(rows, r, world)[2] for r in range(len(expected))] == expected


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    tail=st.lists(st.integers(1, 4), max_size=2),
    world=st.integers(1, 9),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64]),
)
def test_full_and_padded_layouts_round_trip(
    rows: int, tail: list[int], world: int, dtype: torch.dtype
) -> None:
    full = torch.arange(rows * int(torch.tensor(tail).prod()), dtype=dtype).view(rows, *tail) + 1
    chunk, _, _ = shard_rows(rows, 0, world)
    padded = torch.full((world, chunk * full[0].numel()), -7, dtype=dtype)
    copy_full_to_padded(full, padded, chunk)
    for rank in range(world):  # each rank's row holds its own rows, then zeros
        _, start, local = shard_rows(rows, rank, world)
        mine = padded[rank].view(chunk, *tail)
        assert torch.equal(mine[:local], full[start : start + local])
        assert not mine[local:].any()
    back = torch.zeros_like(full)
    copy_padded_to_full(padded, back, chunk)
    assert torch.equal(back, full)


@pytest.mark.parametrize(("rows", "rank", "world"), [(0, 0, 2), (4, 2, 2), (4, -1, 2), (4, 0, 0)])
def test_bad_layout_arguments_are_value_errors(rows: int, rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="shard_rows"):
        shard_rows(rows, rank, world)
