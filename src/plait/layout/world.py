"""The rules of the grid: sizes are positive, and the mesh dimensions fill the world
exactly; and every grid that does (:func:`grids`, the planner's and ``plait train``'s
auto sizes).

A size may be unknown (None, or absent from the mapping): the rules then say whether the
known ones leave room for it, and :func:`grids` fills it in.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from plait.layout.dims import DATA_PARALLEL, MESH_DIMS, PP
from plait.layout.reasons import Reason, flag

__all__ = ["World", "check_sizes", "check_world", "divisors", "grids"]


@dataclass(frozen=True)
class World:
    """The ranks a layout must fill exactly, in the words of the command that runs it.

    ``flag``: the option that sets the number (``--nproc``); ``noun``: what the ranks are
    (``"processes"``); ``named``: how a sentence names the world (default: ``the 4
    processes (--nproc 4)``); ``auto``: the dims the command sizes itself when left out.
    """

    size: int
    flag: str
    noun: str
    named: str = ""
    auto: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.named or f"the {self.size} {self.noun} ({self.flag} {self.size})"


def check_sizes(sizes: Mapping[str, int | None]) -> list[Reason]:
    """Sizes and counts by field name must be at least 1 (None: not given)."""
    return [
        Reason(name, f"{flag(name)} {size}: must be at least 1")
        for name, size in sizes.items()
        if size is not None and size < 1
    ]


# The world rule lists the data-parallel dims, then the others outermost first; the
# data-parallel and pipeline dims always, the dims inside layers only where they are used.
_LISTED = DATA_PARALLEL + tuple(d for d in MESH_DIMS if d not in DATA_PARALLEL)
_ALWAYS_LISTED = (*DATA_PARALLEL, PP)


def check_world(sizes: Mapping[str, int | None], world: World) -> list[Reason]:
    """The known mesh sizes (None or absent: to be found) must leave a grid of exactly
    ``world``: their product divides it, and equals it when every size is known. Sizes
    must be at least 1 (:func:`check_sizes`)."""
    known = {d: size for d in _LISTED if (size := sizes.get(d)) is not None}
    product = math.prod(known.values())
    listed = [f"{flag(d)} {s}" for d, s in known.items() if d in _ALWAYS_LISTED or s > 1]
    grid = " x ".join(listed)
    if len(known) < len(MESH_DIMS):
        if world.size % product == 0:
            return []
        total = f" = {product}" if len(listed) > 1 else ""
        message = f"{grid}{total} does not divide {world}: make {world.flag} a multiple of "
        return [Reason("world", f"{message}{product}")]
    if product == world.size:
        return []
    auto = " or ".join(flag(d) for d in world.auto)
    leave = f" (or leave {auto} out: auto)" if auto else ""
    message = (
        f"{grid} = {product} {world.noun}, but {world.size} will run ({world.flag} "
        f"{world.size}): make the product equal the number of {world.noun}{leave}"
    )
    return [Reason("world", message)]


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


# The order grids() sizes the dims in: those inside data parallelism first, innermost
# first, then the data-parallel ones, ``dp_shard`` last so that it takes what the others
# leave (``plait train``'s auto ``dp_shard``).
_FILL_ORDER = tuple(reversed([d for d in MESH_DIMS if d not in DATA_PARALLEL])) + DATA_PARALLEL


def grids(sizes: Mapping[str, int | None], world: int) -> Iterator[dict[str, int]]:
    """Every way to size the unknown dims of ``sizes`` (None or absent) so that all of
    :data:`MESH_DIMS` multiply to ``world``, known sizes kept: none when
    :func:`check_world` has a reason, one when a single dim is unknown."""

    def fill(i: int, left: int, grid: dict[str, int]) -> Iterator[dict[str, int]]:
        if i == len(_FILL_ORDER):
            if left == 1:
                yield grid
            return
        dim = _FILL_ORDER[i]
        known = sizes.get(dim)
        last = i == len(_FILL_ORDER) - 1
        options = [known] if known is not None else [left] if last else divisors(left)
        for size in options:
            if left % size == 0:
                yield from fill(i + 1, left // size, {**grid, dim: size})

    if world >= 1:
        yield from fill(0, world, {})
