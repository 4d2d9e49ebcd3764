"""The tensor-parallel benchmark model and its TP plan (torch's ``tensor.parallel`` styles).

plait's ``GPT`` fuses q/k/v into one linear and reshapes by the full ``d_model``, so a
column-wise split of it would mix q, k and v across ranks. The TP suite therefore trains
this decoder instead: the same sizes (``GPTConfig``: vocabulary, ``d_model``, heads, layers,
sequence length, MLP width ``4 * d_model``), separate q/k/v projections, and attention that
infers its local head count from the TP-local width.

The plan is the field's usual one (torchtitan's, Megatron's): q/k/v column-wise, attention
output row-wise, fc1 column-wise, fc2 row-wise, embedding row-wise (vocabulary split), head
column-wise with replicated logits; with sequence parallelism the norms are
``SequenceParallel`` and the activations between blocks stay sharded on the sequence
dimension. plait and torch modes apply the very same plan: only the data-parallel wrapper
around it differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from plait.train.model import GPTConfig


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # ``-1`` heads: under tensor parallelism each rank holds n_head / tp of them.
        q, k, v = (
            p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TPDecoder(nn.Module):
    """Token embedding, ``n_layer`` pre-norm blocks, final norm, head: ``(B, T)`` token ids
    to logits ``(B, T, vocab)``. Deterministic given the torch seed."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def check_divisible(cfg: GPTConfig, tp: int) -> None:
    """Raise ``ValueError`` naming the flag when ``cfg`` cannot be split ``tp`` ways."""
    sizes = {
        "--heads": cfg.n_head,
        "--d-model": cfg.d_model,
        "the vocabulary": cfg.vocab_size,
        "--seq-len (sequence parallelism)": cfg.seq_len,
    }
    for flag, size in sizes.items():
        if size % tp:
            raise ValueError(f"tp suite: {flag} ({size}) must be divisible by tp={tp}")


def _block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """One block's plan; with ``sequence_parallel`` its input and output are ``Shard(1)``."""
    plan: dict[str, ParallelStyle] = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.out": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(),
    }
    if sequence_parallel:
        # Norms run on sequence shards; attention and MLP gather the sequence on entry and
        # reduce-scatter it back on exit (the row-wise outputs become Shard(1)).
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan |= {
            "attn_norm": SequenceParallel(),
            "attn": gather,
            "attn.out": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": gather,
            "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
        }
    return plan


def apply_tp(model: TPDecoder, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> TPDecoder:
    """Tensor-parallelize ``model`` in place over the 1-D ``tp_mesh``; return it."""
    between: Shard | Replicate = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, ParallelStyle] = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "head": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    for block in model.blocks:
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
    return model
