"""The training loop of one process: build, (resume,) train, validate, checkpoint, report.

Runs inside an initialised process group (or alone, for one process). Every rank runs the
same steps; rank 0 alone writes the run directory's metrics, configuration, summary and
loss curve, and draws the progress bar. With divergence checking on (``PLAIT_CHECK_SPMD=1``,
:mod:`plait.spmd`) the ranks compare the collectives they issued after every step.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait import spmd
from plait.experts import expert_load, update_expert_bias
from plait.layout import DP_REPLICATE, DP_SHARD, PP
from plait.mesh import collective_device, host_copy, mesh_coordinate
from plait.train.checkpointer import Checkpointer
from plait.train.checkpointing import CheckpointDamaged, checkpoint_group
from plait.train.compiled import CompileCounters
from plait.train.config import ConfigError, TrainConfig
from plait.train.data import TokenData, load_data, record_fingerprint
from plait.train.faults import FaultInjector
from plait.train.float8 import after_step as float8_scales
from plait.train.flops import flops_per_token
from plait.train.hf import check_init_from, load_hf_checkpoint, parameter_shapes
from plait.train.llama import Llama
from plait.train.materialize import materialize
from plait.train.model import GPT, GPTConfig
from plait.train.optimizer import (
    build_optimizer,
    clip_grad_norm,
    finish_partial_grads,
    lr_at,
    set_lr,
)
from plait.train.parallelize import (
    Model,
    Stage,
    build_expert_mesh,
    build_mesh,
    build_shard_mesh,
    is_tied,
    parallelize,
)
from plait.train.report import imbalance
from plait.train.reporter import CONFIG_FILE, Reporter
from plait.train.resolve import gpt_config, llama_config
from plait.train.restart import agreed_restart_count, loader_of, restarted, resumable
from plait.train.snapshots import snapshot_root
from plait.train.step import Stepper, make_stepper
from plait.train.step_batch import StepBatch, global_loss, global_loss_tensor, step_batch
from plait.train.tied import TiedCopies

__all__ = ["CONFIG_FILE", "TrainResult", "Trainable", "model_settings", "train"]

#: The settings a checkpoint's weights depend on: a checkpoint loads only into a run with
#: the same values (dropout changes no weight, so it may differ).
MODEL_SETTINGS = (
    "seq_len",
    "n_layer",
    "n_head",
    "d_model",
    "experts",
    "top_k",
    "shared_experts",
    "expert_hidden",
    "model_hash",  # of --model-config's file ("": the GPT)
    "vocab_size",  # the tokenizer's: a checkpoint refuses a run with another vocabulary
)

#: Load-balancing settings: they change training, not the shape of the weights.
BALANCE_SETTINGS = ("aux_loss_coeff", "aux_loss_type", "z_loss_coeff", "bias_update_speed")


@dataclass
class TrainResult:
    """What a session did, as every rank saw it (losses are of the global batch)."""

    run_dir: Path
    start_step: int
    losses: list[float] = field(default_factory=list)  # one per step of this session
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> loss


def model_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The values of :data:`MODEL_SETTINGS` in ``cfg``."""
    return {name: getattr(cfg, name) for name in MODEL_SETTINGS}


def model_config(cfg: TrainConfig) -> GPTConfig:
    """The GPT ``cfg`` trains: the shape of :func:`~plait.train.resolve.gpt_config` (the
    one the planner prices), with ``--dropout`` and the load-balancing settings."""
    balance = {name: getattr(cfg, name) for name in BALANCE_SETTINGS}
    return dataclasses.replace(gpt_config(cfg), dropout=cfg.dropout, **balance)


def build_model(cfg: TrainConfig) -> Model:
    """``cfg``'s model, on the default device (``plait train``: the meta device, see
    :mod:`plait.train.materialize`): the Llama of ``--model-config``, else the GPT."""
    if cfg.model_config:
        return Llama(llama_config(cfg), cfg.seq_len)
    return GPT(model_config(cfg))


def model_flops_per_token(cfg: TrainConfig) -> float:
    """Training FLOPs per token of ``cfg``'s model (:func:`plait.train.flops.flops_per_token`:
    PaLM's ``6 N + 12 L H Q T``), counted on a copy built on the meta device: shapes only,
    no memory, no random draws."""
    with torch.device("meta"):
        model = build_model(cfg)
    return flops_per_token(model, cfg.seq_len)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _warn(text: str) -> None:
    """A warning on rank 0's stderr (every rank sees the same, one says it)."""
    if _rank() == 0:
        print(f"plait train: warning: {text}", file=sys.stderr, flush=True)


