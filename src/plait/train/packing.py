"""Packed rows: several documents in one row of the batch, each attending only to itself
with positions restarting at 0, as transformers does with packed sequences and position
ids. Shared by plait's GPT (:mod:`plait.train.model`) and Llama family
(:mod:`plait.train.llama`).

A forward builds one :class:`Packing` (:func:`packing`) and hands it to every block;
attention runs through :func:`causal_attention`, which keeps it inside the documents.
Without documents (one document per row) there is no Packing and attention is plain
causal attention.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from plait.context import packed_documents

__all__ = ["Packing", "causal_attention", "document_positions", "packing"]


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document, ``(B, T)`` int64, from ``documents`` ``(B, T)``:
    per row, the index of the document each token belongs to (non-decreasing). Whole rows
    only: a row split over ranks (context parallelism) must be computed whole and sharded."""
    t = documents.shape[-1]
    index = torch.arange(t, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    # The latest document start at or before each token.
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


@dataclass(frozen=True)
class Packing:
    """What every attention of one forward needs of packed rows (built once per forward by
    :func:`packing`, handed to each block, so a recomputing checkpointed block sees it too).

    ``positions`` ``(B, T)``: each token's position in its document. Exactly one of:
    ``mask`` ``(B, 1, T, T)`` bool, True where a query may attend to a key (same document,
    not later): the whole rows are on this rank; ``documents`` ``(B, T)``: this rank's
    document ids of rows split by context parallelism, for its attention
    (:func:`plait.context.packed_documents`)."""

    positions: torch.Tensor
    mask: torch.Tensor | None = None
    documents: torch.Tensor | None = None


def packing(
    documents: torch.Tensor | None, positions: torch.Tensor | None, sharded: bool
) -> Packing | None:
    """The :class:`Packing` of one forward over rows with ``documents`` (None: one document
    per row, plain causal attention: returns None). ``positions``: each token's position in
    its document, computed from ``documents`` when None, which needs whole rows; with
    ``sharded`` (the rows are split over context-parallel ranks) they must be given,
    computed on the whole rows and sharded like the inputs."""
    if documents is None:
        return None
    if sharded:
        if positions is None:
            raise ValueError(
                "packed rows under context parallelism need positions: compute them on the "
                "whole rows (document_positions) and shard them like the inputs"
            )
        return Packing(positions, documents=documents)
    if positions is None:
        positions = document_positions(documents)
    t = documents.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
    same = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
    return Packing(positions, mask=(same & causal)[:, None])


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pack: Packing | None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal SDPA of ``q``, ``k``, ``v`` ``(B, heads, T, d)``, kept inside documents with
    ``pack``: through its mask, or (rows split by context parallelism, whose attention
    builds no mask of the whole row) through ``packed_documents``, opened here so that
    each call, a checkpointed block's recompute or another pipeline microbatch's included,
    sees its own documents. ``enable_gqa``: ``k`` and ``v`` have fewer heads (SDPA's)."""
    if pack is not None and pack.mask is not None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=pack.mask, dropout_p=dropout_p, enable_gqa=enable_gqa
        )
    documents = packed_documents(pack.documents) if pack is not None else nullcontext()
    with documents:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=enable_gqa
        )
