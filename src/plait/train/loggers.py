"""Where rank 0's per-step records go: metrics.jsonl, TensorBoard, Weights & Biases.

Every backend takes the same records (:meth:`Logger.log`): a training step's (``loss``,
``lr``, ``grad_norm``, ``step_time``, ``tokens_per_s``, ``tokens``, ``mfu``, and with
experts ``expert_load`` and ``expert_imbalance``) and a validation's (``val_loss``), each
at its ``step`` (optimizer steps completed; see :mod:`plait.train.metrics`).

* ``metrics.jsonl``: always; every field of every record.
* TensorBoard (``--tensorboard``): event files under ``<run_dir>/tensorboard/``, the scalar
  fields of :data:`SCALARS` under their own names, and the run's configuration as text
  once per session. A resumed session starts its writer with ``purge_step`` = the
  checkpoint's step + 1: TensorBoard's readers then drop what an earlier session wrote
  past the checkpoint (a crash's orphaned steps), so no step appears twice. (The
  checkpoint's own step stays: the resumed session never writes it again.)
* Weights & Biases (``--wandb``): a run of ``--wandb-project`` with the configuration,
  the same scalars, files under ``<run_dir>/wandb/``; ``--wandb-mode offline`` (the
  default) needs no network (``wandb sync`` uploads later). Its id is kept in
  ``<run_dir>/wandb_id``, so a resumed ``plait train`` continues the same W&B run. W&B's
  console capture is off (the progress display owns the terminal) and its own output
  quiet.

The optional packages are imported only when their flag is on; a missing one is a
:class:`~plait.train.config.ConfigError` naming the extra that installs it (checked by
:func:`check_logging` before any worker starts, and again where the logger opens).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import secrets
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from plait.train import extras
from plait.train.config import ConfigError, LogConfig, TrainConfig
from plait.train.extras import missing
from plait.train.metrics import MetricsLog

__all__ = [
    "SCALARS",
    "Logger",
    "Loggers",
    "MetricsLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "check_logging",
    "open_loggers",
    "require",
]

#: The record fields TensorBoard and W&B plot (those a record has).
SCALARS = (
    "loss",
    "val_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "mfu",
    "step_time",
    "expert_imbalance",
    "tokens",
)
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
WANDB_ID_FILE = "wandb_id"

#: flag -> (the module it imports, the pip package, the plait extra that installs it)
_OPTIONAL = {
    "--tensorboard": ("tensorboard", "tensorboard", "train"),
    "--wandb": ("wandb", "wandb", "wandb"),
}


class Logger(Protocol):
    """A destination of rank 0's records."""

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        """Record ``record`` (without ``step``: that is the argument) at ``step``."""

    def close(self) -> None:
        """Flush and release; nothing is logged after."""


def _missing(option: str) -> ConfigError:
    _, package, extra = _OPTIONAL[option]
    return missing(option, package, extra, fix=f"or drop {option}")


def require(option: str) -> ModuleType:
    """Import the package ``option`` (a key of ``_OPTIONAL``) needs, or ConfigError
    naming the extra that installs it."""
    module, _, extra = _OPTIONAL[option]
    module_type: ModuleType = extras.require(module, option, extra, fix=f"or drop {option}")
    return module_type


def check_logging(cfg: LogConfig | TrainConfig) -> None:
    """Refuse, before any worker starts, logging settings that cannot work: a flag whose
    package is missing, a negative ``--peak-flops``."""
    for option, on in (("--tensorboard", cfg.tensorboard), ("--wandb", cfg.wandb)):
        if on and importlib.util.find_spec(_OPTIONAL[option][0]) is None:
            raise _missing(option)
    if cfg.peak_flops < 0:
        raise ConfigError(
            f"--peak-flops {cfg.peak_flops:g}: must be one device's peak FLOP/s (e.g. "
            "989e12), or 0 to look it up or measure it"
        )
    if cfg.wandb and not cfg.wandb_project:
        raise ConfigError("--wandb needs a project: give --wandb-project NAME")


