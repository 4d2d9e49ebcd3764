"""Optional packages of ``plait train``, imported only when a feature needs them.

``pip install 'plait[train]'`` installs them (tokenizers, safetensors, pyarrow, jinja2,
tensorboard, rich, matplotlib); ``'plait[wandb]'`` adds Weights & Biases. A missing one is
a :class:`~plait.train.config.ConfigError` naming the feature and the command that
installs it, raised before any worker starts where the configuration says it is needed.
"""

from __future__ import annotations

import importlib
from typing import Any

from plait.train.config import ConfigError

__all__ = ["require"]


def require(module: str, what: str, extra: str = "train") -> Any:
    """``module`` (e.g. ``"pyarrow.parquet"``), imported; or ConfigError: ``{what} needs
    the '<package>' package: pip install 'plait[<extra>]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.split(".")[0]
        raise ConfigError(
            f"{what} needs the {package!r} package: pip install 'plait[{extra}]'"
        ) from err
