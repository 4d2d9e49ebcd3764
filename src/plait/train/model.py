"""A small GPT-style decoder, defined once for the trainer, the benchmarks and the tests.

Byte-level (vocabulary 256 by default), pre-norm blocks of causal self-attention and a GELU
MLP, learned position embeddings. With ``experts`` > 0 each block's MLP is a mixture of
experts instead (``plait.experts.MoE``: top-k routing, SwiGLU experts, optional shared
experts, load balancing), which expert parallelism shards. Blocks live in
``self.blocks`` (an ``nn.ModuleList``) so that parallelism recipes can wrap or split them
by index. Attention has separate q, k and v projections and infers its head count from
their width, so the tensor-parallel plan (:mod:`plait.train.parallelize`) can split them
by heads.

A pipeline stage is the same class with parts removed (``plait.pipeline.split_model``):
parts outside the stage become falsy pass-through placeholders, and ``forward`` skips the
embeddings and the head when they are falsy. So every parameter a stage keeps has the name
it has in the whole model, and checkpoints of pipelined and unpipelined runs are interchangeable.

Packed rows (several documents in one row of the batch): ``forward(idx, documents)`` keeps
attention inside each document and restarts positions at 0 in each, as transformers does
with packed sequences and position ids (:class:`Packing`, shared with
:mod:`plait.train.llama`); ``forward(idx)`` is one document per row, plain causal
attention. The loss ignores targets equal to :data:`IGNORE` (chat prompts, padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from plait.context import packed_documents
from plait.experts import AuxLossType, MoE

#: A target that takes no part in the loss (torch's ``cross_entropy`` default ``ignore_index``).
IGNORE = -100


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
) -> torch.Tensor:
    """Causal SDPA of ``q``, ``k``, ``v`` ``(B, heads, T, d)``, kept inside documents with
    ``pack``: through its mask, or (rows split by context parallelism, whose attention
    builds no mask of the whole row) through ``packed_documents``, opened here so that
    each call, a checkpointed block's recompute or another pipeline microbatch's included,
    sees its own documents."""
    if pack is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    if pack.mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=pack.mask, dropout_p=dropout_p)
    with packed_documents(pack.documents):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    tie_weights: bool = False
    # Mixture of experts (0 experts: a dense MLP in every block).
    experts: int = 0
    top_k: int = 2
    shared_experts: int = 0
    expert_hidden: int = 0  # 0: d_mlp // (top_k + shared_experts), as many active weights
    aux_loss_coeff: float = 0.0
    aux_loss_type: AuxLossType = "sequence"
    z_loss_coeff: float = 0.0
    bias_update_speed: float = 0.0  # 0: no auxiliary-loss-free bias

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k ({self.top_k}) must be in 1..experts ({self.experts})")

    @property
    def d_mlp(self) -> int:
        """The MLP's hidden width."""
        return 4 * self.d_model

    @property
    def d_expert(self) -> int:
        """Each expert's hidden width: a token's active MLP weights (its ``top_k`` experts
        and the shared ones) match the dense MLP's unless ``expert_hidden`` says otherwise."""
        return self.expert_hidden or max(1, self.d_mlp // (self.top_k + self.shared_experts))


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


class GPT(nn.Module):
    """``forward(idx: (B, T) int64) -> logits (B, T, vocab)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Optional: a pipeline stage drops those of other stages (see the module docstring).
        tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.tok_emb: nn.Embedding | None = tok_emb
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.d_model)
        head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            head.weight = tok_emb.weight
        self.head: nn.Linear | None = head
        #: The global positions of the tokens ``forward`` gets, when they are not the first
        #: ``T`` of a sequence (context parallelism: this rank's share of every sequence).
        self.positions: torch.Tensor | None = None
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 style initialisation; deterministic given the torch seed."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith("weight"):
                    nn.init.ones_(p)  # LayerNorm gains
                else:
                    nn.init.zeros_(p)
            elif name.endswith(("proj.weight", "w2", "w2.weight")):  # into the residual
                nn.init.normal_(p, std=residual_std)
            else:
                nn.init.normal_(p, std=0.02)

    @property
    def moe_shape(self) -> tuple[int, int] | None:
        """``(n_layer, experts)``: the shape of the expert-load table of a model with MoE
        blocks; None for a dense model (as :attr:`plait.train.llama.Llama.moe_shape`)."""
        return (self.cfg.n_layer, self.cfg.experts) if self.cfg.experts else None

    @property
    def seq_len(self) -> int:
        """The longest sequence it takes."""
        return self.cfg.seq_len

    def forward(
        self,
        x: torch.Tensor,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids ``(B, T)`` to logits ``(B, T, vocab)``.

        ``documents`` ``(B, T)``: packed rows, each token's document index in its row
        (non-decreasing); attention stays inside documents and positions restart at 0 in
        each (:func:`packing`). None: one document per row. ``positions`` ``(B, T)``: the
        tokens' positions in their documents, needed (computed on the whole rows, sharded
        like the inputs) when ``self.positions`` says the rows are split over
        context-parallel ranks. A pipeline stage without the embeddings takes hidden states
        ``(B, T, C)`` instead, and one without the head returns hidden states.
        """
        t = x.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len={self.cfg.seq_len}")
        pack = packing(documents, positions, sharded=self.positions is not None)
        if self.tok_emb and self.pos_emb:  # falsy on stages without them (split_model)
            if pack is not None:
                pos = pack.positions  # (B, T)
            elif self.positions is not None:
                pos = self.positions
            else:
                pos = torch.arange(t, device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x, pack)
        if self.ln_f and self.head:
            x = self.head(self.ln_f(x))  # (B, T, vocab)
        return x


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
