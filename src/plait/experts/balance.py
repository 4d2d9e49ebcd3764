"""Load balancing, computed over the global batch whatever the layout.

**The rule that makes it layout-independent.** The token counts per expert are summed over
every rank that holds different tokens of the batch (the *load-balance mesh*: the ep ranks,
times the data-parallel ranks) before anything uses them. Counts are integers, so the sum
is exact in any order: the expert load, the balance loss's ``f`` and the bias update are
the same numbers on every rank and at every ep / dp split, equal to one process running the
whole batch. What stays local is what is differentiable: the mean router probability ``P``
and the z-loss, each averaged over this rank's tokens. With equal tokens per rank (the
data-parallel convention under which the mean of local losses is the global loss) the mean
over ranks of each rank's auxiliary loss is the single-process one, and so is its gradient
once data parallelism averages the router's gradient. This is the "global-batch" balance
loss (Megatron-Core's ``global_aux_loss``, Qwen's global-batch balancing). Its ``f`` is
that of each forward's tokens: under gradient accumulation or a pipeline, of each
microbatch's tokens over the data-parallel ranks, a grouping of the batch that the split
over ranks changes.

The other balance loss is DeepSeek-V3's sequence-wise one (Megatron-Core's
``seq_aux_loss``): ``f`` and ``P`` per sequence, the loss their mean over sequences. A
sequence's loss depends on that sequence alone, so it needs no communication and is the
same however the batch is split: over ranks, microbatches and pipeline stages alike.

Formulas (``E`` experts, top-``k``, ``c_e`` global picks of expert ``e``):

* balance loss (Switch / DeepSeek-V2 "expert-level"): ``coeff * E * sum_e f_e * P_e`` with
  ``f_e = c_e / sum(c)`` and ``P_e`` the local mean of ``probs[:, e]``; 1 at perfect balance.
* sequence-wise balance loss (DeepSeek-V3): ``coeff * mean_s sum_e f_se * P_se`` with
  ``f_se = c_se * E / (k * T)`` (``c_se`` picks of expert ``e`` among the ``T`` tokens of
  sequence ``s``) and ``P_se`` the mean of ``probs[:, e]`` over them; also 1 at balance.
* router z-loss (ST-MoE): ``coeff * mean_t logsumexp(logits_t)^2``.
* auxiliary-loss-free bias (DeepSeek-V3): after each step, ``bias_e += speed *
  sign(mean(c) - c_e)``: an overloaded expert becomes less likely to be chosen.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["balance_loss", "bias_step", "global_counts", "sequence_balance_loss", "z_loss"]


def global_counts(
    counts: torch.Tensor,
    mesh: DeviceMesh | None,
    groups: tuple[dist.ProcessGroup, ...] = (),
) -> torch.Tensor:
    """``counts`` (integers) summed over every rank of ``mesh`` (each dim in turn), then
    over each of ``groups`` (a copy).

    ``None`` and no groups: one process holds the whole batch, ``counts`` is already global.
    """
    total = counts.detach().clone()
    dims = [] if mesh is None else [mesh.get_group(dim) for dim in range(mesh.ndim)]
    for group in [*dims, *groups]:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def balance_loss(probs: torch.Tensor, counts: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * E * sum_e f_e * P_e``: ``probs`` ``(N, E)`` local, ``counts`` ``(E,)`` global."""
    fraction = counts.to(probs.dtype) / counts.sum().clamp(min=1)  # (E,) f: no gradient
    mean_prob = probs.mean(dim=0)  # (E,) P: local tokens
    return coeff * probs.shape[-1] * (fraction * mean_prob).sum()


def sequence_balance_loss(
    probs: torch.Tensor, picks: torch.Tensor, seq_len: int, coeff: float
) -> torch.Tensor:
    """``coeff * mean_s sum_e f_se * P_se``: ``probs`` ``(N, E)`` and ``picks`` ``(N, k)`` of
    ``N / seq_len`` whole sequences of ``seq_len`` tokens each, in order."""
    n, experts = probs.shape
    k = picks.shape[1]
    if n % seq_len:
        raise ValueError(f"{n} tokens are not whole sequences of {seq_len}")
    seqs = n // seq_len
    counts = torch.zeros(seqs, experts, dtype=probs.dtype, device=probs.device)
    ones = torch.ones(seqs, seq_len * k, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, picks.reshape(seqs, seq_len * k), ones)  # (S, E): no gradient
    fraction = counts * (experts / (k * seq_len))
    mean_prob = probs.view(seqs, seq_len, experts).mean(dim=1)  # (S, E)
    return coeff * (fraction * mean_prob).sum(dim=1).mean()


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * mean_t logsumexp(logits_t)^2``: keeps router logits small (ST-MoE)."""
    return coeff * torch.logsumexp(logits, dim=-1).square().mean()


@torch.no_grad()
def bias_step(bias: torch.Tensor, load: torch.Tensor, speed: float) -> None:
    """DeepSeek-V3's update, in place: lower the bias of experts loaded above the mean,
    raise it below; ``load`` ``(E,)`` is the global token count of the step."""
    load = load.to(bias.dtype)
    bias.add_(speed * torch.sign(load.mean() - load))
