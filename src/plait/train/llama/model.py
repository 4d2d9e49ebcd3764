"""The Llama-family model (:class:`Llama`): a :class:`~plait.train.decoder.Decoder` of
:class:`~plait.train.llama.block.LlamaBlock` s, a final RMSNorm and a head, tied to the
token embedding or not. No position embedding: every attention's rotary embedding takes
the positions, so the model hands its ``positions`` (context parallelism's global ones) to
each of them.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.train.decoder import Decoder, tied_head
from plait.train.llama.block import LlamaBlock
from plait.train.llama.config import LlamaConfig
from plait.train.llama.rms_norm import RMSNorm
from plait.train.llama.values import LlamaConfigError

__all__ = ["Llama"]


class Llama(Decoder):
    """``forward(idx: (B, T) int64) -> logits (B, T, vocab)`` (:class:`Decoder`'s); on a
    pipeline stage without the embedding it takes hidden states, without the head it
    returns them (as GPT)."""

    def __init__(self, cfg: LlamaConfig, seq_len: int) -> None:
        super().__init__(seq_len, cfg.num_hidden_layers)
        if seq_len > cfg.max_position_embeddings:
            raise LlamaConfigError(
                f"seq_len {seq_len} exceeds max_position_embeddings {cfg.max_position_embeddings}"
            )
        if cfg.sliding_window is not None and seq_len > cfg.sliding_window:
            raise LlamaConfigError(
                f"seq_len {seq_len} exceeds sliding_window {cfg.sliding_window} (attention "
                "here spans the whole sequence: no window)"
            )
        self.cfg = cfg
        tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.tok_emb = tok_emb
        self.blocks = nn.ModuleList(LlamaBlock(cfg, i) for i in range(cfg.num_hidden_layers))
        self.ln_f: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = tied_head(tok_emb, cfg.tie_word_embeddings)
        self.init_weights()  # the decoder's rule (plait.train.param_init)

    @property
    def moe_shape(self) -> tuple[int, int] | None:
        """``(blocks, experts)`` of the expert-load table of a model with MoE blocks (dense
        blocks' rows stay zero); None for a dense model."""
        return self.cfg.moe_shape

    @property
    def positions(self) -> torch.Tensor | None:
        """The global positions of the tokens ``forward`` gets, when they are not the first
        ``T`` of a sequence (context parallelism); every attention's rotary embedding
        uses them."""
        for block in self.blocks:
            if isinstance(block, LlamaBlock):
                return block.attn.positions
        return None

    @positions.setter
    def positions(self, value: torch.Tensor | None) -> None:
        for block in self.blocks:
            if isinstance(block, LlamaBlock):
                block.attn.positions = value
