"""A unit of ``fully_shard``: the parameters one call manages, communicated together.

The unit owns the two state transitions and the gradient reduction:

* ``unshard`` issues one all-gather of every rank's segment (``async_op`` returns at once)
  and ``wait_for_unshard`` copies the result into the unsharded parameters and puts them
  on the modules;
* ``reshard`` puts the sharded DTensor parameters back and frees the unsharded storage;
* ``reduce_grads`` issues one reduce-scatter of the unsharded gradients (pre-divided by the
  world size, so the result is the average) and ``finish_reduce`` adds this rank's part to
  the sharded gradients. Each rank's row carries one count per parameter of how many ranks
  produced a gradient, so a parameter no rank used keeps ``grad=None``, as in one process.
"""

from __future__ import annotations

from enum import Enum, auto

import torch
import torch.distributed as dist

from plait.fsdp.collectives import all_gather_segments, reduce_scatter_segments
from plait.fsdp.param import FSDPParam
from plait.hooks import traced


class ShardedState(Enum):
    SHARDED = auto()
    UNSHARDED = auto()


class FSDPParamGroup:
    def __init__(self, params: list[FSDPParam], group: dist.ProcessGroup, world: int) -> None:
        self.params = params
        self.group = group
        self.world = world
        offset = 0
        for p in params:
            p.offset = offset
            offset += p.padded_numel
        self.segment_numel = offset
        self.sharded_state = ShardedState.SHARDED
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self._gather: tuple[torch.Tensor, dist.Work | None] | None = None
        self._reduce: tuple[torch.Tensor, dist.Work | None, torch.Tensor] | None = None

    # --- unshard / reshard ---------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Issue the all-gather unless the unit is unsharded or already being gathered."""
        if self.sharded_state is ShardedState.SHARDED and self._gather is None:
            self._gather = all_gather_segments(
                [p.padded for p in self.params], self.group, self.world
            )
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Finish an issued all-gather (issuing one if needed) and swap in full parameters."""
        if self.sharded_state is ShardedState.UNSHARDED:
            return
        if self._gather is None:
            self.unshard(async_op=True)
        assert self._gather is not None
        gathered, work = self._gather
        self._gather = None
        with traced("plait.fsdp.copy_out"):
            if work is not None:
                work.wait()
            for p in self.params:
                p.copy_out(gathered[:, p.offset : p.offset + p.padded_numel])
                p.set_on_modules(p.unsharded)  # type: ignore[arg-type]
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        if self._gather is not None:  # a prefetch nobody used: complete it, then drop it
            self.wait_for_unshard()
        if self.sharded_state is ShardedState.SHARDED:
            return
        for p in self.params:
            p.set_on_modules(p.sharded)
            p.free_unsharded()
        self.sharded_state = ShardedState.SHARDED

    # --- gradient reduction -------------------------------------------------------------

    def reduce_grads(self) -> None:
        """Issue the reduce-scatter of the accumulated unsharded gradients."""
        self.finish_reduce()
        width = self.segment_numel + len(self.params)
        first = self.params[0]
        matrix = torch.empty((self.world, width), dtype=first.dtype, device=first.padded.device)
        used = [
            p.copy_grad_in(matrix[:, p.offset : p.offset + p.padded_numel]) for p in self.params
        ]
        matrix[:, : self.segment_numel].div_(self.world)
        matrix[:, self.segment_numel :] = torch.tensor(used, dtype=matrix.dtype)
        for p in self.params:
            if p.unsharded is not None:
                p.unsharded.grad = None
        out, work = reduce_scatter_segments(matrix, self.group)
        self._reduce = (out, work, matrix)

    def finish_reduce(self) -> None:
        """Wait for an issued reduce-scatter and accumulate into the sharded gradients."""
        if self._reduce is None:
            return
        out, work, _ = self._reduce
        self._reduce = None
        if work is not None:
            work.wait()
        counts = out[self.segment_numel :].tolist()
        for p, count in zip(self.params, counts, strict=True):
            if count > 0:
                p.accumulate_sharded_grad(out[p.offset : p.offset + p.padded_numel])

    @property
    def busy(self) -> bool:
        """An all-gather is in flight (the modules are about to receive full parameters)."""
        return self._gather is not None
