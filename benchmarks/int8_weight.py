"""A weight that ``fully_shard`` all-gathers as int8 with a per-row scale (the README example).

An all-gather extension (``plait.fsdp.extensions``): the sharded weight stays in its own
dtype (fp32 shards, fp32 optimizer state); before each all-gather its rows are quantized
to int8 with one fp32 scale per row, and after it the unsharded weight is rebuilt,
dequantized to the compute dtype. Per row, so each rank quantizes whole rows of its
``Shard(0)`` shard, and the result is the same as quantizing the full weight in one process
(:func:`quantize` / :func:`dequantize` are that reference). The gradient flows to the
shard unchanged (straight through the rounding), as for any cast of the parameter.

A user's subclass, not part of plait: it lives with the benchmark that measures it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: ``(q (rows, cols) int8, scale (rows, 1) fp32)``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (both cast to it first: what the in-place path computes)."""
    return q.to(dtype) * scale.to(dtype)


class Int8GatherWeight(torch.Tensor):
    """A weight tensor whose ``fully_shard`` all-gather moves int8 rows and a scale per row.

    Its rows must shard evenly over the mesh (the hook cannot pad the scale to the
    weight's padded shard size).
    """

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Int8GatherWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            data.stride(),
            data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: Any, module: Any, mp: Any
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        if outer_size[0] % mesh.size() != 0:
            raise ValueError(
                f"Int8GatherWeight: a weight of {outer_size[0]} rows does not shard evenly "
                f"over {mesh.size()} ranks; use a row count divisible by the mesh size"
            )
        return quantize(self._data), None

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: None,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        q, scale = outputs
        if out is not None:
            # Later gathers: write into the unsharded parameter autograd holds, as
            # ``dequantize`` computes it (int8 -> dtype is exact), without a temporary.
            with torch.no_grad(), _unsafe_preserve_version_counter(out):
                out.copy_(q).mul_(scale.to(param_dtype))
            return None
        weight = dequantize(q, scale, param_dtype)
        return weight, (weight,)  # ``weight`` is freed at reshard, refilled above

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        # Every other op (sharding, the optimizer, state dicts) runs on the plain data.
        def unwrap(t: Int8GatherWeight) -> torch.Tensor:
            return t._data

        out = func(
            *pytree.tree_map_only(cls, unwrap, args),
            **pytree.tree_map_only(cls, unwrap, kwargs or {}),
        )
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], size: Any, stride: Any) -> Any:
        return inner["_data"]


def int8_gather_linears(module: nn.Module) -> int:
    """Make every ``nn.Linear`` weight under ``module`` an :class:`Int8GatherWeight`
    (before ``fully_shard``); returns how many."""
    count = 0
    for linear in module.modules():
        if isinstance(linear, nn.Linear):
            linear.weight = nn.Parameter(Int8GatherWeight(linear.weight.detach()))
            count += 1
    return count
