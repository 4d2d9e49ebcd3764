"""Exact attention on the local shards of a sequence split over the cp ranks: one entry
point, :func:`context_parallel_attention`, and the methods it dispatches to.

Every method gives, on each rank, the rows of this rank's queries of the attention that
one process computes over the whole sequence (to rounding): same mask rule
(:mod:`plait.context.masks`), same scale, gradients of q, k and v included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from plait.context.allgather import allgather_attention
from plait.context.collectives import CPMesh, cp_group
from plait.context.ring import ring_attention
from plait.context.sequence import SequenceLayout
from plait.context.ulysses import ulysses_attention

__all__ = ["METHODS", "Method", "check_method", "context_parallel_attention"]

#: ``"allgather"``: gather keys and values; ``"ring"``: pass them round the ring;
#: ``"alltoall"``: Ulysses, trade the sequence split for a head split.
Method = Literal["allgather", "ring", "alltoall"]
METHODS: tuple[str, ...] = ("allgather", "ring", "alltoall")

_Impl = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        dist.ProcessGroup,
        SequenceLayout,
        bool,
        torch.Tensor | None,
        float,
    ],
    torch.Tensor,
]
_IMPLS: dict[str, _Impl] = {
    "allgather": allgather_attention,
    "ring": ring_attention,
    "alltoall": ulysses_attention,
}


def check_method(method: str) -> Method:
    """``method`` if it names a method, else ``ValueError`` listing them."""
    if method not in METHODS:
        raise ValueError(
            f"context parallelism: unknown attention method {method!r}; choose one of "
            f"{', '.join(repr(m) for m in METHODS)}"
        )
    return method  # type: ignore[return-value]


def _check_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: torch.Tensor | None,
    enable_gqa: bool,
) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "context-parallel attention takes q, k, v of shape (batch, heads, local "
            f"sequence, head dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or (q.shape[0], q.shape[2]) != (k.shape[0], k.shape[2]):
        raise ValueError(
            "context-parallel attention: q, k, v must agree on batch and local sequence and "
            f"k, v on every dim; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads and not (enable_gqa and heads % kv_heads == 0):
        raise ValueError(
            f"context-parallel attention: {heads} query heads and {kv_heads} key/value "
            "heads: grouped-query attention needs enable_gqa=True and a number of query "
            "heads that is a multiple of the key/value heads"
        )
    if docs is not None and (docs.shape != (q.shape[0], q.shape[2]) or docs.is_floating_point()):
        raise ValueError(
            "context-parallel attention: document_ids must be integers of shape (batch, "
            f"local sequence) = {(q.shape[0], q.shape[2])}; got {docs.dtype} of shape "
            f"{tuple(docs.shape)}"
        )


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mesh: CPMesh,
    *,
    method: Method = "allgather",
    load_balance: bool = True,
    is_causal: bool = False,
    document_ids: torch.Tensor | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, from local shards.

    ``query`` ``(B, H, T_local, D)``, ``key`` / ``value`` ``(B, Hkv, T_local, D)`` are this
    rank's part of the sequence in the layout given by ``load_balance``
    (:class:`~plait.context.sequence.SequenceLayout`; e.g. made by ``shard_sequence``).
    ``mesh``: the cp ranks (a 1-D mesh or a process group). Returns this rank's rows
    ``(B, H, T_local, D)`` of ``scaled_dot_product_attention`` over the whole sequence
    with ``is_causal``; ``document_ids`` ``(B, T_local)`` restricts each query to keys of
    its own document (packed sequences; causal inside each when ``is_causal``). ``scale``
    defaults to ``1 / sqrt(D)``; ``enable_gqa`` allows fewer key/value heads, as SDPA.
    Differentiable; every cp rank must call it (it communicates).
    """
    group = cp_group(mesh)
    impl = _IMPLS[check_method(method)]
    _check_shapes(query, key, value, document_ids, enable_gqa)
    layout = SequenceLayout(dist.get_world_size(group), load_balance)
    layout.check_local(query.shape[2])
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if layout.cp == 1:
        impl = allgather_attention  # nothing to exchange: plain attention with the mask
    return impl(query, key, value, group, layout, is_causal, document_ids, scale)
