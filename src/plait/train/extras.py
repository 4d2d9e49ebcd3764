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

__all__ = ["missing", "require"]


def missing(what: str, package: str, extra: str = "train", fix: str = "") -> ConfigError:
    """The error for ``what`` (a flag, a feature) without ``package``: ``{what} needs the
    {package} package, which is not installed: pip install 'plait[{extra}]'`` (and
    ``({fix})`` when given)."""
    also = f" ({fix})" if fix else ""
    return ConfigError(
        f"{what} needs the {package} package, which is not installed: "
        f"pip install 'plait[{extra}]'{also}"
    )


def require(module: str, what: str, extra: str = "train", fix: str = "") -> Any:
    """``module`` (e.g. ``"pyarrow.parquet"``), imported; or :func:`missing`'s error for
    its package."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise missing(what, module.split(".")[0], extra, fix) from err
