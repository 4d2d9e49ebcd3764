"""Packed rows: several documents in one row of the batch, each attending only to itself
with positions restarting at 0, as transformers does with packed sequences and position
ids. Shared by plait's GPT (:mod:`plait.train.model`) and Llama family
(:mod:`plait.train.llama`).

A forward builds one :class:`Packing` (:func:`packing`) and hands it to every block;
attention runs through :func:`causal_attention`, which keeps it inside the documents.
Without documents (one document per row) there is no Packing and attention is plain
causal attention.

Whole rows take one of two paths, chosen where the Packing is built (once per forward,
from its device) and confirmed per call (from the tensors attention gets):

* **variable-length flash attention** (:mod:`plait.train.varlen`): on GPUs that run it,
  given each row's document boundaries (:func:`document_bounds`, computed on the host
  where the step's batch is built, moved with it: no device sync per forward). The rows'
  tokens are flattened, each document a causal sequence; no mask is built. A call the
  kernel does not take (float32, dropout, an odd head dim) falls back to the mask below,
  built then, once per forward;
* **SDPA with a dense mask** ``(B, 1, T, T)``: elsewhere (the CPU), as before.

Rows split by context parallelism take neither: their attention is
:func:`plait.context.packed_documents`'.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from plait.context import packed_documents
from plait.train.varlen import VarlenKernel, compute_dtype, varlen_kernel

__all__ = [
    "DocumentSpans",
    "Packing",
    "causal_attention",
    "document_bounds",
    "document_mask",
    "document_positions",
    "packing",
    "takes_grouped_heads",
    "varlen_kernel",  # the seam step_batch and packing() ask, which tests substitute
]


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document, ``(B, T)`` int64, from ``documents`` ``(B, T)``:
    per row, the index of the document each token belongs to (non-decreasing). Whole rows
    only: a row split over ranks (context parallelism) must be computed whole and sharded."""
    t = documents.shape[-1]
    index = torch.arange(t, device=documents.device).expand_as(documents)
    starts = _starts(documents)
    # The latest document start at or before each token.
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def _starts(documents: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` bool: True where a document starts (a row's first token, or a change)."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    return starts


def document_bounds(documents: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each row's document boundaries, for variable-length attention: ``(bounds, longest)``.

    ``bounds`` ``(B, D + 1)`` int32, row ``b``: where each of its documents starts, then
    ``T``, padded with ``T`` to the ``D`` documents of the fullest row (a padding entry is
    an empty document, which the kernel skips). Offsets are within the row, so the rows
    can be cut into microbatches like the inputs; :func:`packing` offsets them by row.
    ``longest``: the longest document's length. ``documents`` ``(B, T)`` of whole rows, on
    the host, as the data gives them (on a device the two values read would sync it)."""
    b, t = documents.shape
    starts = _starts(documents)  # (B, T)
    slot = starts.long().cumsum(dim=1) - 1  # each start's index among its row's documents
    width = int(slot[:, -1].max()) + 2 if b else 1
    bounds = torch.full((b, width), t, dtype=torch.int32, device=documents.device)
    rows, cols = starts.nonzero(as_tuple=True)
    bounds[rows, slot[rows, cols]] = cols.to(torch.int32)
    longest = int((bounds[:, 1:] - bounds[:, :-1]).max()) if b else 0
    return bounds, longest


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """``(B, 1, T, T)`` bool, True where a query may attend to a key (same document, not
    later), from ``documents`` ``(B, T)`` of whole rows."""
    t = documents.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
    same = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
    return (same & causal)[:, None]


@dataclass(frozen=True)
class DocumentSpans:
    """Whole rows' documents as the variable-length ``kernel`` takes them.

    ``cu_seqlens`` ``(N + 1,)`` int32 on the device: the documents' cumulative boundaries
    over the rows flattened (``B * T`` tokens; a document never crosses a row, empty ones
    pad). ``extent`` ``(longest, 0)``, empty: the longest document (of the step's batch:
    an upper bound for a microbatch's) held as a size, which a compiled block reads as a
    dynamic size from the first batch on (a Python int would be specialised and recompiled
    at the next batch's value): :attr:`longest`. ``documents`` ``(B, T)``: what the dense
    mask is built from where a call falls back (:meth:`mask`)."""

    cu_seqlens: torch.Tensor
    extent: torch.Tensor
    documents: torch.Tensor
    kernel: VarlenKernel
    # The fallback's mask, built by the first call that needs it and kept for the other
    # blocks and a checkpointed block's recompute (one mask per forward, as before).
    _masks: list[torch.Tensor] = field(default_factory=list, compare=False, repr=False)

    @property
    def longest(self) -> int:
        """The longest document's length (an upper bound)."""
        return self.extent.shape[0]

    def mask(self) -> torch.Tensor:
        """The dense mask of :func:`document_mask`, built at most once (in eager mode;
        a compiled graph builds its own, keeping the graph free of this side effect)."""
        if torch.compiler.is_compiling():
            return document_mask(self.documents)
        if not self._masks:
            self._masks.append(document_mask(self.documents))
        return self._masks[0]


@dataclass(frozen=True)
class Packing:
    """What every attention of one forward needs of packed rows (built once per forward by
    :func:`packing`, handed to each block, so a recomputing checkpointed block sees it too).

    ``positions`` ``(B, T)``: each token's position in its document. Exactly one of:
    ``mask`` ``(B, 1, T, T)`` bool, True where a query may attend to a key (same document,
    not later): the whole rows are on this rank, on a device without a variable-length
    kernel; ``spans``: the whole rows are on this rank, whose variable-length kernel
    attention runs (:class:`DocumentSpans`); ``documents`` ``(B, T)``: this rank's
    document ids of rows split by context parallelism, for its attention
    (:func:`plait.context.packed_documents`)."""

    positions: torch.Tensor
    mask: torch.Tensor | None = None
    documents: torch.Tensor | None = None
    spans: DocumentSpans | None = None


def packing(
    documents: torch.Tensor | None,
    positions: torch.Tensor | None,
    sharded: bool,
    bounds: torch.Tensor | None = None,
    longest: int = 0,
) -> Packing | None:
    """The :class:`Packing` of one forward over rows with ``documents`` (None: one document
    per row, plain causal attention: returns None). ``positions``: each token's position in
    its document, computed from ``documents`` when None, which needs whole rows; with
    ``sharded`` (the rows are split over context-parallel ranks) they must be given,
    computed on the whole rows and sharded like the inputs.

    ``bounds`` and ``longest`` (:func:`document_bounds` of the whole rows, ``bounds`` on
    the rows' device and cut like them into microbatches): where given and a
    variable-length kernel runs on the device, attention takes it and no mask is built
    here; otherwise the dense mask is built here, as it always was."""
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
    kernel = varlen_kernel(documents.device) if bounds is not None else None
    if bounds is None or kernel is None:
        return Packing(positions, mask=document_mask(documents))
    return Packing(positions, spans=_spans(documents, bounds, longest, kernel))


def _spans(
    documents: torch.Tensor, bounds: torch.Tensor, longest: int, kernel: VarlenKernel
) -> DocumentSpans:
    """The rows' :class:`DocumentSpans`: ``bounds`` offset by row and flattened, on the
    device (no sync)."""
    b, t = documents.shape
    if bounds.dim() != 2 or bounds.shape[0] != b or bounds.device != documents.device:
        raise ValueError(
            f"bounds must be (rows, documents + 1) on the rows' device: got "
            f"{tuple(bounds.shape)} on {bounds.device} for documents {tuple(documents.shape)} "
            f"on {documents.device} (plait.train.packing.document_bounds of the same rows)"
        )
    if not 0 < longest <= t:
        raise ValueError(f"longest must be a document length in 1..{t}, got {longest}")
    offsets = torch.arange(b, dtype=torch.int32, device=bounds.device)[:, None] * t
    starts = (bounds[:, :-1].to(torch.int32) + offsets).reshape(-1)  # every row's starts
    end = torch.full((1,), b * t, dtype=torch.int32, device=bounds.device)
    cu_seqlens = torch.cat([starts, end])  # (B * D + 1,)
    extent = torch.empty((longest, 0), device=bounds.device)  # no storage: a size
    # Batches differ in their documents: a compiled block takes their count and the
    # longest one as dynamic sizes from the first batch instead of recompiling at the second.
    torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
    torch._dynamo.maybe_mark_dynamic(extent, 0)
    return DocumentSpans(cu_seqlens, extent, documents, kernel)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pack: Packing | None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal SDPA of ``q``, ``k``, ``v`` ``(B, heads, T, d)``, kept inside documents with
    ``pack``: through the variable-length kernel of its spans where that takes the call,
    else through its mask, or (rows split by context parallelism, whose attention builds
    no mask of the whole row) through ``packed_documents``, opened here so that each
    call, a checkpointed block's recompute or another pipeline microbatch's included,
    sees its own documents. ``enable_gqa``: ``k`` and ``v`` have fewer heads (SDPA's)."""
    if pack is not None and pack.spans is not None:
        spans = pack.spans
        if spans.kernel.takes(q, k, v, dropout_p):
            return _varlen_attention(q, k, v, spans, enable_gqa)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=spans.mask(), dropout_p=dropout_p, enable_gqa=enable_gqa
        )
    if pack is not None and pack.mask is not None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=pack.mask, dropout_p=dropout_p, enable_gqa=enable_gqa
        )
    documents = packed_documents(pack.documents) if pack is not None else nullcontext()
    with documents:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=enable_gqa
        )


def takes_grouped_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: Packing | None
) -> bool:
    """Whether :func:`causal_attention` of ``q``, ``k``, ``v`` (no dropout) with ``pack``
    runs the variable-length kernel, which takes grouped key/value heads as they are: a
    caller that repeats them to the query heads for SDPA's sake need not (it costs
    ``heads / kv_heads`` times the keys and values, and their gradients)."""
    return pack is not None and pack.spans is not None and pack.spans.kernel.takes(q, k, v, 0.0)


def _varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: DocumentSpans, gqa: bool
) -> torch.Tensor:
    """:func:`causal_attention` through ``spans``' kernel: SDPA's layout ``(B, heads, T, d)``
    to the kernel's ``(B * T, heads, d)`` (rows flattened, as ``cu_seqlens`` counts them)
    and back; ``k`` and ``v`` keep their own (fewer, with ``gqa``) heads."""
    b, heads, t, d = q.shape
    dtype = compute_dtype(q)  # under autocast, what SDPA would have computed in

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).transpose(1, 2).reshape(b * t, x.shape[1], d)

    out = spans.kernel.run(flat(q), flat(k), flat(v), spans.cu_seqlens, spans.longest, gqa)
    return out.view(b, t, heads, d).transpose(1, 2)  # (B, heads, T, d)
