"""A tiny transformer and its tensor-parallel plan, shared by the TP composition tests.

The plan is the field's usual one (torchtitan's, Megatron's): attention q/k/v column-wise and
its output row-wise, MLP fc1 column-wise and fc2 row-wise, the embedding row-wise (its
vocabulary split), the head column-wise; with sequence parallelism the norms run on
sequence shards and activations between blocks stay sharded on the sequence dimension.
Everything here is torch's own ``torch.distributed.tensor.parallel``: plait composes with
it, it does not replace it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

VOCAB, DIM, HEADS, HIDDEN, SEQ = 16, 8, 2, 16, 4


class Attention(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # ``-1`` heads: under tensor parallelism each rank holds heads / tp of them.
        q, k, v = (
            p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(DIM)
        self.attn = Attention()
        self.mlp_norm = nn.LayerNorm(DIM)
        self.mlp = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """Embedding, ``n`` pre-norm blocks, final norm, head: logits ``(batch, seq, vocab)``."""

    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def token_batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``(tokens, targets)``, each ``(batch, SEQ)``."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(VOCAB, (batch, SEQ), generator=g),
            torch.randint(VOCAB, (batch, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


def block_plan(sequence_parallel: bool) -> dict[str, object]:
    """The TP plan of one ``Block``; with ``sequence_parallel`` its input and output are
    sharded on the sequence dimension (dim 1)."""
    if not sequence_parallel:
        return {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(),
        }
    to_full = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "attn_norm": SequenceParallel(),
        "attn": to_full,
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.out": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tp(model: TinyGPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True) -> TinyGPT:
    """Tensor-parallelize ``model`` in place over ``tp_mesh`` (a 1-D mesh) and return it."""
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)  # type: ignore[arg-type]
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel))  # type: ignore[arg-type]
    return model
