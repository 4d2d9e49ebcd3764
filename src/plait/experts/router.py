"""Token-choice top-k routing: which ``k`` experts each token goes to, and with what weight.

A linear gate scores every expert for every token (softmax or sigmoid, in fp32); each token
picks its ``k`` best. The auxiliary-loss-free balancing bias (DeepSeek-V3) is added to the
scores for the *choice* only: the weights that scale the chosen experts' outputs come from
the unbiased scores, so the bias steers load without entering the model's function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

__all__ = ["Routing", "ScoreFunc", "TopKRouter"]

ScoreFunc = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class Routing:
    """One forward's routing of ``N`` tokens over ``E`` experts."""

    experts: torch.Tensor  # (N, k) int64: the experts each token goes to
    weights: torch.Tensor  # (N, k) fp32: what each chosen expert's output is scaled by
    probs: torch.Tensor  # (N, E) fp32: scores normalised to sum 1 per token (aux loss's P)
    logits: torch.Tensor  # (N, E) fp32: the gate's raw output (z-loss's input)


class TopKRouter(nn.Module):
    """Routes each token to its ``top_k`` highest-scoring experts.

    Args:
        dim: token width.
        num_experts: ``E``.
        top_k: experts per token, ``1 <= top_k <= E``.
        score_func: ``"softmax"`` over experts (Mixtral, DeepSeek-V2) or an independent
            ``"sigmoid"`` per expert (DeepSeek-V3).
        route_norm: rescale each token's ``k`` weights to sum 1.
        route_scale: a constant factor on every weight (DeepSeek-V3's routed scaling).
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: ScoreFunc = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"TopKRouter: top_k={top_k} must be between 1 and num_experts={num_experts}"
            )
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(
                f"TopKRouter: score_func must be 'softmax' or 'sigmoid', got {score_func!r}"
            )
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func: ScoreFunc = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None) -> Routing:
        """Route ``x`` of shape ``(N, dim)``; ``expert_bias`` ``(E,)`` shifts the choice only."""
        # Scores in fp32 whatever the compute dtype: top-k on low-precision scores ties and
        # flips, and softmax over many experts loses the small ones.
        logits = self.gate(x).float()  # (N, E)
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)  # (N, E)
            probs = scores
        else:
            scores = logits.sigmoid()  # (N, E)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choice = scores if expert_bias is None else scores + expert_bias
        experts = choice.topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, experts)  # (N, k)
        if self.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return Routing(experts=experts, weights=weights, probs=probs, logits=logits)
