"""A small GPT-style decoder, defined once for the trainer, the benchmarks and the tests.

Byte-level (vocabulary 256 by default), pre-norm blocks of causal self-attention and a GELU
MLP, learned position embeddings. With ``experts`` > 0 each block's MLP is a mixture of
experts instead (``plait.experts.MoE``: top-k routing, SwiGLU experts, optional shared
experts, load balancing), which expert parallelism shards. Blocks live in
``self.blocks`` (an ``nn.ModuleList``) so that parallelism recipes can wrap or split them
by index. Attention has separate q, k and v projections and infers its head count from
their width, so the tensor-parallel plan (:mod:`plait.train.parallelize`) can split them
by heads.

The forward is :class:`plait.train.decoder.Decoder`'s, shared with the Llama family: a
pipeline stage is the same class with parts removed (``plait.pipeline.split_model``), which
skips the embeddings and the head when they are falsy, so every parameter a stage keeps has
the name it has in the whole model, and checkpoints of pipelined and unpipelined runs are
interchangeable. Packed rows (several documents in one row of the batch):
``forward(idx, documents)`` keeps attention inside each document and restarts positions at
0 in each (:mod:`plait.train.packing`); ``forward(idx)`` is one document per row, plain
causal attention. The loss ignores targets equal to :data:`IGNORE` (chat prompts, padding).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from plait.experts import MoE
from plait.train.decoder import Decoder, tied_head

# Re-exported: the GPT's configuration was defined here before plait.train.gpt_config (torch-free,
# so the planner reads it without importing torch); the trainer and tests import it from here.
from plait.train.gpt_config import GPTConfig as GPTConfig

# Re-exported: packed rows were defined here before plait.train.packing, and the training
# step and tests import them from this module.
from plait.train.packing import Packing as Packing
from plait.train.packing import causal_attention as causal_attention
from plait.train.packing import document_positions as document_positions
from plait.train.packing import packing as packing

#: A target that takes no part in the loss (torch's ``cross_entropy`` default ``ignore_index``).
IGNORE = -100


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k and v projections.

    Separate projections let tensor parallelism split each of them column-wise by heads
    (a fused q/k/v matrix split by rows would mix q, k and v across ranks). The number of
    heads is read from the projections' output width, so under tensor parallelism each
    rank runs its ``n_head / tp`` local heads with the same code.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, pack: Packing | None = None) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]  # x: (B, T, C)
        # (B, heads, T, head_dim), heads = this rank's: all of them without tensor parallelism.
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        dropout = self.dropout if self.training else 0.0
        y = causal_attention(q, k, v, pack, dropout)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, C)


class MLPBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_mlp)
        self.proj = nn.Linear(cfg.d_mlp, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


def moe_block(cfg: GPTConfig) -> MoE:
    """The mixture-of-experts feed-forward of ``cfg`` (``cfg.experts`` > 0)."""
    return MoE(
        cfg.d_model,
        cfg.d_expert,
        cfg.experts,
        cfg.top_k,
        num_shared_experts=cfg.shared_experts,
        aux_loss_coeff=cfg.aux_loss_coeff,
        aux_loss_type=cfg.aux_loss_type,
        z_loss_coeff=cfg.z_loss_coeff,
        bias_update_speed=cfg.bias_update_speed or None,
    )


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp: nn.Module = moe_block(cfg) if cfg.experts else MLPBlock(cfg)

    def forward(self, x: torch.Tensor, pack: Packing | None = None) -> torch.Tensor:
        # pack by keyword: tensor parallelism prepares attention's positional input only.
        x = x + self.attn(self.ln1(x), pack=pack)
        return x + self.mlp(self.ln2(x))


class GPT(Decoder):
    """``forward(idx: (B, T) int64) -> logits (B, T, vocab)`` (:class:`Decoder`'s), token
    and learned position embeddings summed."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.seq_len, cfg.n_layer)
        self.cfg = cfg
        # Optional: a pipeline stage drops those of other stages (see the module docstring).
        tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.tok_emb = tok_emb
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.d_model)
        self.head = tied_head(tok_emb, cfg.tie_weights)
        self.positions = None
        self.init_weights()  # the decoder's rule (plait.train.param_init)

    @property
    def moe_shape(self) -> tuple[int, int] | None:
        """``(n_layer, experts)``: the shape of the expert-load table of a model with MoE
        blocks; None for a dense model (as :attr:`plait.train.llama.Llama.moe_shape`)."""
        return (self.cfg.n_layer, self.cfg.experts) if self.cfg.experts else None

    def embed(self, idx: torch.Tensor, pack: Packing | None) -> torch.Tensor:
        """Token ids ``(B, T)`` to token plus position embeddings ``(B, T, C)``: each
        token's position in its document with packed rows, its global position under
        context parallelism (``self.positions``), else ``0 .. T-1``. On a pipeline stage
        without the embeddings, its input unchanged."""
        if not (self.tok_emb and self.pos_emb):  # falsy on stages without them (split_model)
            return idx
        if pack is not None:
            pos = pack.positions  # (B, T)
        elif self.positions is not None:
            pos = self.positions
        else:
            pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T)
    over the targets that are not :data:`IGNORE` (as :func:`token_loss`)."""
    return _cross_entropy(logits, targets, "mean")


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The *sum* of the next-token cross-entropies of ``logits`` (B, T, V) against
    ``targets`` (B, T), over the targets that are not :data:`IGNORE`: divided by the loss
    tokens of the whole global batch, the token-weighted mean every layout computes alike.

    Computed in float32 whatever the logits' dtype (bf16 logits lose too much in the softmax).
    Under tensor parallelism the logits are a DTensor sharded by vocabulary and this runs
    inside ``loss_parallel`` (its backward too); the loss, a DTensor replicated over the tp
    ranks, is returned as its local value (the loss itself), gradients flowing through.
    """
    return _cross_entropy(logits, targets, "sum")


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE,
        reduction=reduction,
    )
    return loss.to_local() if isinstance(loss, DTensor) else loss
