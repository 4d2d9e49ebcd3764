"""AdamW, its learning-rate schedule, and gradient clipping across every parallel layout.

The learning rate is a pure function of the step (linear warm-up, then cosine decay), set
on the optimizer before every step, so a resumed run needs no scheduler state.

Clipping needs the norm of the *whole* gradient, which no rank holds: plait's
``clip_grad_norm_`` adds up the squares of the ``fully_shard`` shards over the sharding
dimension, counts replicated gradients once, and sums over the pipeline group, whose
ranks hold different stages. Before it, :func:`finish_partial_grads` completes the gradients
that tensor parallelism leaves as pending sums, once for the optimizer's many operations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from plait.fsdp.clip import clip_grad_norm_
from plait.train.config import OptimConfig, TrainConfig

__all__ = ["build_optimizer", "clip_grad_norm", "finish_partial_grads", "lr_at"]


def build_optimizer(
    modules: Sequence[nn.Module], cfg: OptimConfig | TrainConfig
) -> torch.optim.AdamW:
    """AdamW over ``modules``' parameters at ``cfg.lr``; weight decay on matrices only (not
    on gains, biases: decaying a LayerNorm gain towards zero only hurts)."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, cfg: OptimConfig | TrainConfig) -> float:
    """Learning rate of (0-based) ``step``: warm-up to ``cfg.lr``, cosine down to
    ``cfg.lr * cfg.min_lr_ratio`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    decay_steps = max(1, cfg.steps - cfg.warmup - 1)
    progress = min(1.0, (step - cfg.warmup) / decay_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def finish_partial_grads(params: list[nn.Parameter]) -> None:
    """Replace each gradient that is a pending sum over ranks (a ``Partial`` DTensor) by the
    sum, replicated: one all-reduce per such gradient.

    Tensor parallelism leaves them on parameters replicated over the tp ranks that each
    rank uses on a part of the data: with sequence parallelism, the norms (each rank's
    gradient covers its positions only). The optimizer would sum them again in each of
    its operations (an all-reduce each); summed once here, they cost one.
    """
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
            summed = [Replicate() if pl.is_partial() else pl for pl in grad.placements]
            p.grad = grad.redistribute(grad.device_mesh, summed)


def clip_grad_norm(
    params: list[nn.Parameter],
    cfg: OptimConfig | TrainConfig,
    pipeline: dist.ProcessGroup | None,
    duplicates: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Scale gradients so that their global norm is at most ``cfg.grad_clip`` (0: never);
    returns the global norm before clipping, a 0-d tensor on the gradients' device (read
    it once the step is queued: reading waits for the device). ``pipeline``: the pipeline
    group, whose ranks hold different stages (None without a pipeline). ``duplicates``:
    parameters of ``params`` whose gradients equal another's (a tied matrix's second copy,
    :mod:`plait.train.tied`): left out of the norm, scaled alike."""
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    skip = {id(p) for p in duplicates}
    norm = clip_grad_norm_([p for p in params if id(p) not in skip], max_norm, group=pipeline)
    if max_norm < math.inf:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s factor
        with torch.no_grad():
            for p in duplicates:
                if p.grad is not None:
                    grad = p.grad
                    local = grad._local_tensor if isinstance(grad, DTensor) else grad
                    local.mul_(coef.to(local.device))
    return norm
