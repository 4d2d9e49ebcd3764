"""The small mixture-of-experts model the expert-parallel and FSDP mesh-group tests share.

``MoENet``: two blocks (a linear, then a residual ``plait.experts.MoE`` with one shared
expert, balance and z losses and the bias update on), and a head. ``moe_batches``: the
fixed global batches both train on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.experts import MoE

DIM, HIDDEN, EXPERTS, TOP_K = 8, 12, 8, 2
SEQS, SEQ_LEN, STEPS = 8, 3, 3


def moe_layer(experts: int = EXPERTS, **overrides: Any) -> MoE:
    """The tests' MoE layer; ``overrides`` replace its keyword arguments."""
    kwargs: dict[str, Any] = dict(
        num_shared_experts=1, aux_loss_coeff=0.01, z_loss_coeff=1e-3, bias_update_speed=1e-2
    )
    kwargs.update(overrides)
    return MoE(DIM, HIDDEN, experts, min(TOP_K, experts), **kwargs)


class MoEBlock(nn.Module):
    def __init__(self, experts: int = EXPERTS) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = moe_layer(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # (B, T, C)
        return h + self.moe(h)


class MoENet(nn.Module):
    def __init__(self, experts: int = EXPERTS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MoEBlock(experts), MoEBlock(experts)])
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def moe_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` fixed (inputs, targets) global batches of shape (SEQS, SEQ_LEN, DIM)."""
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(SEQS, SEQ_LEN, DIM, generator=gen),
            torch.randn(SEQS, SEQ_LEN, DIM, generator=gen),
        )
        for _ in range(STEPS)
    ]
