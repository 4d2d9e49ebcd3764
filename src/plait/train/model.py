"""A small GPT-style decoder, defined once for the trainer, the benchmarks and the tests.

Byte-level (vocabulary 256 by default), pre-norm blocks of causal self-attention and a GELU
MLP, learned position embeddings. Blocks live in ``self.blocks`` (an ``nn.ModuleList``) so
that parallelism recipes can wrap or split them by index.

A pipeline stage is the same class with parts removed (``plait.pipeline.split_model``):
parts outside the stage become falsy pass-through placeholders, and ``forward`` skips the
embeddings and the head when they are falsy. So every parameter a stage keeps has the name
it has in the whole model, and checkpoints of pipelined and unpipelined runs are interchangeable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    tie_weights: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        y = y.transpose(1, 2).reshape(b, t, c)  # (B, T, C)
        return self.proj(y)


class MLPBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLPBlock(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
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
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, std=residual_std)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` to logits ``(B, T, vocab)``.

        A pipeline stage without the embeddings takes hidden states ``(B, T, C)`` instead,
        and one without the head returns hidden states.
        """
        t = x.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len={self.cfg.seq_len}")
        if self.tok_emb and self.pos_emb:  # falsy on stages without them (split_model)
            pos = torch.arange(t, device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        if self.ln_f and self.head:
            x = self.head(self.ln_f(x))  # (B, T, vocab)
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T).

    Computed in float32 whatever the logits' dtype (bf16 logits lose too much in the softmax).
    """
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
