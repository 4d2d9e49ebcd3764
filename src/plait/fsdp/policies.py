"""Policies accepted by ``fully_shard``, with torch's names and fields."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the all-gathered parameters, the gradient reduction and the outputs."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer steps in CPU memory."""

    pin_memory: bool = True


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which named dims of a full mesh are data parallel (torch 2.13's ``dp_mesh_dims``).

    ``fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(shard="fsdp",
    replicate="dp_replicate"))`` shards over the ``shard`` dim(s) and replicates over the
    ``replicate`` dim(s) of ``full_mesh``; several names in one field are flattened into one
    dim. At least one field must be set.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "DataParallelMeshDims: set shard=, replicate= or both (the names of the mesh "
                "dims that data parallelism runs over)"
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(field: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if field is None:
        return ()
    return (field,) if isinstance(field, str) else tuple(field)
