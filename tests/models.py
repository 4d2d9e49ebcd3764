"""Small models shared by the tests."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Linear-ReLU-Linear: the smallest model with more than one layer to wrap."""

    def __init__(self, dim: int = 8, hidden: int = 16, out: int | None = None) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden)
        self.out_proj = nn.Linear(hidden, dim if out is None else out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


class MLPStack(nn.Module):
    """``n`` residual MLP blocks: the shape most parallel wrappings are applied to."""

    def __init__(self, n: int = 3, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP(dim, hidden) for _ in range(n))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)
