"""The training step with a pipeline: this rank's stages, run by a plait schedule.

The schedule (``--schedule``, torch's class names) splits the local batch into
``--microbatches`` pieces and runs this rank's actions: forwards and backwards of its
stages, sends and receives between neighbouring ranks, and, for stages under
``fully_shard`` / ``replicate``, one gather, free and gradient reduction per step. Only the
rank holding the last stage computes losses.

Packed rows: the documents and positions go to every stage as keyword arguments, which the
schedule cuts into microbatches like the inputs, so each stage's forward (and a
checkpointed block's recompute) sees its own microbatch's, with nothing sent between
stages. The loss of microbatch i is its tokens' sum over the global batch's count, times
the gradient ranks (:mod:`plait.train.step_batch`); the schedule seeds each backward with 1
(``scale_grads=False``): the microbatches' gradients add up to the global batch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from plait.layout import PP
from plait.mesh import mesh_device
from plait.pipeline import PipelineScheduleSingle, PipelineStage, get_schedule_class
from plait.train.config import ExecutionConfig, TrainConfig
from plait.train.model import token_loss
from plait.train.parallelize import Stage, forward_context, loss_context
from plait.train.step_batch import StepBatch, gradient_ranks

__all__ = ["PipelineStepper"]


def _microbatch_loss(
    logits: torch.Tensor, targets: torch.Tensor, tokens: torch.Tensor, scale: float
) -> torch.Tensor:
    """The schedule's ``loss_fn``: microbatch tokens' loss sum over the global count, times
    the gradient ranks ``scale``."""
    return token_loss(logits, targets) * (scale / tokens)


class PipelineStepper:
    """:class:`~plait.train.step.Stepper` for ``--pp`` > 1, of this rank's ``stages``;
    ``cfg``: the execution group (or the whole TrainConfig); ``mesh``: the layout's."""

    def __init__(
        self, stages: list[Stage], cfg: ExecutionConfig | TrainConfig, mesh: DeviceMesh
    ) -> None:
        self.execution = execution = ExecutionConfig.of(cfg)
        layout = execution.layout
        self.scale = float(gradient_ranks(layout))
        group, device = mesh[PP].get_group(), mesh_device(mesh)
        pipeline_stages = [
            PipelineStage(s.module, s.index, s.n_stages, device, group=group) for s in stages
        ]
        # One lookup in plait.pipeline's registry (case-insensitive, as --schedule is);
        # resolve() has already refused names it does not hold.
        schedule_class = get_schedule_class(layout.schedule)
        single = issubclass(schedule_class, PipelineScheduleSingle)
        # The single-stage classes take a stage, the looped ones this rank's list of stages.
        self.schedule = schedule_class(
            pipeline_stages[0] if single else pipeline_stages,  # type: ignore[arg-type]
            layout.microbatches,
            loss_fn=_microbatch_loss,
            scale_grads=False,
            max_active_stages=layout.max_active_stages or None,
        )
        self.has_loss = any(s.is_last for s in stages)

    def _local_loss(self, losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        if not self.has_loss:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([loss.detach().float() for loss in losses]).sum() / self.scale

    def train(self, batch: StepBatch) -> torch.Tensor:
        return self._run(self.schedule.step, batch)  # forwards and backwards

    def evaluate(self, batch: StepBatch) -> torch.Tensor:
        return self._run(self.schedule.eval, batch)

    def _run(self, run: Callable[..., Any], batch: StepBatch) -> torch.Tensor:
        """``run`` (the schedule's ``step`` or ``eval``) over ``batch``'s microbatches;
        this rank's contribution to the loss."""
        losses: list[torch.Tensor] = []
        # The backwards run in the schedule's step too.
        with loss_context(self.execution.layout), forward_context(self.execution):
            run(
                batch.inputs,
                target=batch.targets,
                losses=losses,
                return_outputs=False,
                loss_kwargs={"tokens": batch.tokens, "scale": self.scale},
                **batch.model_kwargs(),
            )
        return self._local_loss(losses, batch.inputs.device)
