"""Which keys a query may attend to, from global positions and document ids.

The rule is that of one process attending over the whole sequence: with ``is_causal`` a
query at position ``i`` sees keys at positions ``<= i``; with document ids (packed
sequences) it sees only keys of its own document (a block-diagonal mask, causal inside each
block when ``is_causal``). Built from the tokens' global positions, so it holds in any
layout of the sequence over ranks.
"""

from __future__ import annotations

import torch

__all__ = ["allowed"]


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
