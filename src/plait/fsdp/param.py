"""One parameter managed by ``fully_shard``: its shard, its unsharded form, and the swap.

Layout (torch.chunk semantics along dim 0): with ``world`` ranks a parameter of ``rows``
rows is cut into chunks of ``chunk = ceil(rows / world)`` rows; rank ``r`` owns rows
``[r * chunk, min((r + 1) * chunk, rows))``, which may be fewer than ``chunk`` (the tail)
or none at all. Each rank stores its chunk *padded* to ``chunk`` rows so that every rank
contributes the same number of elements to the unit's all-gather; padding is never seen by
the user.

Between uses the module holds the **sharded parameter**: an ``nn.Parameter`` wrapping a
DTensor with placement ``Shard(0)`` whose local tensor is the unpadded view of the padded
chunk. While unsharded it holds the **unsharded parameter**: a plain ``nn.Parameter`` of
the full shape that is created once and whose storage is freed (``resize_(0)``) at reshard
and reallocated at unshard. Keeping the same object alive lets autograd, which saved it
during forward, see the re-gathered values during backward.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


@dataclass(frozen=True)
class Location:
    """Where the module tree refers to a parameter (tied weights have several)."""

    module: nn.Module
    name: str
    fqn: str


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def shard0_spec(mesh: DeviceMesh, shape: torch.Size, dtype: torch.dtype) -> DTensorSpec:
    """The (immutable, shareable) spec of a ``Shard(0)`` DTensor of global ``shape``."""
    meta = TensorMeta(shape, contiguous_strides(shape), dtype)
    return DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)


def make_dtensor(local: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False) -> DTensor:
    """A DTensor around ``local`` with a precomputed spec: no communication, no checks.

    Built directly rather than through ``DTensor.from_local`` because gradients are
    wrapped for every parameter at every step, and the public path costs far more.
    """
    return DTensor(local, spec, requires_grad=requires_grad)


class FSDPParam:
    """A parameter of one unit; ``offset`` is its place in the unit's per-rank flat segment."""

    def __init__(
        self,
        param: nn.Parameter,
        locations: list[Location],
        mesh: DeviceMesh,
        rank: int,
        world: int,
    ) -> None:
        self.locations = locations
        self.fqn = locations[0].fqn
        # The object modules held before fully_shard, to detect ties with other units; weak,
        # so the full-size tensor is freed unless something outside still uses it.
        self.original = weakref.ref(param)
        self.shape = param.shape
        self.dtype = param.dtype
        self.rows = self.shape[0]
        self.row_numel = math.prod(self.shape[1:])
        self.numel = param.numel()
        self.chunk_rows = -(-self.rows // world)
        self.padded_numel = self.chunk_rows * self.row_numel
        start = min(rank * self.chunk_rows, self.rows)
        self.start = start  # first row this rank owns
        self.local_rows = min(self.chunk_rows, self.rows - start)
        self.offset = 0  # set by the unit once all its parameters are known

        # The padded chunk, and the sharded parameter that views its unpadded part.
        with torch.no_grad():
            padded = param.new_zeros((self.chunk_rows, *self.shape[1:]))
            padded[: self.local_rows].copy_(param[start : start + self.local_rows])
        self.padded = padded
        local = padded[: self.local_rows]
        self.spec = shard0_spec(mesh, self.shape, self.dtype)
        self.sharded = nn.Parameter(
            make_dtensor(local, self.spec), requires_grad=param.requires_grad
        )
        self.unsharded: nn.Parameter | None = None  # created on first unshard
        self.set_on_modules(self.sharded)

    # --- module view -------------------------------------------------------------------

    def set_on_modules(self, value: nn.Parameter) -> None:
        for loc in self.locations:
            loc.module._parameters[loc.name] = value

    def adopt_replacement(self) -> None:
        """Take in a parameter the user assigned after ``fully_shard`` (before first use).

        The new value must be a full (unsharded) tensor of the original shape; this rank
        keeps its chunk of it, and the module gets the sharded parameter back.
        """
        for loc in self.locations:
            current = loc.module._parameters.get(loc.name)
            if current is self.sharded:
                continue
            if not isinstance(current, torch.Tensor) or isinstance(current, DTensor):
                raise RuntimeError(
                    f"fully_shard: parameter {loc.fqn!r} was replaced by "
                    f"{type(current).__name__} after fully_shard; assign a full tensor of "
                    f"shape {tuple(self.shape)} instead"
                )
            if current.shape != self.shape:
                raise RuntimeError(
                    f"fully_shard: parameter {loc.fqn!r} was replaced by a tensor of shape "
                    f"{tuple(current.shape)}, expected {tuple(self.shape)}"
                )
            rows = slice(self.start, self.start + self.local_rows)
            with torch.no_grad():
                self.padded[: self.local_rows].copy_(current[rows])
            self.sharded.requires_grad_(current.requires_grad)
            self.set_on_modules(self.sharded)

    # --- unsharded storage ---------------------------------------------------------------

    def alloc_unsharded(self) -> torch.Tensor:
        """The unsharded parameter's data with live storage (allocated if it was freed)."""
        if self.unsharded is None:
            data = torch.empty(self.shape, dtype=self.dtype, device=self.padded.device)
            self.unsharded = nn.Parameter(data, requires_grad=self.sharded.requires_grad)
        elif self.unsharded.requires_grad != self.sharded.requires_grad:
            self.unsharded.requires_grad_(self.sharded.requires_grad)  # frozen or unfrozen
        storage = self.unsharded.untyped_storage()
        nbytes = self.numel * self.dtype.itemsize
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return self.unsharded.data

    def free_unsharded(self) -> None:
        if self.unsharded is not None:
            self.unsharded.untyped_storage().resize_(0)

    # --- data movement between the full layout and the per-rank padded layout ------------

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Fill the unsharded parameter from ``gathered``: (world, padded_numel) rows."""
        copy_padded_to_full(gathered, self.alloc_unsharded(), self.chunk_rows)

    def copy_grad_in(self, dest: torch.Tensor) -> bool:
        """Write the unsharded gradient into ``dest`` (world, padded_numel); False if none."""
        grad = None if self.unsharded is None else self.unsharded.grad
        if grad is None:
            dest.zero_()
            return False
        copy_full_to_padded(grad, dest, self.chunk_rows)
        return True

    def accumulate_sharded_grad(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced chunk (padded_numel elements) to the sharded gradient."""
        local = reduced[: self.local_rows * self.row_numel].view(self.local_rows, *self.shape[1:])
        if self.sharded.grad is None:
            self.sharded.grad = make_dtensor(local.to(self.dtype), self.spec)
        else:
            grad = self.sharded.grad
            assert isinstance(grad, DTensor)
            grad.to_local().add_(local)


def _row_pairs(
    full: torch.Tensor, padded: torch.Tensor, chunk_rows: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Matching views of ``full`` (rows, ...) and ``padded`` (world, chunk_rows * row_numel).

    Returns ``(pairs, padding)``: each pair is a (full part, padded part) of the same
    shape, together covering every row of ``full``; ``padding`` are the padded rows no
    row of ``full`` maps to. At most two pairs, so a copy is at most two kernels.
    """
    world, rows = padded.shape[0], full.shape[0]
    blocks = padded.view(world, chunk_rows, -1)
    flat_rows = full.view(rows, -1)
    whole = rows // chunk_rows
    pairs = []
    if whole:
        pairs.append((flat_rows[: whole * chunk_rows].view(whole, chunk_rows, -1), blocks[:whole]))
    padding = []
    if whole < world:
        tail = rows - whole * chunk_rows
        pairs.append((flat_rows[whole * chunk_rows :], blocks[whole, :tail]))
        padding = [blocks[whole, tail:], blocks[whole + 1 :]]
    return pairs, padding


def copy_full_to_padded(full: torch.Tensor, dest: torch.Tensor, chunk_rows: int) -> None:
    """Scatter ``full`` (rows, ...) into ``dest`` (world, chunk_rows * row_numel), zero-padded."""
    pairs, padding = _row_pairs(full.contiguous(), dest, chunk_rows)
    for src_rows, dest_rows in pairs:
        dest_rows.copy_(src_rows)
    for rows in padding:
        rows.zero_()


def copy_padded_to_full(src: torch.Tensor, full: torch.Tensor, chunk_rows: int) -> None:
    """Gather ``src`` (world, chunk_rows * row_numel) into ``full`` (rows, ...)."""
    pairs, _ = _row_pairs(full, src, chunk_rows)
    for full_rows, src_rows in pairs:
        full_rows.copy_(src_rows)
