"""A Llama-family block (:class:`LlamaBlock`): pre-norm attention, then a pre-norm
feed-forward, a SwiGLU MLP (:class:`SwiGLU`) or, in the configuration's MoE layers, a
mixture of SwiGLU experts (:func:`moe_block`). Its submodules' names (``ln1``, ``attn``,
``ln2``, ``mlp``) are the GPT block's, so ``plait train``'s recipe applies unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from plait.experts import MoE
from plait.train.llama.attention import LlamaAttention
from plait.train.llama.config import LlamaConfig
from plait.train.llama.rms_norm import RMSNorm
from plait.train.packing import Packing

__all__ = ["LlamaBlock", "SwiGLU", "moe_block"]


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def moe_block(cfg: LlamaConfig) -> MoE:
    """The mixture-of-experts feed-forward of ``cfg``'s MoE blocks: a softmax router's
    top-k (renormalised with ``norm_topk_prob``), SwiGLU experts (``w1`` the gate, ``w3``
    the up and ``w2`` the down projection: Mixtral's and Qwen3-MoE's math), no shared
    experts, ``router_aux_loss_coef`` weighting the balance loss over the global batch."""
    return MoE(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        score_func="softmax",
        route_norm=cfg.norm_topk_prob,
        aux_loss_coeff=cfg.router_aux_loss_coef,
        aux_loss_type="global",
    )


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        """Block ``layer`` of ``cfg``: its MLP a MoE when ``cfg.moe_layers`` has it."""
        super().__init__()
        self.ln1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = LlamaAttention(cfg)
        self.ln2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = moe_block(cfg) if layer in cfg.moe_layers else SwiGLU(cfg)

    def forward(self, x: torch.Tensor, pack: Packing | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), pack=pack)  # by keyword: TP prepares x only
        return x + self.mlp(self.ln2(x))