def _scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The :data:`SCALARS` of ``record`` that are numbers (None, e.g. an unknown MFU,
    is left out)."""
    return {
        name: float(record[name])
        for name in SCALARS
        if isinstance(record.get(name), (int, float)) and not isinstance(record[name], bool)
    }


class MetricsLogger:
    """``<run_dir>/metrics.jsonl`` (:class:`~plait.train.metrics.MetricsLog`); ``records``
    holds the whole run's records, a resumed run's earlier ones too."""

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        self._log = MetricsLog(run_dir, resume_step)

    @property
    def records(self) -> list[dict[str, Any]]:
        return self._log.records

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        self._log.write(step=step, **record)

    def close(self) -> None:
        self._log.close()


class TensorBoardLogger:
    """Event files under ``<run_dir>/tensorboard`` (see the module docstring)."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any], resume_step: int | None) -> None:
        require("--tensorboard")
        from torch.utils.tensorboard import SummaryWriter  # needs the package above

        purge = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=purge)
        text = "```json\n" + json.dumps(dict(config), indent=2) + "\n```"
        self._writer.add_text("config", text, global_step=resume_step or 0)

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        for name, value in _scalars(record).items():
            self._writer.add_scalar(name, value, global_step=step)
        # Each record on disk at once, like metrics.jsonl's lines: a crash loses nothing.
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A Weights & Biases run with files under ``<run_dir>/wandb`` (see the module
    docstring), of ``cfg``'s project and mode, recording ``config`` (default: ``cfg``'s
    fields: a TrainConfig's are the whole run's)."""

    def __init__(
        self,
        run_dir: Path,
        cfg: LogConfig | TrainConfig,
        resume: bool,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        wandb = require("--wandb")
        id_file = run_dir / WANDB_ID_FILE
        if resume and id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(4)  # W&B ids: lower-case letters and digits
            id_file.write_text(run_id + "\n")
        (run_dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=cfg.wandb_project,
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),  # W&B writes into its "wandb" folder
            mode=cfg.wandb_mode,
            config=dict(config) if config is not None else dataclasses.asdict(cfg),
            settings=wandb.Settings(console="off", quiet=True),
        )
        self.run_id = run_id

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        scalars = _scalars(record)
        if scalars:
            self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class Loggers:
    """Every backend a run writes to, as one :class:`Logger`; ``metrics`` is the
    metrics.jsonl one (the summary reads its records)."""

    def __init__(self, metrics: MetricsLogger, others: list[Logger]) -> None:
        self.metrics = metrics
        self._all: list[Logger] = [metrics, *others]

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.metrics.records

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        for logger in self._all:
            logger.log(step, record)

    def close(self) -> None:
        """Close every backend, even when one fails (then raise the first failure)."""
        failure: BaseException | None = None
        for logger in self._all:
            try:
                logger.close()
            except Exception as err:  # the others must still close
                failure = failure or err
        if failure is not None:
            raise failure


def open_loggers(cfg: TrainConfig, resume_step: int | None) -> Loggers:
    """The backends ``cfg.logging`` asks for, in ``cfg.run_dir`` (which must exist). A
    resumed session (``resume_step``: its checkpoint's step) keeps the records up to that
    step and continues the same TensorBoard history and W&B run. Takes the whole
    configuration: TensorBoard and W&B record all of it."""
    run_dir, log, config = Path(cfg.run_dir), cfg.logging, cfg.to_dict()
    metrics = MetricsLogger(run_dir, resume_step)
    others: list[Logger] = []
    try:
        if log.tensorboard:
            others.append(TensorBoardLogger(run_dir, config, resume_step))
        if log.wandb:
            others.append(WandbLogger(run_dir, log, resume_step is not None, config))
    except BaseException:
        for logger in [metrics, *others]:
            logger.close()
        raise
    return Loggers(metrics, others)
