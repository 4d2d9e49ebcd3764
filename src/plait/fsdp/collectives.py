"""The two collectives of a ``fully_shard`` unit, as stateless functions.

Every rank's contribution to a unit is one flat *segment*: its padded chunk of each
parameter, back to back (``FSDPParam.offset`` says where). All-gather turns segments into
a (world, segment) matrix; reduce-scatter turns a (world, segment + counts) matrix of
gradients back into this rank's reduced segment. Each function issues exactly one
collective, looked up on ``torch.distributed`` at call time (tests count calls by patching
it), and returns the async work for the caller to wait on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from plait.hooks import traced


def all_gather_segments(
    padded_shards: Sequence[torch.Tensor], group: dist.ProcessGroup, world: int
) -> tuple[torch.Tensor, dist.Work | None]:
    """Start gathering every rank's segment; returns the (world, segment) output and work."""
    with traced("plait.fsdp.all_gather"):
        segment = torch.cat([t.reshape(-1) for t in padded_shards])
        out = segment.new_empty(world * segment.numel())
        work = dist.all_gather_single(out, segment, group=group, async_op=True)
    return out.view(world, -1), work


def reduce_scatter_segments(
    matrix: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, dist.Work | None]:
    """Start summing ``matrix`` (world, n) over ranks; this rank receives its row."""
    with traced("plait.fsdp.reduce_scatter"):
        out = matrix.new_empty(matrix.shape[1])
        work = dist.reduce_scatter_single(out, matrix.view(-1), group=group, async_op=True)
    return out, work
