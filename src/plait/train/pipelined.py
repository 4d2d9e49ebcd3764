"""The training step with a pipeline: this rank's stages, run by a plait schedule.

The schedule (``--schedule``, torch's class names) splits the local batch into
``--microbatches`` pieces and runs this rank's actions: forwards and backwards of its
stages, sends and receives between neighbouring ranks, and, for stages under
``fully_shard`` / ``replicate``, one gather, free and gradient reduction per step. Only the
rank holding the last stage computes losses; its local loss is the mean of the
microbatches' (equal microbatches: the mean over the local batch).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from plait.layout import PP
from plait.mesh import mesh_device
from plait.pipeline import SCHEDULE_CLASSES, PipelineScheduleSingle, PipelineStage, schedule_spec
from plait.train.config import TrainConfig
from plait.train.model import lm_loss
from plait.train.parallelize import Stage, forward_context, loss_context

__all__ = ["PipelineStepper"]


class PipelineStepper:
    """:class:`~plait.train.step.Stepper` for ``--pp`` > 1."""

    def __init__(self, stages: list[Stage], cfg: TrainConfig, mesh: DeviceMesh) -> None:
        self.cfg = cfg
        group, device = mesh[PP].get_group(), mesh_device(mesh)
        pipeline_stages = [
            PipelineStage(s.module, s.index, s.n_stages, device, group=group) for s in stages
        ]
        schedule_class = SCHEDULE_CLASSES[schedule_spec(cfg.schedule).name]
        single = issubclass(schedule_class, PipelineScheduleSingle)
        # The single-stage classes take a stage, the looped ones this rank's list of stages.
        self.schedule = schedule_class(
            pipeline_stages[0] if single else pipeline_stages,  # type: ignore[arg-type]
            cfg.microbatches,
            loss_fn=lm_loss,
        )
        self.has_loss = any(s.is_last for s in stages)

    def _local_loss(self, losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        if not self.has_loss:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([loss.float() for loss in losses]).mean()

    def train(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        with loss_context(self.cfg), forward_context(self.cfg):  # backwards run in step too
            self.schedule.step(inputs, target=targets, losses=losses)
        return self._local_loss(losses, inputs.device)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        with loss_context(self.cfg), forward_context(self.cfg):
            self.schedule.eval(inputs, target=targets, losses=losses)
        return self._local_loss(losses, inputs.device)
