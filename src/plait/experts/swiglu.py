"""SwiGLU feed-forward networks: one (a shared expert) or ``E`` stacked (the routed experts).

An expert computes ``w2(silu(x @ w1) * (x @ w3))``. :class:`GroupedExperts` keeps the
``E`` experts' weights stacked on a leading expert dimension, the layout expert parallelism
shards (``Shard(0)``: each ep rank holds ``E / ep`` whole experts)::

    w1: (E, dim, hidden)    w3: (E, dim, hidden)    w2: (E, hidden, dim)

Tokens go in and out in ``x @ w`` orientation (no transposes). torchtitan's current
``GroupedExperts`` stores the transpose of each matrix (``nn.Linear``'s ``(out, in)``, for
checkpoint conversion); the expert dimension, and so the sharding, is the same.

The experts run as grouped GEMMs (``plait.experts.grouped``) where torch can, else one
after another; :func:`set_grouped_mm` chooses for every ``GroupedExperts`` of a model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from plait.experts.counts import host_counts
from plait.experts.grouped import autocast_weights, grouped_mm_supported, grouped_swiglu

__all__ = ["GroupedExperts", "SwiGLU", "set_grouped_mm"]


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
    (``counts[e]`` rows for expert ``e``, ``counts.sum() == n``, which the grouped path
    trusts without reading the counts); returns ``(n, dim)``, row
    ``i`` the output of its expert. An expert with no rows is run on an empty block, so the
    autograd graph (and what activation checkpointing saves) has the same shape on every
    rank whatever the routing.

    Under expert parallelism the weights are ``Shard(0)`` DTensors; the forward then runs
    this rank's experts on their local tensors and ``counts`` has one entry per local
    expert (``plait.experts.ExpertParallel`` dispatches the rows and the counts).

    How the experts run (``grouped_mm``, default True; :func:`set_grouped_mm` sets it on a
    whole model): as three ``torch._grouped_mm`` calls, one per stacked matrix (six in
    backward), wherever ``plait.experts.grouped.grouped_mm_supported`` allows it: on CPU for
    float32 / bfloat16 / float16 rows whose widths (``dim``, ``hidden``) are multiples of 16
    bytes, on CUDA for bfloat16 on compute capability 9.x / 10.x (H100, B200), and in traced
    runs (``torch.compile``, fake tensors) for bfloat16; under autocast the rows and weights
    are first cast to autocast's dtype, as autocast casts the loop's matmuls. The offsets
    stay on the device: no host sync. Everywhere else, and with ``grouped_mm=False``, the
    experts run one after another (a loop of plain matmuls over ``x.split(counts)``, one
    device-to-host read of the counts). On CPU the grouped GEMMs are bitwise the loop's
    matmuls (torch multiplies each expert's block with the same ``mm``), under autocast too,
    and the whole SwiGLU is bitwise the loop's where ``hidden`` is a multiple of 32 floats,
    else equal to an ulp of ``silu`` (``plait.experts.grouped`` says why); CUDA's fused
    kernel rounds like any other GEMM kernel. In the loop an expert's result does not
    depend, to the bit, on how many other experts a rank holds; grouped, to that rounding.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, *, grouped_mm: bool = True) -> None:
        super().__init__()
        self.num_experts = num_experts
        #: Run the experts as grouped GEMMs where torch can (False: always the loop).
        self.grouped_mm = grouped_mm
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
        if self.grouped_mm:
            weights = autocast_weights(x, (w1, w2, w3))  # as autocast's matmuls see them
            if grouped_mm_supported(x, weights):
                return grouped_swiglu(x, counts, *weights)  # (n, dim)
        # One device-to-host sync: dropless routing makes block sizes data-dependent.
        blocks = x.split(host_counts(counts, x.shape[0]))  # E_local x (n_e, dim)
        outs = [
            (F.silu(rows @ a) * (rows @ c)) @ b  # (n_e, dim)
            for rows, a, b, c in zip(blocks, w1.unbind(0), w2.unbind(0), w3.unbind(0), strict=True)
        ]
        return torch.cat(outs)  # (n, dim)


def set_grouped_mm(module: nn.Module, enabled: bool) -> None:
    """Set ``grouped_mm`` on every :class:`GroupedExperts` in ``module`` (itself included):
    ``True`` runs the experts as grouped GEMMs where torch can, ``False`` always as a loop.
    Benchmarks compare the two; both train alike."""
    for m in module.modules():
        if isinstance(m, GroupedExperts):
            m.grouped_mm = enabled


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a (possibly expert-sharded) stacked weight."""
    # Token blocks have data-dependent sizes that DTensor cannot describe, so the experts
    # compute on local tensors; gradients flow back into the DTensor parameter.
    return weight.to_local() if isinstance(weight, DTensor) else weight
