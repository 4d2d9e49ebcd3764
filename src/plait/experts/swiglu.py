"""SwiGLU feed-forward networks: one (a shared expert) or ``E`` stacked (the routed experts).

An expert computes ``w2(silu(x @ w1) * (x @ w3))``. :class:`GroupedExperts` keeps the
``E`` experts' weights stacked on a leading expert dimension, the layout expert parallelism
shards (``Shard(0)``: each ep rank holds ``E / ep`` whole experts)::

    w1: (E, dim, hidden)    w3: (E, dim, hidden)    w2: (E, hidden, dim)

Tokens go in and out in ``x @ w`` orientation (no transposes). torchtitan's current
``GroupedExperts`` stores the transpose of each matrix (``nn.Linear``'s ``(out, in)``, for
checkpoint conversion); the expert dimension, and so the sharding, is the same.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from plait.experts.counts import host_counts

__all__ = ["GroupedExperts", "SwiGLU"]


class SwiGLU(nn.Module):
    """One SwiGLU feed-forward network (the shared experts of an MoE layer)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (..., dim)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts with stacked weights, run on expert-sorted rows.

    ``forward(x, counts)``: ``x`` ``(n, dim)`` holds rows grouped by expert in expert order
    (``counts[e]`` rows for expert ``e``, ``counts.sum() == n``); returns ``(n, dim)``, row
    ``i`` the output of its expert. An expert with no rows is run on an empty block, so the
    autograd graph (and what activation checkpointing saves) has the same shape on every
    rank whatever the routing.

    Under expert parallelism the weights are ``Shard(0)`` DTensors; the forward then runs
    this rank's experts on their local tensors and ``counts`` has one entry per local
    expert (``plait.experts.ExpertParallel`` dispatches the rows and the counts).

    The experts run one after another (a loop of plain matmuls): exact, and each expert's
    result does not depend on how many other experts a rank holds. A grouped GEMM is the
    fast path on accelerators; it changes nothing else here.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's matrices as ``nn.Linear`` would start them: uniform in
        ``+-1/sqrt(fan_in)``."""
        for weight in (self.w1, self.w2, self.w3):
            bound = 1.0 / math.sqrt(weight.shape[1])
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))  # (E_local, ., .)
        if counts.shape != (w1.shape[0],):
            raise ValueError(
                f"GroupedExperts: counts has shape {tuple(counts.shape)} but this rank holds "
                f"{w1.shape[0]} experts: pass one row count per (local) expert"
            )
        # One device-to-host sync: dropless routing makes block sizes data-dependent.
        blocks = x.split(host_counts(counts, x.shape[0]))  # E_local x (n_e, dim)
        outs = [
            (F.silu(rows @ a) * (rows @ c)) @ b  # (n_e, dim)
            for rows, a, b, c in zip(blocks, w1.unbind(0), w2.unbind(0), w3.unbind(0), strict=True)
        ]
        return torch.cat(outs)  # (n, dim)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a (possibly expert-sharded) stacked weight."""
    # Token blocks have data-dependent sizes that DTensor cannot describe, so the experts
    # compute on local tensors; gradients flow back into the DTensor parameter.
    return weight.to_local() if isinstance(weight, DTensor) else weight