class Trainable:
    """``plait train``'s recipe applied to ``model`` on this rank: its stages after
    :func:`~plait.train.parallelize.parallelize` (a model built on the meta device then
    :func:`~plait.train.materialize.materialize`-d: this rank's pieces on the device,
    their initial values drawn unless ``draw`` is False, for a checkpoint to fill), their
    parameters, AdamW, the stepper and the pipeline group. Shared by training and by the
    planner's dry runs (:mod:`plait.plan.dryrun`), so both run the same code."""

    def __init__(
        self,
        model: Model,
        cfg: TrainConfig,
        mesh: DeviceMesh | None,
        side_meshes: tuple[DeviceMesh | None, DeviceMesh | None] | None = None,
        *,
        draw: bool = True,
    ) -> None:
        """``side_meshes``: the experts' and the shard mesh, if already built (a dry run
        builds every mesh before its fake tensors: building one needs real ones); by
        default built here (:func:`build_expert_mesh`, :func:`build_shard_mesh`)."""
        self.cfg = cfg
        # The groups the steps read, built once (each property call builds a new one).
        self.optim = cfg.optim
        self.execution = execution = cfg.execution
        #: ``(blocks, experts)`` of a model with MoE blocks (the GPT's ``--experts``, a
        #: Llama's config.json), None for a dense one.
        self.moe_shape = model.moe_shape
        moe = model.moe_shape is not None
        experts, shard = side_meshes or (
            build_expert_mesh(execution, moe),
            build_shard_mesh(execution),
        )
        tied = is_tied(model)  # asked before the pipeline split copies the matrix
        self.stages: list[Stage] = parallelize(model, cfg, mesh, experts, shard)
        materialize(self.stages, execution, cfg.seed if draw else None)
        self.modules = [s.module for s in self.stages]
        self.params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = build_optimizer(self.modules, self.optim)
        self.stepper: Stepper = make_stepper(self.stages, execution, mesh)
        self.pipeline_group = mesh[PP].get_group() if mesh and cfg.pp > 1 else None
        #: A head tied to the embedding, split by the pipeline: its two copies.
        self.tied = (
            TiedCopies(self.stages, execution.layout, self.pipeline_group)
            if tied and self.pipeline_group is not None
            else None
        )
        #: Tokens routed to each expert of each block in the last step, ``moe_shape``
        #: (dense blocks' rows zero): global counts, the same on every rank (None for a
        #: dense model).
        self.expert_load: torch.Tensor | None = None

    def update(self, commit: Callable[[], bool] | None = None) -> torch.Tensor:
        """After a step's backward: complete pending gradient sums, clip, update unless
        ``commit`` (torchft's ``should_commit``, asked after the clip) answers False, drop
        the gradients, and (with experts) read the step's expert load and move the balancing
        biases. Returns the gradient norm before clipping (a 0-d tensor)."""
        finish_partial_grads(self.params)
        duplicates = []
        if self.tied is not None:  # both copies get the tied matrix's whole gradient
            self.tied.sum_grads()
            duplicates = self.tied.duplicates()
        norm = clip_grad_norm(self.params, self.optim, self.pipeline_group, duplicates)
        committed = commit is None or commit()
        if committed:
            self.optimizer.step()
            float8_scales(self.modules, self.execution)  # for the next float8 all-gather
        self.optimizer.zero_grad(set_to_none=True)
        if self.moe_shape is not None:
            self.expert_load = self._gather_expert_load(self.moe_shape)
            for module in self.modules:  # resets the counts for the next step
                update_expert_bias(module, move=committed)
        return norm

    def _gather_expert_load(self, shape: tuple[int, int]) -> torch.Tensor:
        """Every block's expert load, from the stages that hold it (one all-reduce over the
        pipeline ranks, whose stages hold different blocks)."""
        device = self.params[0].device
        load = torch.zeros(shape, dtype=torch.int64, device=device)
        for module in self.modules:
            for name, counts in expert_load(module).items():
                load[int(name.split(".")[1])] = counts  # "blocks.<i>.mlp"
        if self.pipeline_group is not None:
            group = self.pipeline_group
            load = load.to(collective_device(group))
            spmd.record("all_reduce", load, group, "the expert load")
            spmd.wait(dist.all_reduce(load, group=group, async_op=True), "all_reduce of load")
        return load  # on the device: read with the step's loss (_Queued)


