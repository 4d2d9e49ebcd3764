"""Where a rank's memory goes under ``fully_shard``: a per-rank report.

``memory_report(module, optimizer)`` counts, on this rank, the bytes held *between steps*
by what ``fully_shard`` manages, plus the one transient that bounds the peak:

* ``sharded_params``: the padded local chunks of every unit's parameters (the storage the
  sharded DTensor parameters view, padding included);
* ``other_params``: parameters of ``module`` that no unit manages (``ignored_params``, or
  modules outside any ``fully_shard``), whole;
* ``gradients``: the storages behind the parameters' ``.grad`` (sharded gradients are
  views of their unit's reduce-scatter output, so padding is included), plus unsharded
  gradients accumulated while gradient sync is off;
* ``optimizer_state``: every tensor in ``optimizer.state`` (DTensors count their local
  part), e.g. AdamW's two moments shaped like the local shards and its ``step`` scalars;
* ``largest_unit``: the unsharded size of the biggest unit, ``sum(numel * itemsize)`` in
  the all-gather dtype (``param_dtype`` under mixed precision): what one unshard
  allocates, and twice this is live while the next unit is prefetched.

Tensors are counted by distinct storage, so views and shared storages count once, and a
storage counts whole (what the allocator holds), on whatever device it lives (CPU under
offload). Activations and communication buffers in flight are not included.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait.fsdp.state import fsdp_states_in

__all__ = ["FSDPMemoryReport", "memory_report"]


@dataclass(frozen=True)
class FSDPMemoryReport:
    """Bytes held by one rank; see the module docstring for what each field counts."""

    rank: int
    units: int
    sharded_params: int
    other_params: int
    gradients: int
    optimizer_state: int
    largest_unit: int
    largest_unit_name: str  # the FQN of the module whose unit is largest ("" for the root)

    @property
    def persistent(self) -> int:
        """Parameters, gradients and optimizer state: held across steps."""
        return self.sharded_params + self.other_params + self.gradients + self.optimizer_state

    def format(self) -> str:
        """A small table, one line per field, sizes in MiB and bytes."""
        name = self.largest_unit_name or "<root>"
        rows = [
            ("sharded parameters", self.sharded_params),
            ("other parameters", self.other_params),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("persistent total", self.persistent),
            (f"largest unit unsharded ({name})", self.largest_unit),
        ]
        width = max(len(label) for label, _ in rows)
        lines = [f"fully_shard memory on rank {self.rank} ({self.units} units)"]
        lines += [f"  {label:<{width}}  {_mib(n):>10} MiB  {n:>14,d} B" for label, n in rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3f}"


class _Storages:
    """Sums storage sizes, each distinct storage once."""

    def __init__(self) -> None:
        self.seen: set[tuple[torch.device, int]] = set()

    def nbytes(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            if isinstance(t, DTensor):
                t = t.to_local()
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if storage.nbytes() == 0 or key in self.seen:
                continue
            self.seen.add(key)
            total += storage.nbytes()
        return total


def memory_report(
    module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> FSDPMemoryReport:
    """This rank's memory for ``module`` (and ``optimizer``); local, no communication."""
    storages = _Storages()
    names = {id(m): name for name, m in module.named_modules()}
    units = [s for s in fsdp_states_in(module) if s.unit is not None]
    managed: set[int] = set()
    sharded = largest = 0
    largest_name = ""
    grads: list[torch.Tensor | None] = []
    for state in units:
        assert state.unit is not None
        unit_bytes = 0
        for p in state.unit.params:
            managed.update(id(t) for t in (p.sharded, p.unsharded) if t is not None)
            sharded += storages.nbytes([p.padded])
            dtype = getattr(p, "param_dtype", None) or p.dtype
            unit_bytes += p.numel * dtype.itemsize
            grads.append(p.sharded.grad)
            grads.append(None if p.unsharded is None else p.unsharded.grad)
            grads.append(getattr(p, "accumulated", None))
        if unit_bytes > largest:
            largest, largest_name = unit_bytes, names.get(id(state.module), "")
    others = [p for p in module.parameters() if id(p) not in managed]
    other_bytes = storages.nbytes(others)
    grad_bytes = storages.nbytes(grads + [p.grad for p in others])
    optim_bytes = 0
    if optimizer is not None:
        optim_bytes = storages.nbytes(
            value
            for per_param in optimizer.state.values()
            for value in per_param.values()
            if isinstance(value, torch.Tensor)
        )
    return FSDPMemoryReport(
        rank=dist.get_rank() if dist.is_initialized() else 0,
        units=len(units),
        sharded_params=sharded,
        other_params=other_bytes,
        gradients=grad_bytes,
        optimizer_state=optim_bytes,
        largest_unit=largest,
        largest_unit_name=largest_name,
    )
