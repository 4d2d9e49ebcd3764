"""Dry runs: plait's real training step for one rank of a large world, in one process.

:func:`step_memory` runs ``plait train``'s recipe, with the code training runs (the
model of :func:`plait.train.loop.build_model`: the GPT, or the Llama-family model of
``model_config``; :class:`plait.train.loop.Trainable`: tensor parallelism, checkpointing,
``fully_shard`` / ``replicate``; AdamW, gradient clipping, the optimizer step), for a few
steps inside whatever process group is initialised (random token ids below the model's
vocabulary: memory does not depend on them), and measures the peak live tensor
memory of the training steps with :class:`~plait.plan.live.LiveTensors`. Real
multi-process CPU runs call it on every rank.

:func:`dry_run` calls it for one rank of a world of any size without devices or peers: a
fake process group (torch's ``fake`` backend: collectives return at once and move no data)
and fake tensors (sizes, dtypes and storages without data, so a 7B-parameter model costs
no memory and no arithmetic). The code that runs is plait's own, so the dry run counts
what plait allocates, including what the planner's formulas leave out. A mixture of
experts' routing is data (which fake tensors lack): its rows are taken as evenly spread over
the experts and the ep ranks (:func:`plait.experts.counts.balanced_counts`), the load the
planner assumes.

Ranks without a pipeline are alike, so rank 0 (which holds the largest shard when a
parameter does not divide evenly) stands for all.

Pipelines (:func:`pipeline_step`): rank 0 is the first pipeline rank. Its stages are
built, parallelised and sharded by plait's code as in training, but the schedule's
runtime is not used: its stages learn their input shapes from their neighbours, and a
fake peer sends nothing. Instead the rank's own actions of the schedule (plait's
generator, :func:`plait.pipeline.schedules.generate`) run in order, compute and
data-parallel steps only, as the runtime runs them: ``fully_shard`` ed stages gathered
once for the step with gradient sync off (:class:`plait.pipeline.grad_sync.StageGradSync`),
each forward's output kept until its backward, the gradients stashed after each
backward, reduced and the stages resharded at the end. What the peers would send is
stated instead: a stage other than the first receives a tensor of the first stage's
output shape and dtype (a stage boundary's shape: ``(microbatch, seq_len, d_model)``)
for each microbatch, kept until that microbatch's backward as the runtime keeps its
received inputs; a backward starts from a gradient of its output's shape (ones). Sends
and receives themselves move nothing (not measured: the runtime's send and receive
buffers, which the prediction counts, two boundary tensors). Rank 0 holds the most
microbatches in flight (``pp`` under 1F1B) and the embeddings; the last rank, which holds
the loss, is not measured. Schedules with full backwards only (GPipe, 1F1B,
Interleaved1F1B, LoopedBFS), without tensor parallelism (a stage boundary is then a
DTensor, rebuilt by the runtime's mesh resolution).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.experts.counts import balanced_counts
from plait.layout import Layout
from plait.pipeline.schedules import schedule_spec
from plait.plan.live import LiveTensors
from plait.train.config import TrainConfig
from plait.train.loop import Trainable, build_model
from plait.train.parallelize import build_expert_mesh, forward_context, loss_context
from plait.train.resolve import model_shape, resolve
from plait.train.step import StepBatch

__all__ = [
    "DRY_RUN_SCHEDULES",
    "MeasuredMemory",
    "dry_run",
    "pipeline_step",
    "replicated_tp",
    "step_memory",
]

#: The pipeline schedules a dry run runs (full backwards: every action is F or B).
DRY_RUN_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")


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
    *,
    pipeline_dry_run: bool = False,
) -> MeasuredMemory:
    """Peak live tensor bytes of ``steps`` training steps of ``cfg`` (resolved, for the
    initialised process group's world) on this rank.

    The optimizer's state is made before the steps (as the first update makes it), so
    even one step measures the steady state's peak. Batches are random tokens: memory does
    not depend on the data. ``tensors``: a mode the model and the steps run under (the
    dry run's fake tensors), entered once the device mesh is built. Collective: every rank
    of the world must call it. ``pipeline_dry_run``: with a pipeline, run this rank's
    actions without its peers (:func:`pipeline_step`) instead of the schedule's runtime.
    """
    start = time.perf_counter()
    # Every mesh is built before the fake tensors (building one reads real tensors).
    mesh = cfg.layout.mesh(cfg.device)
    moe = model_shape(cfg).experts > 0  # the model is built after the meshes
    side_meshes = (build_expert_mesh(cfg, moe), cfg.layout.shard_mesh(cfg.device))
    pipelined = cfg.pp > 1 and pipeline_dry_run
    live = LiveTensors(device_type=torch.device(cfg.device).type)
    # Fake tensors hold no routing to read: a MoE's rows are taken as evenly spread over
    # its experts (the load the planner assumes).
    routing = balanced_counts() if tensors is not None else nullcontext()
    with tensors or nullcontext(), live, routing:
        torch.manual_seed(seed)
        with torch.device(cfg.device):  # built in place: fake tensors cannot be moved
            model = build_model(cfg)  # the GPT, or --model-config's Llama
        vocab = _vocabulary(model)
        parts = Trainable(model, cfg, mesh, side_meshes)
        del model  # a pipeline rank keeps only its stages
        local = (cfg.local_batch, cfg.seq_len // cfg.cp)  # cp: this rank's tokens of each
        setup = live.current
        _create_optimizer_state(parts.optimizer)
        live.reset_peak()  # building the whole model before sharding it is not training
        for _ in range(steps):
            x = torch.randint(0, vocab, local, device=cfg.device)
            y = torch.randint(0, vocab, local, device=cfg.device)
            if pipelined:
                pipeline_step(parts, cfg, x)
            else:
                # One document per row; the loss over every token of the global batch.
                tokens = torch.full((), cfg.batch_size * cfg.seq_len, device=cfg.device)
                parts.stepper.train(StepBatch(x, y, None, None, tokens))
            parts.update()
            del x, y
    return MeasuredMemory(live.peak, setup, time.perf_counter() - start)


def pipeline_step(parts: Trainable, cfg: TrainConfig, inputs: torch.Tensor) -> None:
    """This rank's actions of one step of ``cfg``'s schedule on ``parts``' stages, without
    peers (module docstring): what the rank holds is as in training, what it would
    receive is stated. ValueError for a schedule with split backwards."""
    from plait.pipeline.actions import ActionKind
    from plait.pipeline.grad_sync import StageGradSync
    from plait.pipeline.schedules import add_fsdp_actions, generate, schedule_spec

    name = schedule_spec(cfg.schedule).name
    if name not in DRY_RUN_SCHEDULES:
        raise ValueError(
            f"dry run of --schedule {name}: only schedules with full backwards are dry-run "
            f"({', '.join(DRY_RUN_SCHEDULES)})"
        )
    rank = dist.get_rank(parts.pipeline_group)
    modules = {s.index: s.module for s in parts.stages}
    syncs = {i: s for i, m in modules.items() if (s := StageGradSync(m)).active}
    order = generate(name, cfg.pp, cfg.pp * cfg.stages_per_rank, cfg.microbatches)
    if syncs:  # gathered, freed and reduced where the schedule says, as in training
        order = add_fsdp_actions(order, cfg.max_active_stages or None)
    chunks = inputs.chunk(cfg.microbatches)
    boundary: torch.Tensor | None = None  # the first stage's output: a boundary's shape
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    for each in syncs.values():
        each.begin_step()
    try:
        with loss_context(cfg), forward_context(cfg):
            for a in order[rank]:
                sync: StageGradSync | None = syncs.get(a.stage)
                if a.kind is ActionKind.UNSHARD and sync is not None:
                    sync.unshard()
                    sync.wait_unshard()
                elif a.kind is ActionKind.RESHARD and sync is not None:
                    sync.reshard()
                elif a.kind is ActionKind.REDUCE_GRAD and sync is not None:
                    sync.reduce_grads()
                elif a.kind is ActionKind.FORWARD:
                    assert a.microbatch is not None
                    if a.stage == 0:
                        x = chunks[a.microbatch]
                    else:
                        if boundary is None:
                            raise ValueError("a stage ran before the first: not rank 0")
                        x = torch.empty_like(boundary, requires_grad=True)  # received
                    out = modules[a.stage](x)
                    if a.stage == 0:
                        boundary = out.detach()
                    outputs[(a.stage, a.microbatch)] = out
                elif a.kind is ActionKind.FULL_BACKWARD:
                    assert a.microbatch is not None
                    out = outputs.pop((a.stage, a.microbatch))
                    out.backward(torch.ones_like(out))
                    del out
                    if sync is not None:
                        sync.stash_grads()
    finally:
        for each in syncs.values():
            each.end_step()


def _vocabulary(model: torch.nn.Module) -> int:
    """The token ids ``model`` embeds (its embedding's rows): the batches' ids are below."""
    embedding = getattr(model, "tok_emb", None)
    if not isinstance(embedding, torch.nn.Embedding):
        raise ValueError(f"{type(model).__name__} has no token embedding (tok_emb)")
    return embedding.num_embeddings


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


def replicated_tp(layout: Layout) -> bool:
    """Whether ``layout`` replicates tensor-parallel modules without ``fully_shard``
    (``dp_replicate`` > 1, ``dp_shard x cp`` 1, ``tp`` > 1), which a dry run refuses."""
    return layout.tp > 1 and layout.dp_replicate > 1 and layout.dp_shard * layout.cp == 1


def dry_run(cfg: TrainConfig, world: int, steps: int = 1) -> MeasuredMemory:
    """:func:`step_memory` of rank 0 of a ``world``-rank run of ``cfg``, in this process,
    with a fake process group and fake tensors (module docstring).

    ``cfg`` is resolved for ``world`` (``dp_shard`` 0 takes what the other sizes leave).
    With a pipeline, rank 0 runs its own actions of the schedule (:func:`pipeline_step`).
    Refuses (ValueError) a pipeline with tensor parallelism or split backwards, tensor
    parallelism replicated without ``fully_shard`` (:func:`replicated_tp`), and a process
    that already has a process group.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = resolve(cfg.replace(nproc=world, device="cpu"), world_size=world)
    if cfg.pp > 1 and cfg.tp > 1:
        raise ValueError(
            f"dry run of --pp {cfg.pp} with --tp {cfg.tp}: a pipeline's stage boundaries are "
            "then DTensors, which the dry run does not state; dry-run without --tp"
        )
    if cfg.pp > 1 and schedule_spec(cfg.schedule).name not in DRY_RUN_SCHEDULES:
        raise ValueError(
            f"dry run of --schedule {cfg.schedule}: only schedules with full backwards are "
            f"dry-run ({', '.join(DRY_RUN_SCHEDULES)})"
        )
    if replicated_tp(cfg.layout):
        raise ValueError(
            f"dry run of --dp-replicate {cfg.dp_replicate} with --tp {cfg.tp} and no "
            "fully_shard: replicate's check of the tp mesh reads the mesh's ranks, which fake "
            "tensors do not hold; dry-run with --dp-shard > 1 or without --tp"
        )
    if dist.is_initialized():
        raise ValueError("dry_run needs a process without a process group: it makes a fake one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        return step_memory(cfg, steps, tensors=fake, pipeline_dry_run=True)
    finally:
        dist.destroy_process_group()
