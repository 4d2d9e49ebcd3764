"""Typed reads of a ``config.json``'s values, and the one error a configuration this package
cannot build from raises (:class:`LlamaConfigError`, its message naming the key).

An explicit ``null`` reads as the key's default, as transformers reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["LlamaConfigError", "read_bool", "read_float", "read_int"]


class LlamaConfigError(ValueError):
    """A ``config.json`` this module cannot build a model from; the message names the key."""


def read_int(values: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """The integer at ``key`` (a bool is not one), ``default`` when absent or null."""
    value = values.get(key, default)
    if value is None:  # an explicit null: the default
        value = default
    if not isinstance(value, int) or isinstance(value, bool):
        raise LlamaConfigError(f"{key} must be an integer, got {value!r}")
    return value


def read_bool(values: Mapping[str, Any], key: str, default: bool) -> bool:
    """The boolean at ``key``, ``default`` when absent or null."""
    value = values.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, bool):
        raise LlamaConfigError(f"{key} must be true or false, got {value!r}")
    return value


def read_float(values: Mapping[str, Any], key: str, default: float) -> float:
    """The number at ``key`` as a float (a bool is not one), ``default`` when absent or
    null."""
    value = values.get(key, default)
    if value is None:  # an explicit null: the default
        value = default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise LlamaConfigError(f"{key} must be a number, got {value!r}")
    return float(value)
