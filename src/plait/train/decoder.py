"""The decoder both of ``plait train``'s model families are, and its one forward: token ids
through an embedding, the blocks, a final norm and a head. :class:`plait.train.model.GPT`
and :class:`plait.train.llama.Llama` subclass :class:`Decoder` and build the parts; the
forward, packed rows and pipeline stages included, is written once, here.

What a subclass provides, as attributes named so that checkpoints, the Hugging Face
mapping and the parallelize recipe find them: ``tok_emb`` (the token embedding), ``blocks``
(an ``nn.ModuleList``, each called ``block(x, pack)``), ``ln_f`` (the final norm) and
``head``, registered in the order its parameters are named and initialised (so a subclass
assigns them itself, in its ``__init__``); ``positions`` (the tokens' global positions
under context parallelism, else None). A subclass whose embedding is more than a lookup
of the tokens overrides :meth:`Decoder.embed` (GPT adds learned position embeddings).

A pipeline stage is the same module with parts removed (``plait.pipeline.split_model``):
parts outside the stage are falsy pass-through placeholders, so the forward guards the
embedding and the final norm and head by their truth value and skips them on stages
without them; blocks of other stages pass activations through. A stage without the
embedding takes hidden states ``(B, T, C)``, one without the head returns them.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.train.packing import Packing, packing
from plait.train.param_init import Init, decoder_init, init_parameters

__all__ = ["Decoder", "tied_head"]


def tied_head(tok_emb: nn.Embedding, tie: bool) -> nn.Linear:
    """The head of a decoder embedding its tokens with ``tok_emb``: a linear map from its
    width to its vocabulary without a bias, sharing the embedding's weight with ``tie``."""
    head = nn.Linear(tok_emb.embedding_dim, tok_emb.num_embeddings, bias=False)
    if tie:
        head.weight = tok_emb.weight
    return head


class Decoder(nn.Module):
    """``forward(idx: (B, T) int64) -> logits (B, T, vocab)``; parts built by subclasses
    (see the module docstring)."""

    # Optional parts are None-typed: a pipeline stage replaces those of other stages with
    # falsy placeholders (see the module docstring).
    tok_emb: nn.Embedding | None
    blocks: nn.ModuleList
    ln_f: nn.Module | None
    head: nn.Linear | None
    #: The global positions of the tokens ``forward`` gets, when they are not the first
    #: ``T`` of a sequence (context parallelism: this rank's share of every sequence).
    positions: torch.Tensor | None

    def __init__(self, seq_len: int, n_layer: int) -> None:
        super().__init__()
        #: The longest sequence it takes.
        self.seq_len = seq_len
        #: The whole model's number of blocks (a pipeline stage's too): the initial
        #: values of the residual projections depend on it.
        self.n_layer = n_layer

    def param_init(self, name: str, owner: nn.Module) -> Init:
        """How parameter ``name`` (its whole-model name) of module ``owner`` starts: the
        rule of :func:`plait.train.param_init.decoder_init`."""
        return decoder_init(name, owner, self.n_layer)

    def init_weights(self, seed: int | None = None) -> None:
        """Every parameter to its initial value (:mod:`plait.train.param_init`: drawn by
        its name from ``seed``; default ``torch.initial_seed()``, the seed of the last
        ``torch.manual_seed``), so ``torch.manual_seed(s)`` before building gives the
        weights ``plait train --seed s`` starts from (on the CPU). Sharded parameters get
        their pieces of the same values. A model on the meta device has nothing to set:
        ``plait train`` sets its values after giving it storage
        (:mod:`plait.train.materialize`)."""
        seed = torch.initial_seed() if seed is None else seed
        init_parameters(self, self.param_init, seed)

    def embed(self, idx: torch.Tensor, pack: Packing | None) -> torch.Tensor:
        """Token ids ``(B, T)`` to the first block's input ``(B, T, C)``; on a pipeline stage
        without the embedding, its input (hidden states) unchanged."""
        if self.tok_emb:  # falsy on stages without it (split_model)
            return self.tok_emb(idx)  # (B, T, C)
        return idx

    def forward(
        self,
        x: torch.Tensor,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        bounds: torch.Tensor | None = None,
        longest: int = 0,
    ) -> torch.Tensor:
        """Token ids ``(B, T)`` to logits ``(B, T, vocab)``.

        ``documents`` ``(B, T)``: packed rows, each token's document index in its row
        (non-decreasing); attention stays inside documents and positions restart at 0 in
        each (:func:`plait.train.packing.packing`). None: one document per row.
        ``positions`` ``(B, T)``: the tokens' positions in their documents, needed
        (computed on the whole rows, sharded like the inputs) when ``self.positions`` says
        the rows are split over context-parallel ranks. ``bounds`` ``(B, D + 1)`` and
        ``longest``: the whole rows' document boundaries and longest document
        (:func:`plait.train.packing.document_bounds`, computed on the host), with which a
        GPU attends through flash's variable-length kernel. A pipeline stage without the
        embeddings takes hidden states ``(B, T, C)`` instead, and one without the head
        returns hidden states.
        """
        t = x.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len={self.seq_len}")
        sharded = self.positions is not None
        pack = packing(documents, positions, sharded, bounds, longest)
        x = self.embed(x, pack)  # (B, T, C)
        for block in self.blocks:
            x = block(x, pack)
        if self.ln_f and self.head:  # falsy on stages without them (split_model)
            x = self.head(self.ln_f(x))  # (B, T, vocab)
        return x