class _Queued:
    """A training step queued on the device: its loss and gradient norm (and expert load)
    copied to the host as the step's last work, so that :meth:`read` waits for this step
    only. The loop reads a step after queueing the next one: the host never waits for the
    device between steps, which it would otherwise leave idle while it prepares and
    launches the next step. Read at once on the CPU, where every value is there already
    (and always before a validation or checkpoint, and for a run's first and last step)."""

    def __init__(self, step: int, values: torch.Tensor, load: torch.Tensor | None) -> None:
        self.step = step
        self.began = 0.0  # when the loop queued it (perf_counter)
        self.compile_record: dict[str, int] = {}
        self._done: Any = None
        #: Read after the next step is queued (on a GPU), else at once: on the CPU the
        #: values are there, and a crash loses no step's record.
        self.on_device = values.is_cuda
        if values.is_cuda:
            values = host_copy(values)
            load = None if load is None else host_copy(load)
            self._done = torch.cuda.Event()
            self._done.record()
        self._values, self._load = values, load

    def read(self) -> tuple[float, float, list[Any] | None]:
        """(loss, gradient norm, expert load) of the step: waits for the step to finish."""
        if self._done is not None:
            self._done.synchronize()
        loss, norm = self._values.tolist()
        return loss, norm, None if self._load is None else self._load.tolist()


