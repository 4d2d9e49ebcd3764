"""Dry runs: plait's real training step for one rank of a large world, in one process.

:func:`step_memory` runs ``plait train``'s recipe, with the code training runs (the
GPT, :class:`plait.train.loop.Trainable`: tensor parallelism, checkpointing,
``fully_shard`` / ``replicate``; AdamW, gradient clipping, the optimizer step), for a few
steps inside whatever process group is initialised, and measures the peak live tensor
memory of the training steps with :class:`~plait.plan.live.LiveTensors`. Real
multi-process CPU runs call it on every rank.

:func:`dry_run` calls it for one rank of a world of any size without devices or peers: a
fake process group (torch's ``fake`` backend: collectives return at once and move no data)
and fake tensors (sizes, dtypes and storages without data, so a 7B-parameter model costs
no memory and no arithmetic). The code that runs is plait's own, so the dry run counts
what plait allocates, including what the planner's formulas leave out.

Pipelines are not dry-run: their stages learn their input shapes from their neighbours,
and a fake peer sends nothing. Ranks without a pipeline are alike, so rank 0 (which holds
the largest shard when a parameter does not divide evenly) stands for all.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.plan.live import LiveTensors
from plait.train.config import TrainConfig
from plait.train.layout import resolve
from plait.train.loop import Trainable, model_config
from plait.train.model import GPT

__all__ = ["MeasuredMemory", "dry_run", "step_memory"]


@dataclass(frozen=True)
class MeasuredMemory:
    """Bytes of live tensors on one rank: ``peak`` during the training steps, ``setup``
    once the model is parallelised and the optimizer built (sharded parameters), and
    ``seconds`` the measurement took."""

    peak: int
    setup: int
    seconds: float


def step_memory(
    cfg: TrainConfig,
    steps: int = 1,
    seed: int = 0,
    tensors: AbstractContextManager[Any] | None = None,
) -> MeasuredMemory:
    """Peak live tensor bytes of ``steps`` training steps of ``cfg`` (resolved, for the
    initialised process group's world) on this rank.

    The optimizer's state is made before the steps (as the first update makes it), so
    even one step measures the steady state's peak. Batches are random tokens: memory does
    not depend on the data. ``tensors``: a mode the model and the steps run under (the
    dry run's fake tensors), entered once the device mesh is built. Collective: every rank
    of the world must call it.
    """
    start = time.perf_counter()
    mesh = cfg.layout.mesh(cfg.device)
    live = LiveTensors(device_type=torch.device(cfg.device).type)
    with tensors or nullcontext(), live:
        torch.manual_seed(seed)
        with torch.device(cfg.device):  # built in place: fake tensors cannot be moved
            model = GPT(model_config(cfg))
        parts = Trainable(model, cfg, mesh)
        del model  # a pipeline rank keeps only its stages
        local = (cfg.local_batch, cfg.seq_len)
        setup = live.current
        _create_optimizer_state(parts.optimizer)
        live.reset_peak()  # building the whole model before sharding it is not training
        for _ in range(steps):
            x = torch.randint(0, 256, local, device=cfg.device)
            y = torch.randint(0, 256, local, device=cfg.device)
            parts.stepper.train(x, y)
            parts.update()
            del x, y
    return MeasuredMemory(live.peak, setup, time.perf_counter() - start)


def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer``'s state as its first step would (AdamW's moments), without a
    forward and backward: an update with zero gradients, then the gradients dropped."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    lr = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # weight decay is scaled by lr: the parameters do not move
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, lr, strict=True):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)


def dry_run(cfg: TrainConfig, world: int, steps: int = 1) -> MeasuredMemory:
    """:func:`step_memory` of rank 0 of a ``world``-rank run of ``cfg``, in this process,
    with a fake process group and fake tensors (module docstring).

    ``cfg`` is resolved for ``world`` (``dp_shard`` 0 takes what the other sizes leave).
    Refuses (ValueError) a pipeline, and a process that already has a process group.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = resolve(cfg.replace(nproc=world, device="cpu"), world_size=world)
    if cfg.pp > 1:
        raise ValueError(
            f"dry run of --pp {cfg.pp}: pipeline stages learn their input shapes from their "
            "neighbours, which a fake process group does not have; dry-run without --pp"
        )
    if dist.is_initialized():
        raise ValueError("dry_run needs a process without a process group: it makes a fake one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        return step_memory(cfg, steps, tensors=FakeTensorMode(allow_non_fake_inputs=True))
    finally:
        dist.destroy_process_group()
