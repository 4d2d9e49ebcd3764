"""A reference mixture-of-experts layer: router, stacked experts, optional shared experts,
dropless top-k routing and load balancing.

``MoE`` is a drop-in feed-forward block, ``(B, T, dim) -> (B, T, dim)``. Every token
reaches all of its ``k`` experts (no capacity, nothing dropped); a token's output is the
shared experts' output plus the weighted sum of its experts' outputs. The layer is the
same module with and without expert parallelism: ``ExpertParallel`` on ``moe.experts``
changes where expert rows are computed, nothing else.

Load balancing (see ``plait.experts.balance`` for the formulas and why they do not depend
on the layout):

* ``aux_loss_coeff`` / ``z_loss_coeff``: the balance loss (``aux_loss_type``: ``"global"``
  over the global batch of each forward, or DeepSeek-V3's ``"sequence"``-wise loss, whose
  value does not depend on how the batch is split) and router z-loss. They join the
  loss without the caller adding them: backward through the layer's output gives them a
  gradient of ``aux_loss_scale`` (1 by default; set it to the factor the training loss is
  scaled by, e.g. ``1 / microbatches`` under gradient accumulation). ``moe.aux_loss`` holds
  the last value, detached, for logging.
* ``bias_update_speed``: DeepSeek-V3's auxiliary-loss-free balancing. ``expert_bias`` is
  added to the scores for the choice of experts only; :func:`update_expert_bias`, called
  after each optimizer step, moves it against the step's load.
* ``tokens_per_expert``: global token counts of the training forwards since the last
  :func:`update_expert_bias` (recomputation under activation checkpointing is not counted
  twice). :func:`expert_load` reads them for metrics.

"Global" means summed over ``load_balance_mesh``, the ranks holding different tokens of
one batch; :func:`set_load_balance_mesh` (or ``expert_parallel``) sets it. Left ``None``,
the layer balances over the ranks its experts are sharded over (the ep ranks: enough for
pure expert parallelism; data parallelism beside it must widen it), or over its own tokens
when the experts are not sharded, as one process does. Training forwards also sum over
``load_balance_groups`` (:func:`set_load_balance_groups`): process groups outside the mesh
whose ranks hold other tokens of the batch, e.g. torchft's managed group across
fault-tolerant replica groups.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from plait.experts.balance import (
    balance_loss,
    bias_step,
    global_counts,
    sequence_balance_loss,
    z_loss,
)
from plait.experts.router import Routing, ScoreFunc, TopKRouter
from plait.experts.rows import gather_rows, scale_grad, split_rows
from plait.experts.swiglu import GroupedExperts, SwiGLU
from plait.hooks import in_backward

__all__ = [
    "AuxLossType",
    "MoE",
    "expert_load",
    "set_load_balance_groups",
    "set_load_balance_mesh",
    "split_routed_rows",
    "update_expert_bias",
]

#: The balance losses (``plait.experts.balance``).
AuxLossType = Literal["global", "sequence"]


class MoE(nn.Module):
    """Token-choice top-k mixture of SwiGLU experts (see the module docstring).

    Args:
        dim: token width.
        hidden: each expert's hidden width.
        num_experts: routed experts ``E``.
        top_k: experts per token.
        score_func, route_norm, route_scale: the router's (``TopKRouter``).
        num_shared_experts: shared experts every token goes through (one SwiGLU of
            ``hidden * num_shared_experts``); 0 for none.
        aux_loss_coeff: weight of the balance loss; 0 turns it off.
        aux_loss_type: ``"global"`` (over each forward's tokens on all data-parallel ranks)
            or ``"sequence"`` (per sequence, the input's second-to-last dim; DeepSeek-V3).
        z_loss_coeff: weight of the router z-loss; 0 turns it off.
        bias_update_speed: the auxiliary-loss-free bias's step (DeepSeek-V3's gamma,
            e.g. 1e-3); ``None`` for no bias.
        grouped_mm: run the routed experts as grouped GEMMs where torch can (``False``:
            always one after another); see ``GroupedExperts``.
    """

    tokens_per_expert: torch.Tensor
    expert_bias: torch.Tensor | None

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: ScoreFunc = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        num_shared_experts: int = 0,
        aux_loss_coeff: float = 0.0,
        aux_loss_type: AuxLossType = "global",
        z_loss_coeff: float = 0.0,
        bias_update_speed: float | None = None,
        grouped_mm: bool = True,
    ) -> None:
        super().__init__()
        self.router = TopKRouter(
            dim,
            num_experts,
            top_k,
            score_func=score_func,
            route_norm=route_norm,
            route_scale=route_scale,
        )
        self.experts = GroupedExperts(dim, hidden, num_experts, grouped_mm=grouped_mm)
        self.shared_experts = (
            SwiGLU(dim, hidden * num_shared_experts) if num_shared_experts > 0 else None
        )
        if aux_loss_type not in ("global", "sequence"):
            raise ValueError(f"aux_loss_type {aux_loss_type!r}: use 'global' or 'sequence'")
        self.aux_loss_coeff = aux_loss_coeff
        self.aux_loss_type = aux_loss_type
        self.z_loss_coeff = z_loss_coeff
        self.aux_loss_scale = 1.0
        self.bias_update_speed = bias_update_speed
        bias = torch.zeros(num_experts) if bias_update_speed is not None else None
        self.register_buffer("expert_bias", bias)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )
        self.load_balance_mesh: DeviceMesh | None = None
        self.load_balance_groups: tuple[dist.ProcessGroup, ...] = ()
        #: Ranks that hold the same tokens and split the routed rows between them
        #: (:func:`split_routed_rows`); None: this rank computes them all.
        self.row_split: dist.ProcessGroup | None = None
        self.aux_loss: torch.Tensor | None = None

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The buffers as the constructor makes them, where they live (after ``to_empty``:
        a model built on the meta device): the balancing bias and the load counts zero."""
        self.tokens_per_expert.zero_()
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # (B, T, dim), or any (..., dim)
        x = x.reshape(-1, shape[-1])  # (N, dim)
        route = self.router(x, self.expert_bias)
        picks = route.experts.flatten()  # (N*k,) token-major: token t's picks at t*k ...
        # (E,) picks per expert; a scatter, not bincount: its shape is known before the data
        counts = torch.zeros(self.experts.num_experts, dtype=torch.int64, device=picks.device)
        counts.scatter_add_(0, picks, torch.ones_like(picks))
        groups = self.load_balance_groups if self.training else ()
        load = global_counts(counts, self._balance_mesh(), groups)  # (E,) the whole batch's
        # Picks sorted by expert; stable, so each expert's rows stay in token order (the
        # order that makes expert parallelism reproduce one process exactly).
        order = torch.argsort(picks, stable=True)  # (N*k,)
        token = order // self.router.top_k  # (N*k,) the token of each sorted pick
        rows = self._routed(x.index_select(0, token), counts)  # (N*k, dim)
        weights = route.weights.flatten()[order].unsqueeze(-1)  # (N*k, 1)
        rows = rows * weights.to(rows.dtype)
        # Each token sums its k outputs: the rows put back in token-major order by a gather
        # (whose backward keeps only the index; an index_add would keep all N*k rows).
        positions = torch.arange(order.numel(), device=order.device)
        inverse = torch.empty_like(order).scatter_(0, order, positions)
        routed = rows.index_select(0, inverse).view(-1, self.router.top_k, shape[-1]).sum(1)
        out = routed if self.shared_experts is None else self.shared_experts(x) + routed
        seq_len = shape[-2] if len(shape) > 2 else shape[0]  # (N, dim): one sequence
        out = self._balance(out, route, load, seq_len)
        return out.view(shape)

    def _routed(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The routed experts' outputs for the expert-sorted ``rows``: on this rank alone, or
        with ``row_split`` each of its ranks computing one chunk (``plait.experts.rows``)."""
        group = self.row_split
        size = 1 if group is None else dist.get_world_size(group)
        if group is None or size == 1 or rows.shape[0] % size:
            return self.experts(rows, counts)  # (an uneven split: every rank computes all)
        part, part_counts = split_rows(rows, counts, group)
        # The experts' weight gradients cover this rank's chunk: multiplied by the group's
        # size, the average their fully_shard group takes over these ranks is their sum.
        # The input rows' gradients are scaled back, so the rest of the model is unchanged.
        part = scale_grad(part, 1.0 / size)
        out = scale_grad(self.experts(part, part_counts), float(size))
        return gather_rows(out, group)

    def _balance_mesh(self) -> DeviceMesh | None:
        if self.load_balance_mesh is not None:
            return self.load_balance_mesh
        # Sharded experts mean their ranks hold different tokens (ep ranks are data
        # parallel): at least those must share the counts.
        weight = self.experts.w1
        return weight.device_mesh if isinstance(weight, DTensor) else None

    def _balance(
        self, out: torch.Tensor, route: Routing, load: torch.Tensor, seq_len: int
    ) -> torch.Tensor:
        """Count the load and attach the auxiliary losses to ``out``'s backward."""
        recompute = in_backward()  # a checkpoint's recompute: this forward already counted
        if self.training and not recompute:
            self.tokens_per_expert += load
        aux: torch.Tensor | None = None
        if self.aux_loss_coeff and self.aux_loss_type == "sequence":
            aux = sequence_balance_loss(route.probs, route.experts, seq_len, self.aux_loss_coeff)
        elif self.aux_loss_coeff:
            aux = balance_loss(route.probs, load, self.aux_loss_coeff)
        if self.z_loss_coeff:
            z = z_loss(route.logits, self.z_loss_coeff)
            aux = z if aux is None else aux + z
        if aux is None:
            return out
        if not recompute:
            self.aux_loss = aux.detach()
        if not aux.requires_grad:
            return out
        with_aux: torch.Tensor = _WithAuxLoss.apply(out, aux, self.aux_loss_scale)
        return with_aux

    @torch.no_grad()
    def update_expert_bias(self, move: bool = True) -> None:
        """Apply the bias step for the load counted since the last call (unless ``move`` is
        False: a step that was dropped), then reset it."""
        if move and self.expert_bias is not None and self.bias_update_speed is not None:
            bias_step(self.expert_bias, self.tokens_per_expert, self.bias_update_speed)
        self.tokens_per_expert.zero_()


class _WithAuxLoss(torch.autograd.Function):
    """Identity on the layer's output; its backward also gives the auxiliary loss a
    gradient of ``scale``, so the loss joins whatever backward starts from the output
    (Megatron-Core attaches its balance loss the same way)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shape, dtype, device = ctx.aux_like
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def _moe_layers(module: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]


def split_routed_rows(module: nn.Module, mesh: DeviceMesh) -> None:
    """Let the ranks of the 1-D ``mesh``, which see the same tokens (tensor parallelism),
    share the routed experts' rows in every ``MoE`` of ``module``: each runs one contiguous
    chunk of the expert-sorted rows and the chunks' outputs are all-gathered
    (``plait.experts.rows``), so a rank computes ``1 / mesh.size()`` of the routed rows,
    and of their all-to-all under expert parallelism.

    The router, the balance losses and the load still see every token on every rank. The
    routed experts' gradients then cover each rank's chunk, multiplied by the mesh's size:
    shard the experts over a ``fully_shard`` group that spans these ranks (its average is
    then the sum over them) and hold no other copy of them on these ranks. A chunking that
    does not divide the rows falls back to every rank computing all of them.
    """
    group = mesh.get_group()
    for _, moe in _moe_layers(module):
        moe.row_split = group


def set_load_balance_mesh(module: nn.Module, mesh: DeviceMesh | None) -> None:
    """Balance every ``MoE`` in ``module`` over the ranks of ``mesh`` (all of its dims): the
    ranks that hold different tokens of one batch, e.g. the ``(dp, ep)`` mesh. Every
    forward then sums the token counts over them (one small all-reduce per dim)."""
    for _, moe in _moe_layers(module):
        moe.load_balance_mesh = mesh


def set_load_balance_groups(module: nn.Module, groups: tuple[dist.ProcessGroup, ...]) -> None:
    """Every ``MoE`` in ``module`` also sums its training forwards' token counts over each of
    ``groups``, after its ``load_balance_mesh``: ranks outside the mesh that hold other
    tokens of the same batch (torchft's managed group across replica groups)."""
    for _, moe in _moe_layers(module):
        moe.load_balance_groups = groups


@torch.no_grad()
def update_expert_bias(module: nn.Module, move: bool = True) -> None:
    """End of a training step for every ``MoE`` in ``module``: move each expert bias
    against the step's load (where ``bias_update_speed`` is set; not when ``move`` is False,
    for a step that was dropped) and reset the counts.

    Call it after ``optimizer.step()`` (after all microbatches of the step). Every rank
    computes the same update from the same global counts: no communication.
    """
    for _, moe in _moe_layers(module):
        moe.update_expert_bias(move)


def expert_load(module: nn.Module) -> dict[str, torch.Tensor]:
    """Tokens per expert of each ``MoE`` in ``module`` (by name) since the last
    :func:`update_expert_bias`: global counts, the same on every rank."""
    return {name: moe.tokens_per_expert.clone() for name, moe in _moe_layers(module)}
