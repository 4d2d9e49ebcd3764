"""What a rule returns: a :class:`Reason` a layout cannot run, in ``plait train``'s flag
words (:func:`flag`), which the planner's layout flags share.

A rule never raises for a layout it refuses: it returns reasons, none when the layout can
run, and the caller decides what they mean (training refuses with the first, the planner's
search skips the layout).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Reason", "flag"]


def flag(name: str) -> str:
    """The command-line flag of field ``name``: ``dp_shard`` -> ``--dp-shard``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Reason:
    """Why a layout cannot run: ``field``, the one to change (a :class:`Layout` field, or
    ``"batch"`` or ``"world"``), and ``message``, a sentence naming the fix."""

    field: str
    message: str

    def __str__(self) -> str:
        return self.message
