"""The parallel dimensions by name, and the orders meshes and batches use them in.

Every name here is a mesh dimension's name, as :class:`~plait.layout.Layout`'s fields,
the meshes built from it and ``plait train``'s flags spell it (``dp_shard`` is
``--dp-shard``). The order of :data:`MESH_DIMS` is the ranks' order: launchers place
consecutive ranks on one node, so the innermost dimension is the one that talks most.
"""

from __future__ import annotations

__all__ = [
    "CP",
    "CP_METHODS",
    "DATA_PARALLEL",
    "DP",
    "DP_REPLICATE",
    "DP_SHARD",
    "DP_SHARD_CP",
    "EFSDP",
    "EP",
    "EXPERT_MESH_DIMS",
    "MESH_DIMS",
    "PP",
    "TP",
]

PP = "pp"
DP_REPLICATE = "dp_replicate"
DP_SHARD = "dp_shard"
TP = "tp"
#: Context parallelism: each sequence split over its ranks (``plait.context``), which share
#: their batch; fully_shard shards over ``dp_shard x cp``.
CP = "cp"
#: ``dp_shard`` and ``cp`` as one dimension: what fully_shard shards over with context
#: parallelism (each cp rank's gradients cover its own tokens), torchtitan's name.
DP_SHARD_CP = "dp_shard_cp"
#: How context-parallel attention sees the other ranks' keys and values: all-gathered,
#: passed around a ring, or exchanged all-to-all by heads (Ulysses).
CP_METHODS: tuple[str, ...] = ("allgather", "ring", "alltoall")
#: Expert parallelism: the routed experts of every mixture-of-experts block split over its
#: ranks (``plait.experts``). It takes its ranks from ``dp_shard x cp`` (they hold
#: different tokens, which all-to-all sends to their experts), so it is not a factor of the
#: world.
EP = "ep"
#: The experts' own fully_shard dimension: the ``dp_shard x cp`` ranks holding the same
#: experts (``dp_shard x cp / ep`` of them), torchtitan's name.
EFSDP = "efsdp"
#: The data-parallel dims flattened into one (torch's and torchtitan's name for it).
DP = "dp"

#: The mesh dimensions, outermost first. The innermost communicate most: ``tp``
#: (collectives inside every layer) between neighbouring ranks, which launchers place on
#: one node, then ``cp`` (attention in every layer), then ``dp_shard``.
MESH_DIMS: tuple[str, ...] = (PP, DP_REPLICATE, DP_SHARD, CP, TP)
#: The mesh of the routed experts, outermost first: ``dp_shard x cp`` split into ``(efsdp,
#: ep)``, so the same ranks, in the same order, as :data:`MESH_DIMS`.
EXPERT_MESH_DIMS: tuple[str, ...] = (PP, DP_REPLICATE, EFSDP, EP, TP)
#: The dimensions a global batch is split over.
DATA_PARALLEL: tuple[str, ...] = (DP_REPLICATE, DP_SHARD)
