"""One step's forward and backward, and the validation forward, for a rank's stages.

Two implementations of :class:`Stepper`, chosen by :func:`make_stepper`:

* without a pipeline, the local batch is split into ``--microbatches`` pieces whose
  gradients accumulate, communication held back until the last one;
* with one, the pipeline schedule runs the microbatches (:mod:`plait.train.pipelined`).

They take a :class:`~plait.train.step_batch.StepBatch` and return this rank's contribution
to the global batch's token-weighted loss; what a step takes and how that loss is
normalized is :mod:`plait.train.step_batch`'s (its names are re-exported here).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh

from plait.fsdp import FSDPModule
from plait.replicate import ReplicateModule
from plait.train.config import ExecutionConfig, TrainConfig
from plait.train.model import token_loss
from plait.train.parallelize import Stage, forward_context, loss_context
from plait.train.pipelined import PipelineStepper
from plait.train.step_batch import StepBatch, global_loss, gradient_ranks, step_batch

__all__ = ["StepBatch", "Stepper", "global_loss", "gradient_ranks", "make_stepper", "step_batch"]


class Stepper(Protocol):
    def train(self, batch: StepBatch) -> torch.Tensor:
        """Forward and backward of this rank's part of a global batch; gradients are then
        ready for the optimizer. Returns this rank's contribution to the global batch's
        loss (detached, 0-d float32; see the module docstring)."""
        ...

    def evaluate(self, batch: StepBatch) -> torch.Tensor:
        """This rank's contribution to the loss, without gradients."""
        ...


def make_stepper(
    stages: list[Stage], cfg: ExecutionConfig | TrainConfig, mesh: DeviceMesh | None
) -> Stepper:
    """The stepper of this rank's ``stages`` (module docstring); ``cfg``: the execution
    group (or the whole TrainConfig); ``mesh``: the layout's (None for one process)."""
    execution = ExecutionConfig.of(cfg)
    if execution.layout.pp > 1:
        assert mesh is not None
        return PipelineStepper(stages, execution, mesh)
    return DataParallelStepper(stages[0], execution)


def _set_gradient_sync(module: torch.nn.Module, enabled: bool) -> None:
    """Hold back (or allow) data-parallel gradient communication in the next backwards."""
    if isinstance(module, FSDPModule | ReplicateModule):
        module.set_requires_gradient_sync(enabled)


def _rows(batch: StepBatch, m: int) -> list[StepBatch]:
    """``batch`` cut into ``m`` microbatches of rows (the global count kept)."""

    def cut(t: torch.Tensor | None) -> list[Any]:
        return [None] * m if t is None else list(t.chunk(m))

    rows = (batch.inputs, batch.targets, batch.documents, batch.positions, batch.bounds)
    parts = zip(*(cut(t) for t in rows), strict=True)
    # The longest document of the whole batch bounds each microbatch's.
    return [StepBatch(x, y, d, p, batch.tokens, s, batch.longest) for x, y, d, p, s in parts]


class DataParallelStepper:
    """No pipeline: the whole model on every rank, gradient accumulation over microbatches."""

    def __init__(self, stage: Stage, execution: ExecutionConfig) -> None:
        self.module = stage.module
        self.execution = execution
        self.scale = float(gradient_ranks(execution.layout))

    def train(self, batch: StepBatch) -> torch.Tensor:
        m = self.execution.layout.microbatches
        total = torch.zeros((), dtype=torch.float32, device=batch.inputs.device)
        for i, mb in enumerate(_rows(batch, m)):
            # Each microbatch's loss is its tokens' sum over the global count, so the
            # accumulated gradient is this rank's share of the global batch's; only the
            # last backward communicates (and averages over the gradient ranks: scaled up).
            _set_gradient_sync(self.module, i == m - 1)
            with loss_context(self.execution.layout):
                loss = self._loss(mb)
                (loss * self.scale).backward()
            total += loss.detach()
        return total

    def _loss(self, batch: StepBatch) -> torch.Tensor:
        """``batch``'s loss: its tokens' sum over the global count. The logits live only
        here: a reference held through the backward would keep them (tokens x vocabulary,
        the step's largest activation) alive to its end."""
        with forward_context(self.execution):
            logits = self.module(batch.inputs, **batch.model_kwargs())
            return token_loss(logits, batch.targets) / batch.tokens

    @torch.no_grad()
    def evaluate(self, batch: StepBatch) -> torch.Tensor:
        with loss_context(self.execution.layout):
            return self._loss(batch).float()
