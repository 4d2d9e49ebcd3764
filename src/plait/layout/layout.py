"""The :class:`Layout`: the size of each mesh dimension and the choices that go with them,
and the device meshes built from it.

A Layout is plain data: nothing is checked on construction (:func:`plait.layout.check`
says whether one can run), and its meshes are built only when asked for, collectively.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plait.layout.dims import (
    DATA_PARALLEL,
    DP_REPLICATE,
    DP_SHARD_CP,
    EFSDP,
    EP,
    EXPERT_MESH_DIMS,
    MESH_DIMS,
    PP,
    TP,
)
from plait.layout.meshes import device_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["LAYOUT_FIELDS", "Layout"]


@dataclass(frozen=True)
class Layout:
    """A composition of plait's parallelisms: the size of each mesh dimension (their
    product is the world size) and the choices that go with them.

    ``schedule``: the pipeline schedule's name; ``stages_per_rank``: pipeline stages each
    ``pp`` rank holds (2 or more for interleaved and V schedules); ``microbatches``: per
    step, through the pipeline or accumulated without one; ``ac``: activation
    checkpointing of each block (``"none"``, ``"full"``, ``"selective"``, ``"offload"``);
    ``sequence_parallel``: with ``tp``, norms and activations split by sequence;
    ``reshard_after_forward``: as ``fully_shard``'s (``True`` frees parameters between
    forward and backward); ``ep``: expert parallelism, ranks taken from ``dp_shard`` (see
    :data:`~plait.layout.EP`); ``cp``: context parallelism, each sequence split over its
    ranks, and ``cp_method`` its attention (:data:`~plait.layout.CP_METHODS`);
    ``end_blocks``: with a pipeline, the blocks' worth of work the first stage's embedding
    and the last stage's head each count for when the blocks are split among the stages
    (:func:`~plait.layout.stage_blocks`; torchtitan's default is 1);
    ``max_active_stages``: with a pipeline over ``fully_shard`` / ``replicate`` stages, the
    most stages a rank holds gathered at once (0: no bound, each gathered once per step;
    :func:`plait.pipeline.add_fsdp_actions`). Nothing is checked on construction:
    :func:`~plait.layout.check` says whether a layout can run.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    cp_method: str = "allgather"
    schedule: str = "1F1B"
    microbatches: int = 1
    ac: str = "none"
    sequence_parallel: bool = True
    reshard_after_forward: bool = True
    stages_per_rank: int = 1
    end_blocks: int = 0
    max_active_stages: int = 0

    @property
    def sizes(self) -> dict[str, int]:
        """The size of each mesh dimension, by name, outermost first."""
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def world(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways the global batch is split."""
        return math.prod(getattr(self, name) for name in DATA_PARALLEL)

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all (1 without a pipeline)."""
        return self.pp * self.stages_per_rank

    @property
    def efsdp(self) -> int:
        """The ranks of one ``ep`` rank's experts shard them (``dp_shard x cp / ep``)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def expert_sizes(self) -> dict[str, int]:
        """The size of each dimension of the experts' mesh (:data:`EXPERT_MESH_DIMS`)."""
        return {name: getattr(self, name) for name in EXPERT_MESH_DIMS}

    def with_sizes(self, sizes: Mapping[str, int]) -> Layout:
        """A copy with the mesh dimensions named in ``sizes`` resized."""
        unknown = set(sizes) - set(MESH_DIMS)
        if unknown:
            raise ValueError(f"not mesh dimensions: {sorted(unknown)}; they are {MESH_DIMS}")
        changes: dict[str, Any] = dict(sizes)
        return dataclasses.replace(self, **changes)

    def mesh(self, device_type: str) -> DeviceMesh | None:
        """The device mesh on ``device_type``, dimensions named as in :data:`MESH_DIMS`
        and in its order, keeping only those larger than 1; None for one process.
        Collective: every rank of the default process group calls it."""
        return device_mesh(device_type, self.sizes, keep=())

    def shard_mesh(self, device_type: str) -> DeviceMesh | None:
        """With context parallelism, the mesh tensor parallelism and fully_shard use: the
        same ranks as :meth:`mesh`, ``dp_shard`` and ``cp`` as one dimension,
        :data:`DP_SHARD_CP` (kept at any size), so parameters are sharded and gradients
        reduced over both; None without context parallelism (:meth:`mesh` serves).
        Collective, like :meth:`mesh`."""
        if self.cp == 1:
            return None
        sizes = {PP: self.pp, DP_REPLICATE: self.dp_replicate}
        sizes |= {DP_SHARD_CP: self.dp_shard * self.cp, TP: self.tp}
        return device_mesh(device_type, sizes, keep=(DP_SHARD_CP,))

    @property
    def splits_routed_rows(self) -> bool:
        """Whether a mixture of experts' tp ranks share its routed rows (each computes one
        chunk: :func:`plait.experts.split_routed_rows`): with tensor parallelism under
        ``fully_shard`` (``dp_shard x cp`` > 1), whose expert group then spans the tp
        ranks and sums their gradients. Otherwise every tp rank computes all of them."""
        return self.tp > 1 and self.dp_shard * self.cp > 1

    def expert_mesh(self, device_type: str, split_rows: bool = False) -> DeviceMesh | None:
        """The routed experts' mesh (:data:`EXPERT_MESH_DIMS`): the same ranks as
        :meth:`mesh`, ``dp_shard x cp`` split into ``(efsdp, ep)``, both kept even at size 1 (the
        experts are sharded over ``ep`` and fully_shard over ``efsdp``); None without
        expert parallelism. ``split_rows`` (a model with experts, and a layout that
        :attr:`splits_routed_rows`): the tp ranks join ``efsdp`` (dims ``(pp,
        dp_replicate, efsdp, ep)``, ``efsdp`` of ``dp_shard x cp x tp / ep`` ranks: the
        experts' fully_shard group spans the ranks that split their rows), made even with
        ``ep`` 1. Collective, like :meth:`mesh`."""
        if not split_rows:
            if self.ep == 1:
                return None
            return device_mesh(device_type, self.expert_sizes, keep=(EFSDP, EP))
        import torch  # here, not above: the planner uses Layout without torch
        from torch.distributed.device_mesh import DeviceMesh

        grid = torch.arange(self.world).view(self.pp, self.dp_replicate, self.efsdp, self.ep, -1)
        # An efsdp group varies the layout's efsdp and tp coordinates; an ep group keeps tp's.
        sizes = {PP: self.pp, DP_REPLICATE: self.dp_replicate, EFSDP: self.efsdp * self.tp}
        sizes[EP] = self.ep
        kept = [name for name, size in sizes.items() if size > 1 or name in (EFSDP, EP)]
        grid = grid.transpose(3, 4).reshape([sizes[name] for name in kept])
        return DeviceMesh(device_type, grid, mesh_dim_names=tuple(kept))


#: The fields of :class:`Layout`, in its order.
LAYOUT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Layout))
