"""Device meshes from dimension sizes, and the dim a stacked expert weight is sharded on.

:class:`~plait.layout.Layout`'s ``mesh``, ``shard_mesh`` and ``expert_mesh`` build their
meshes with :func:`device_mesh`. A mesh keeps only the dimensions larger than 1, unless
told to keep one at any size (a dimension that a parallelism looks up by name even when it
is trivial). Building a mesh is collective: every rank of the default process group calls
it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["device_mesh", "expert_shard_dim"]


def device_mesh(
    device_type: str, sizes: Mapping[str, int], keep: tuple[str, ...]
) -> DeviceMesh | None:
    """The mesh of ``sizes`` (by name, outermost first) on ``device_type``, without the
    dimensions of size 1 that ``keep`` does not name; None when no dimension is left."""
    dims = [(name, size) for name, size in sizes.items() if size > 1 or name in keep]
    if not dims:
        return None
    from torch.distributed.device_mesh import init_device_mesh  # here: plait plan needs no torch

    names, shape = zip(*dims, strict=True)
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


def expert_shard_dim(shape: tuple[int, ...], group: int) -> int:
    """The dim ``fully_shard`` shards a stacked expert weight ``(experts, in, out)`` on over
    ``group`` ranks in plait train's recipe: the experts' dim when it splits evenly, else
    the first that does (torchtitan's rule: ``Shard(1)`` when there are fewer experts than
    ranks to shard them), else 0. Sharding 2 experts over 8 ranks on dim 0 would pad every
    rank's shard to a whole expert: 4x the memory of the sharded states and of the
    gradients' reduce-scatter."""
    return next((d for d, size in enumerate(shape) if size % group == 0), 0)
