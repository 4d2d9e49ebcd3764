"""Rank 0's side of a training session: the loggers (metrics.jsonl, TensorBoard, W&B), the
progress display, and the summary at the end; every other rank only joins its
collectives.

Besides the steps and validations, it records the session's events
(:mod:`plait.train.metrics`): each checkpoint (how long training waited for it, the bytes
of an asynchronous one's staging copy), each asynchronous checkpoint's finished write, and
a restart after a failed worker (which steps are redone: :mod:`plait.train.restart`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plait.train.checkpointer import SaveReport, WriteReport
from plait.train.config import TrainConfig
from plait.train.flops import mfu, total_peak
from plait.train.loggers import open_loggers
from plait.train.metrics import gather_peak_memory, gather_per_rank
from plait.train.presets import RUN_FILE as MODEL_CONFIG_FILE
from plait.train.progress import Progress
from plait.train.report import plot_loss_curve, summary_table
from plait.train.resolve import model_config_bytes
from plait.train.restart import redone_steps, restart_record

__all__ = ["CONFIG_FILE", "Reporter"]

CONFIG_FILE = "config.json"


class Reporter:
    """Rank 0's records and display of a session that starts after step ``start``
    (``enabled``: this is rank 0; elsewhere silent). ``restart``: the elastic agent's
    restart count (0: the first attempt); ``flops_per_token``: the model's, for MFU. Each
    training record gains ``mfu``."""

    def __init__(
        self,
        cfg: TrainConfig,
        start: int,
        enabled: bool,
        *,
        restart: int = 0,
        flops_per_token: float,
    ) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.session_steps: list[dict[str, Any]] = []
        # Every rank takes part (on CPU the processes benchmark their shared cores together).
        self.peak = total_peak(cfg.device, cfg.mp, cfg.peak_flops)
        self.flops_per_token = flops_per_token
        if not enabled:
            return
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        # What the failed attempt did past the checkpoint: read before the log drops it.
        restart_row = restart_record(run_dir, start, restart) if restart else None
        (run_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        if cfg.model_config:  # the config.json it trains (a preset's too): its model_hash
            (run_dir / MODEL_CONFIG_FILE).write_bytes(model_config_bytes(cfg.model_config))
        # A restart continues the loggers like a --resume, from step 0 if it had no checkpoint.
        self.log = open_loggers(cfg, start if cfg.resume or restart else None)
        self.progress = Progress(cfg.steps, start)
        if restart_row is not None:
            self.log.log(start, {k: v for k, v in restart_row.items() if k != "step"})
            redone = redone_steps(restart_row["redone"])
            again = f"; {redone} redone" if redone else ""
            self.progress.note(
                f"restart {restart} of {cfg.max_restarts} (--max-restarts) after a failed "
                f"worker: continuing from step {start}{again}"
            )
        last = f"{cfg.stop_after} (--stop-after) of {cfg.steps}" if cfg.stop_after else cfg.steps
        self.progress.note(f"training steps {start + 1}..{last}; run directory {run_dir}")
        self.progress.note(
            f"MFU: {self.flops_per_token:.3g} model FLOPs per token over a peak of "
            f"{self.peak.flops:.3g} FLOP/s ({self.peak.source})"
        )

    def step(self, record: dict[str, Any]) -> None:
        if self.enabled:
            utilisation = mfu(record["tokens_per_s"], self.flops_per_token, self.peak.flops)
            record = {**record, "mfu": utilisation}
            self.session_steps.append(record)
            self.log.log(record["step"], {k: v for k, v in record.items() if k != "step"})
            step, loss, tokens_per_s = record["step"], record["loss"], record["tokens_per_s"]
            self.progress.update(step, loss, tokens_per_s, utilisation)

    def validation(self, step: int, loss: float) -> None:
        if self.enabled:
            self.log.log(step, {"val_loss": loss})
            self.progress.note(f"step {step}: validation loss {loss:.4f}")

    def checkpoint(self, saved: SaveReport, written: list[WriteReport]) -> None:
        """A checkpoint saved at ``saved.step`` (an asynchronous one: being written), after
        the previous asynchronous write ``written`` finished."""
        self.written(saved.step, written)
        if self.enabled:
            row = saved.record()
            self.log.log(saved.step, {k: v for k, v in row.items() if k != "step"})
            if saved.snapshot:  # as often as every step: the summary counts them
                return
            how = "writing in the background" if saved.background else "written"
            self.progress.note(f"step {saved.step}: checkpoint {saved.path} ({how})")

    def written(self, step: int, written: list[WriteReport]) -> None:
        """Asynchronous writes found finished at step ``step``."""
        if not self.enabled:
            return
        for done in written:
            event = "snapshot_written" if done.snapshot else "checkpoint_written"
            row = {"event": event, "checkpoint": done.path.name}
            self.log.log(step, {**row, "write_s": done.write_s})

    def stopped(self, step: int) -> None:
        if self.enabled:
            self.progress.note(
                f"stopped after step {step} of {self.cfg.steps} (--stop-after); continue with: "
                f"plait train --run-dir {self.cfg.run_dir} --resume"
            )

    def finish(self, staged_bytes: int) -> None:
        """The summary; ``staged_bytes``: this rank's staging copy (collective: every
        rank gives its own)."""
        memory = gather_peak_memory(self.cfg.device)  # collective: every rank takes part
        staged = gather_per_rank(staged_bytes, "staging bytes") if self.cfg.async_checkpoint else []
        if not self.enabled:
            return
        self.progress.close()
        if self.log.records:  # what the planner's --calibrate fits memory to
            kind = "allocated" if self.cfg.device == "cuda" else "rss"
            self.log.log(self.log.records[-1]["step"], {"peak_memory": memory, "memory_kind": kind})
        self.log.close()
        run_dir = self.cfg.run_dir
        mfu_of = (self.flops_per_token, self.peak)
        table = summary_table(
            self.cfg,
            self.log.records,
            self.session_steps,
            memory,
            run_dir,
            mfu_of=mfu_of,
            staged_bytes=staged,
        )
        print(table)
        print(plot_loss_curve(self.log.records, run_dir))
        print(f"sample from it: plait sample --run-dir {run_dir}", flush=True)
