"""The training loop of one process: build, (resume,) train, validate, checkpoint, report.

Runs inside an initialised process group (or alone, for one process). Every rank runs the
same steps; rank 0 alone writes the run directory's metrics, configuration, summary and
loss curve, and draws the progress bar.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.train.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint
from plait.train.config import ConfigError, TrainConfig
from plait.train.data import Corpus, global_batch, load_corpus, local_slice
from plait.train.metrics import MetricsLog, gather_peak_memory
from plait.train.model import GPT, GPTConfig
from plait.train.optimizer import build_optimizer, clip_grad_norm, lr_at, set_lr
from plait.train.parallelize import Stage, build_mesh, mesh_coordinate, parallelize
from plait.train.progress import Progress
from plait.train.report import plot_loss_curve, summary_table
from plait.train.step import Stepper, global_mean, make_stepper

__all__ = ["TrainResult", "train"]

CONFIG_FILE = "config.json"


@dataclass
class TrainResult:
    """What a session did, as every rank saw it (losses are of the global batch)."""

    run_dir: Path
    start_step: int
    losses: list[float] = field(default_factory=list)  # one per step of this session
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> loss


def model_config(cfg: TrainConfig) -> GPTConfig:
    return GPTConfig(
        seq_len=cfg.seq_len,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        d_model=cfg.d_model,
        dropout=cfg.dropout,
    )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class _Session:
    """The pieces one training session works with, built in the recipe's order."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.corpus: Corpus = load_corpus(cfg.data, cfg.seq_len)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        model = GPT(model_config(cfg)).to(cfg.device)
        self.mesh = build_mesh(cfg)
        self.stages: list[Stage] = parallelize(model, cfg, self.mesh)
        self.modules = [s.module for s in self.stages]
        self.params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = build_optimizer(self.modules, cfg)
        self.stepper: Stepper = make_stepper(self.stages, cfg, self.mesh)
        self.pipeline_group = self.mesh["pp"].get_group() if self.mesh and cfg.pp > 1 else None
        dp_shard = mesh_coordinate(self.mesh, "dp_shard")
        self.dp_rank = mesh_coordinate(self.mesh, "dp_replicate") * cfg.dp_shard + dp_shard
        # Dropout draws differ per rank (each rank sees different data), yet are reproducible.
        torch.manual_seed(cfg.seed + 1 + _rank())

    def batch(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of global batch ``index`` of ``split``, on the device."""
        cfg = self.cfg
        x, y = global_batch(self.corpus, split, cfg.seed, index, cfg.batch_size, cfg.seq_len)
        x, y = local_slice(x, self.dp_rank, cfg.dp), local_slice(y, self.dp_rank, cfg.dp)
        return x.to(cfg.device), y.to(cfg.device)

    def train_step(self, step: int) -> tuple[float, float]:
        """Optimizer step ``step`` (0-based); returns (global loss, gradient norm)."""
        set_lr(self.optimizer, lr_at(step, self.cfg))
        local = self.stepper.train(*self.batch("train", step))
        norm = clip_grad_norm(self.params, self.cfg, self.pipeline_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return global_mean(local, self.cfg), norm

    def validate(self) -> float:
        losses = [
            self.stepper.evaluate(*self.batch("val", i)) for i in range(self.cfg.eval_batches)
        ]
        return sum(global_mean(loss, self.cfg) for loss in losses) / len(losses)

    def save(self, step: int) -> Path:
        return save_checkpoint(
            self.run_dir, step, self.modules, self.optimizer, self.cfg.to_dict(), self.cfg.keep
        )

    def resume(self) -> int:
        path = latest_checkpoint(self.run_dir)
        if path is None:
            raise ConfigError(f"--resume: {self.run_dir} holds no complete checkpoint")
        return load_checkpoint(path, self.modules, self.optimizer, self.cfg.device).step


class _Reporter:
    """Rank 0's side of a session: metrics file, progress bar, summary; silent elsewhere."""

    def __init__(self, cfg: TrainConfig, start: int, enabled: bool) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.session_steps: list[dict[str, Any]] = []
        if not enabled:
            return
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        self.log = MetricsLog(run_dir, start if cfg.resume else None)
        self.progress = Progress(cfg.steps, start)
        self.progress.note(f"training steps {start + 1}..{cfg.steps}; run directory {run_dir}")

    def step(self, record: dict[str, Any]) -> None:
        self.session_steps.append(record)
        if self.enabled:
            self.log.write(**record)
            self.progress.update(record["step"], record["loss"], record["tokens_per_s"])

    def validation(self, step: int, loss: float) -> None:
        if self.enabled:
            self.log.write(step=step, val_loss=loss)
            self.progress.note(f"step {step}: validation loss {loss:.4f}")

    def checkpoint(self, step: int, path: Path) -> None:
        if self.enabled:
            self.progress.note(f"step {step}: checkpoint {path}")

    def finish(self) -> None:
        memory = gather_peak_memory(self.cfg.device)  # collective: every rank takes part
        if not self.enabled:
            return
        self.progress.close()
        self.log.close()
        run_dir = self.cfg.run_dir
        print(summary_table(self.cfg, self.log.records, self.session_steps, memory, run_dir))
        print(plot_loss_curve(self.log.records, run_dir))
        print(f"sample from it: plait sample --run-dir {run_dir}", flush=True)


def train(cfg: TrainConfig) -> TrainResult:
    """Train for ``cfg.steps`` steps (from the latest checkpoint with ``cfg.resume``)."""
    session = _Session(cfg)
    start = session.resume() if cfg.resume else 0
    result = TrainResult(session.run_dir, start)
    report = _Reporter(cfg, start, enabled=_rank() == 0)

    def validate(step: int) -> None:
        result.val_losses[step] = session.validate()
        report.validation(step, result.val_losses[step])

    if start == 0:
        validate(0)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    for step in range(start + 1, cfg.steps + 1):
        began = time.perf_counter()
        loss, norm = session.train_step(step - 1)
        elapsed = time.perf_counter() - began
        result.losses.append(loss)
        report.step(
            {
                "step": step,
                "loss": loss,
                "lr": lr_at(step - 1, cfg),
                "grad_norm": norm,
                "step_time": elapsed,
                "tokens_per_s": tokens_per_step / elapsed,
                "tokens": tokens_per_step * step,
            }
        )
        if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
            validate(step)
        if step == cfg.steps or (cfg.ckpt_every and step % cfg.ckpt_every == 0):
            report.checkpoint(step, session.save(step))
    report.finish()
    return result
