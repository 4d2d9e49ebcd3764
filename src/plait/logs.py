"""``TORCH_LOGS`` for plait: the setting torch users already type turns on plait's loggers.

torch sets its own loggers from the ``TORCH_LOGS`` environment variable, a comma-separated
list of names, each optionally prefixed ``+`` (DEBUG) or ``-`` (ERROR; no prefix: INFO):
``TORCH_LOGS="+fsdp"`` prints ``fully_shard``'s hook lines. plait logs under
``plait.<api>`` (``logging.getLogger(__name__)``), so code moved over from torch would
print nothing under the same setting. At import, plait reads the variable too
(:func:`apply_torch_logs`) and sets the loggers torch's names stand for
(:data:`TORCH_NAMES`):

* ``fsdp``: ``plait.fsdp`` and ``plait.replicate`` (every unshard, reduction and hook at
  DEBUG, with the unit's name: the lines of :func:`plait.hooks.traced`);
* ``ddp``: ``plait.replicate``;
* ``pp``: ``plait.pipeline`` (schedules, actions, point-to-point);
* ``distributed``: ``plait``, everything.

Names torch has and plait has nothing for are left to torch. Each logger set this way gets
one handler writing to stderr in torch's shape (``[rank0]:D... name] message``) and stops
propagating, as torch does for its own; a logger configured by the program itself later
(``logging.getLogger("plait.fsdp").setLevel(...)``) overrides the variable.
"""

from __future__ import annotations

import logging
import os

__all__ = ["TORCH_NAMES", "apply_torch_logs"]

TORCH_NAMES: dict[str, tuple[str, ...]] = {
    "fsdp": ("plait.fsdp", "plait.replicate"),
    "ddp": ("plait.replicate",),
    "pp": ("plait.pipeline",),
    "distributed": ("plait",),
}
"""``TORCH_LOGS`` names plait answers to, and the plait loggers each one sets."""

_LEVELS = {"+": logging.DEBUG, "-": logging.ERROR}


class _RankFormatter(logging.Formatter):
    """``[rank<r>]:<L><time> <name>] <message>``: the rank from torchrun's ``RANK``."""

    def format(self, record: logging.LogRecord) -> str:
        rank = os.environ.get("RANK")
        prefix = f"[rank{rank}]:" if rank is not None else ""
        stamp = self.formatTime(record, "%m%d %H:%M:%S")
        return f"{prefix}{record.levelname[0]}{stamp} {record.name}] {record.getMessage()}"


def apply_torch_logs(setting: str | None = None) -> dict[str, int]:
    """Set plait's loggers from ``setting`` (default: the ``TORCH_LOGS`` environment
    variable) as torch sets its own; returns the level given to each plait logger.
    Unknown names and settings torch alone understands (``output_code``, ``all``'s
    artifacts) are ignored: torch reports those itself."""
    setting = os.environ.get("TORCH_LOGS", "") if setting is None else setting
    levels: dict[str, int] = {}
    for token in (t.strip() for t in setting.split(",")):
        level = _LEVELS.get(token[:1], logging.INFO)
        for name in TORCH_NAMES.get(token.lstrip("+-"), ()):
            levels[name] = level
    for name, level in levels.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not any(getattr(h, "plait_torch_logs", False) for h in logger.handlers):
            handler = logging.StreamHandler()
            handler.setFormatter(_RankFormatter())
            handler.plait_torch_logs = True  # type: ignore[attr-defined]
            logger.addHandler(handler)
        logger.propagate = False
    return levels
