"""One step's forward and backward, and the validation forward, for a rank's stages.

Two implementations of :class:`Stepper`, chosen by :func:`make_stepper`:

* without a pipeline, the local batch is split into ``--microbatches`` pieces whose
  gradients accumulate, communication held back until the last one;
* with one, the pipeline schedule runs the microbatches (:mod:`plait.train.pipelined`).

Both return this rank's *local* mean loss as a 0-d float32 tensor, or zero on ranks that
compute no loss (pipeline ranks without the last stage); :func:`global_mean` turns that
into the loss of the global batch.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait import spmd
from plait.fsdp import FSDPModule
from plait.mesh import collective_device
from plait.replicate import ReplicateModule
from plait.train.config import TrainConfig
from plait.train.model import lm_loss
from plait.train.parallelize import Stage, forward_context, loss_context

__all__ = ["Stepper", "global_mean", "make_stepper"]


class Stepper(Protocol):
    def train(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's part of a global batch; gradients are then
        ready for the optimizer. Returns the local mean loss (detached)."""
        ...

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The local mean loss without gradients."""
        ...


def make_stepper(stages: list[Stage], cfg: TrainConfig, mesh: DeviceMesh | None) -> Stepper:
    if cfg.pp > 1:
        from plait.train.pipelined import PipelineStepper

        assert mesh is not None
        return PipelineStepper(stages, cfg, mesh)
    return DataParallelStepper(stages[0], cfg)


def global_mean(local: torch.Tensor, cfg: TrainConfig) -> float:
    """The mean over data-parallel ranks of their local losses (the global batch's loss
    for equal local batches); ranks without a loss contribute zero. ``local`` may hold
    several losses, one per batch: the mean of the batches' global losses, for one
    collective and one wait for the device. The ``tp`` ranks of a data-parallel rank hold
    the same loss (of the same batch), so the sum over all ranks counts it ``tp`` times;
    its ``cp`` ranks hold the losses of equal shares of its tokens, averaged alike."""
    total = local.detach().float().reshape(-1)
    copies = 1
    if dist.is_initialized() and dist.get_world_size() > 1:
        world, copies = dist.group.WORLD, cfg.dp * cfg.cp * cfg.tp
        total = total.to(collective_device(world)).clone()
        spmd.record("all_reduce", total, world, "the loss")
        spmd.wait(dist.all_reduce(total, group=world, async_op=True), "all_reduce of the loss")
    losses = total.tolist()
    return sum(loss / copies for loss in losses) / len(losses)


def _set_gradient_sync(module: torch.nn.Module, enabled: bool) -> None:
    """Hold back (or allow) data-parallel gradient communication in the next backwards."""
    if isinstance(module, FSDPModule | ReplicateModule):
        module.set_requires_gradient_sync(enabled)


class DataParallelStepper:
    """No pipeline: the whole model on every rank, gradient accumulation over microbatches."""

    def __init__(self, stage: Stage, cfg: TrainConfig) -> None:
        self.module = stage.module
        self.cfg = cfg

    def train(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        m = self.cfg.microbatches
        total = torch.zeros((), dtype=torch.float32, device=inputs.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(m), targets.chunk(m), strict=True)):
            # Each microbatch's loss is scaled by 1/m, so the accumulated gradient is that
            # of the mean loss over the local batch; only the last backward communicates.
            _set_gradient_sync(self.module, i == m - 1)
            with loss_context(self.cfg):
                with forward_context(self.cfg):
                    loss = lm_loss(self.module(x), y) / m
                loss.backward()
            total += loss.detach()
        return total

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with loss_context(self.cfg), forward_context(self.cfg):
            return lm_loss(self.module(inputs), targets).float()