class _Session:
    """The pieces one training session works with, built in the recipe's order."""

    def __init__(self, cfg: TrainConfig, replica: tuple[int, int] = (0, 1)) -> None:
        """``replica``: (this rank's replica group, the number of groups): each group reads
        its share of every global batch (:mod:`plait.train.replicas`)."""
        self.cfg = cfg
        group, self.groups = replica
        self.run_dir = Path(cfg.run_dir)
        self.data: TokenData = load_data(cfg.corpus)
        if _rank() == 0 and (note := record_fingerprint(self.run_dir, self.data, cfg.resume)):
            _warn(note)
        torch.manual_seed(cfg.seed)  # (initial weights draw from cfg.seed: param_init)
        with torch.device("meta"):  # no rank holds the whole model: Trainable materializes
            model = build_model(cfg)
        # --init-from (not when resuming: the checkpoint holds the weights): checked
        # against the whole model's shapes, taken before the pipeline split.
        init_from = cfg.init_from and not cfg.resume
        if init_from:
            check_init_from(cfg)
            shapes = parameter_shapes(model)
        self.mesh = build_mesh(cfg.execution)
        # No initial values where a checkpoint fills every parameter (train() resumes).
        self.parts = Trainable(model, cfg, self.mesh, draw=not (init_from or cfg.resume))
        self.stages, self.modules = self.parts.stages, self.parts.modules
        if init_from:  # into this rank's shards of the parallelized stages
            load_hf_checkpoint(self.modules, cfg.init_from, expected=shapes)
        self.optimizer, self.stepper = self.parts.optimizer, self.parts.stepper
        dp_shard = mesh_coordinate(self.mesh, DP_SHARD)
        self.dp_rank = mesh_coordinate(self.mesh, DP_REPLICATE) * cfg.dp_shard + dp_shard
        self.dp_rank += group * cfg.dp
        self.checkpoint_group = checkpoint_group(cfg.fault_timeout)
        self.checkpointer = Checkpointer(
            self.run_dir,
            self.modules,
            self.optimizer,
            cfg.to_dict(),
            cfg.keep,
            self.checkpoint_group,
            background=cfg.async_checkpoint,
            snapshots=snapshot_root(self.run_dir) if cfg.snapshot_every else None,
        )
        world = dist.get_world_size() if dist.is_initialized() else 1
        # Test-only (plait.train.faults): ranks counted over every replica group.
        self.faults = FaultInjector(_rank() + group * world)
        self.faults.arm(self.modules[0])
        # Dropout draws differ per data-parallel rank and pipeline stage, yet are
        # reproducible. The tp ranks of one (neighbours: tp is the innermost mesh dimension)
        # draw alike: without sequence parallelism their activations are replicated, and
        # must stay identical after dropout.
        torch.manual_seed(cfg.seed + 1 + _rank() // cfg.tp)

    def batch(self, split: str, index: int) -> StepBatch:
        """This rank's share of global batch ``index`` of ``split``, on the device: its rows'
        documents and positions, cut to its tokens of each row with ``--cp``, and the global
        batch's count of loss tokens (:func:`~plait.train.step.step_batch`: collective
        unless the data knows the count: no masked targets)."""
        cfg = self.cfg
        parts = cfg.dp * self.groups
        rows = self.data.batch(split, index, cfg.batch_size, self.dp_rank, parts)
        known = self.data.loss_tokens(split, cfg.batch_size // self.groups)
        execution = self.parts.execution
        return step_batch(rows.inputs, rows.targets, rows.documents, execution, self.mesh, known)

    def train_step(self, step: int) -> _Queued:
        """Optimizer step ``step`` (0-based), queued on the device; its global loss,
        gradient norm and expert load are read later (:class:`_Queued`)."""
        set_lr(self.optimizer, lr_at(step, self.parts.optim))
        self.faults.step = step + 1
        local = self.stepper.train(self.batch("train", step))
        self.faults.step = 0
        norm = self.parts.update()
        spmd.check("end of a training step")  # free unless divergence checking is on
        loss = global_loss_tensor(local, self.parts.execution.layout)
        values = torch.stack([loss[0], norm.detach().float().to(loss.device)])
        return _Queued(step + 1, values, self.parts.expert_load)

    def step_record(
        self, step: int, loss: float, norm: float, seconds: float, load: list[Any] | None = None
    ) -> dict[str, Any]:
        """Training step ``step``'s metrics record (module docstring of
        :mod:`plait.train.metrics`); its tokens are this session's share of every global
        batch (a replica group's share under ``--replica-groups``); ``load``: its expert
        load, by default the last step's."""
        tokens = self.cfg.batch_size // self.groups * self.cfg.seq_len
        return {
            "step": step,
            "loss": loss,
            "lr": lr_at(step - 1, self.parts.optim),
            "grad_norm": norm,
            "step_time": seconds,
            "tokens_per_s": tokens / seconds,
            "tokens": tokens * step,
            **self.expert_record(load),
        }

    def due(self, step: int, last: int) -> tuple[bool, str]:
        """Whether step ``step`` (of this session's ``last``) is followed by a validation,
        and by a ``"checkpoint"``, a ``"snapshot"`` (not both: the checkpoint) or ``""``."""
        cfg = self.cfg
        validate = step == cfg.steps or bool(cfg.eval_every and step % cfg.eval_every == 0)
        if step == last or (cfg.ckpt_every and step % cfg.ckpt_every == 0):
            return validate, "checkpoint"
        return validate, "snapshot" if cfg.snapshot_every and step % cfg.snapshot_every == 0 else ""

    def expert_record(self, load: list[Any] | None = None) -> dict[str, Any]:
        """A step's expert load (``load``, tokens per expert per block; by default the
        last step's) for its metrics record ({} for a dense model), with the worst
        block's max / mean."""
        if load is None and self.parts.expert_load is not None:
            load = self.parts.expert_load.tolist()
        if load is None:
            return {}
        return {"expert_load": load, "expert_imbalance": imbalance(torch.tensor(load))}

    def validate(self) -> float:
        """The validation loss: token-weighted over the loss tokens of all its batches."""
        # Evaluation mode: no dropout, and experts count no load (it is the training
        # steps' load that balancing acts on and the metrics report).
        for module in self.modules:
            module.eval()
        losses, tokens = [], []
        try:
            for i in range(self.cfg.eval_batches):
                batch = self.batch("val", i)
                losses.append(self.stepper.evaluate(batch))
                tokens.append(batch.tokens)
        finally:
            for module in self.modules:
                module.train()
        counts = torch.stack(tokens).tolist()  # global counts, the same on every rank
        means = global_loss(torch.stack(losses), self.parts.execution.layout)
        return sum(m * n for m, n in zip(means, counts, strict=True)) / sum(counts)

    def resume(self) -> int:
        """Load the newest intact checkpoint or snapshot (warning about each damaged newer
        one); its step. Refuses a checkpoint of another model before loading anything."""
        damaged: list[str] = []
        for path in reversed(resumable(self.run_dir, self.checkpoint_group)):
            try:
                load = loader_of(path, self.run_dir)
                expected = model_settings(self.cfg)
                info = load(
                    path, self.modules, self.optimizer, self.cfg.device,
                    expected=expected, group=self.checkpoint_group,
                )  # fmt: skip
            except CheckpointDamaged as error:
                damaged.append(str(error))
                _warn(f"{error}; falling back to the previous checkpoint")
                continue
            if damaged:
                _warn(f"resuming from {path} (step {info.step}), the newest intact checkpoint")
            return info.step
        found = f": {'; '.join(damaged)}" if damaged else ""
        raise ConfigError(f"--resume: {self.run_dir} holds no intact checkpoint{found}")


def _compile_record(before: CompileCounters) -> dict[str, int]:
    """What dynamo did since ``before``, for a step's metrics record."""
    done = CompileCounters.read().since(before)
    return {"compiled_graphs": done.graphs, "graph_breaks": done.graph_breaks}


def _fault_timeout_from_now(seconds: float) -> None:
    """The first step is done: from now on a collective of the default process group
    waits ``--fault-timeout`` for its peers, not the setup's longer timeout (the worker
    joined with ``plait.train.worker.SETUP_TIMEOUT``)."""
    if dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def train(cfg: TrainConfig) -> TrainResult:
    """Train to step ``cfg.steps`` (from the latest intact checkpoint with ``cfg.resume``),
    or only to ``cfg.stop_after`` (then checkpoint and stop; the schedules still span
    ``cfg.steps``, so resuming later continues as if never stopped). A restarted worker
    (:mod:`plait.train.restart`) resumes as with ``cfg.resume``, and records the restart."""
    cfg = restarted(cfg)
    restart = agreed_restart_count()
    session = _Session(cfg)
    start = session.resume() if cfg.resume else 0
    last = cfg.stop_after or cfg.steps
    if cfg.stop_after and cfg.stop_after <= start and not restart:
        raise ConfigError(f"--stop-after {cfg.stop_after}: the run is already at step {start}")
    result = TrainResult(session.run_dir, start)
    report = Reporter(
        cfg,
        start,
        enabled=_rank() == 0,
        restart=restart,
        flops_per_token=model_flops_per_token(cfg),
    )

    def validate(step: int) -> None:
        result.val_losses[step] = session.validate()
        report.validation(step, result.val_losses[step])

    if start == 0:
        validate(0)
    finished = 0.0  # when the last step read was done (perf_counter)

    def record(queued: _Queued) -> None:
        """Read a queued step and report it; its time runs from when the device could
        start it (queued, and the step before it done) to when it was done."""
        nonlocal finished
        loss, norm, load = queued.read()
        now = time.perf_counter()
        seconds, finished = now - max(queued.began, finished), now
        if queued.step == start + 1:
            _fault_timeout_from_now(cfg.fault_timeout)
        result.losses.append(loss)
        row = session.step_record(queued.step, loss, norm, seconds, load)
        report.step({**row, **queued.compile_record})

    held: _Queued | None = None  # a step queued, not read yet
    for step in range(start + 1, last + 1):
        compiled = CompileCounters.read() if cfg.compile else None
        began = time.perf_counter()
        try:
            queued = session.train_step(step - 1)
        except BaseException:
            if held is not None:  # its values were copied before this step was queued
                record(held)
            raise
        queued.began = began
        # With --compile: the graphs this step compiled (recompiles included) and its graph
        # breaks; after the first step both stay 0 (tests/test_train_compile.py).
        queued.compile_record = {} if compiled is None else _compile_record(compiled)
        if held is not None:  # the step before, read while this one runs
            record(held)
        held = queued
        validating, saving = session.due(step, last)
        if not queued.on_device or validating or saving or step in (start + 1, last):
            record(held)  # at once: on the CPU, before what follows it, the first step
            held = None
        if validating:
            validate(step)
        if saving:
            report.checkpoint(*session.checkpointer.save(step, saving == "snapshot"))
    # Never end with a checkpoint still being written (--async-checkpoint).
    report.written(max(start, last), session.checkpointer.close())
    if last < cfg.steps:
        report.stopped(last)
    report.finish(session.checkpointer.staged_bytes)
    return result
