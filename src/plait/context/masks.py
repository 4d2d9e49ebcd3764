"""Which keys a query may attend to, from global positions and document ids.

The rule is that of one process attending over the whole sequence: with ``is_causal`` a
query at position ``i`` sees keys at positions ``<= i``; with document ids (packed
sequences) it sees only keys of its own document (a block-diagonal mask, causal inside each
block when ``is_causal``). Built from the tokens' global positions, so it holds in any
layout of the sequence over ranks.

For fused kernels, the same rule per block of queries and keys (:func:`visibility`): a
block is skipped, seen whole, causal (the square diagonal block), or, only where documents
cut it, masked with :func:`allowed` restricted to the block.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["DocSpan", "Visibility", "allowed", "doc_spans", "visibility"]


def allowed(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    is_causal: bool,
    q_docs: torch.Tensor | None = None,
    k_docs: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Boolean mask ``(B or 1, 1, Tq, Tk)``, True where query ``i`` may attend to key ``j``;
    ``None`` when every query sees every key.

    ``q_pos`` ``(Tq,)`` and ``k_pos`` ``(Tk,)`` are global positions; ``q_docs`` ``(B, Tq)``
    and ``k_docs`` ``(B, Tk)`` the document id of each token (both or neither).
    """
    mask: torch.Tensor | None = None
    if is_causal:
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # (1, 1, Tq, Tk)
    if q_docs is not None and k_docs is not None:
        same = (q_docs[:, :, None] == k_docs[:, None, :])[:, None]  # (B, 1, Tq, Tk)
        mask = same if mask is None else mask & same
    return mask


#: How a block of queries (one chunk) sees a block of keys (one chunk): not at all
#: (skipped), every key (no mask), causally with the same positions on both sides (the
#: square diagonal block: SDPA's ``is_causal``, top-left and bottom-right alike), or only
#: through a mask (some rows see part of the keys because of documents).
Visibility = Literal["hidden", "full", "causal", "masked"]

#: Per batch row, the least and greatest document id of one chunk.
DocSpan = tuple[tuple[int, int], ...]


def doc_spans(docs: torch.Tensor, chunk_len: int) -> list[DocSpan] | None:
    """The :data:`DocSpan` of each chunk of ``docs`` ``(B, n * chunk_len)`` (one host
    transfer for all chunks); ``None`` for fake or meta tensors, whose values are unknown
    (then every block that documents might cut is masked)."""
    if docs.device.type == "meta" or is_fake(docs):
        return None
    chunks = docs.view(docs.shape[0], -1, chunk_len)
    lows, highs = chunks.amin(-1).t().tolist(), chunks.amax(-1).t().tolist()  # (n, B)
    return [tuple(zip(lo, hi, strict=True)) for lo, hi in zip(lows, highs, strict=True)]


def _one_document(q: DocSpan, k: DocSpan) -> bool:
    return all(ql == qh == kl == kh for (ql, qh), (kl, kh) in zip(q, k, strict=True))


def _no_common_document(q: DocSpan, k: DocSpan) -> bool:
    return all(kh < ql or kl > qh for (ql, qh), (kl, kh) in zip(q, k, strict=True))


def visibility(
    q_chunk: int,
    k_chunk: int,
    is_causal: bool,
    spans: list[DocSpan] | None = None,
    documents: bool = False,
) -> Visibility:
    """How the queries of chunk ``q_chunk`` see the keys of chunk ``k_chunk`` (global chunk
    indices of equal length). With ``documents``, ``spans`` (from :func:`doc_spans`,
    indexed by chunk; ``None``: unknown) decides whether the block lies inside one document
    in every row (as without documents), crosses documents only (hidden) or must be masked.
    Exact by construction: only a block that some rows see in part is ``"masked"``."""
    if is_causal and k_chunk > q_chunk:
        return "hidden"
    plain: Visibility = "causal" if is_causal and k_chunk == q_chunk else "full"
    if not documents:
        return plain
    if spans is None:
        return "masked"
    q, k = spans[q_chunk], spans[k_chunk]
    if _one_document(q, k):
        return plain
    if _no_common_document(q, k):
        return "hidden"
    return "masked"
