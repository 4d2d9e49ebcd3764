"""``plait plan --batch FILE``: many evaluations in one process, for sweeps.

``FILE`` holds a JSON list of objects (or one object per line, JSON lines). Each object is
a set of ``plait plan`` flags by name, with underscores or dashes (``{"gpus": 64, "tp": 4,
"pp": 4, "cp": 2}``, ``{"preset": "llama3-8b", "seq-len": 4096}``), given on top of the
command line's flags: each entry is what that command line with those flags added would
print with ``--json``. A flag that takes no value (``"dry-run"`` excepted: refused) is
given as ``true``; ``false`` leaves it off. The output is one JSON list, an object per
entry in the file's order: ``{"flags": the entry, "layouts": [...]}`` (``--top``'s best,
each as ``--json`` gives it) or ``{"flags": the entry, "error": "..."}`` for an entry that
cannot be planned (the message ``plait plan`` would print), so one bad entry does not lose
the others. The process pays its imports once, and the planner's caches (schedules, shapes)
stay warm from one entry to the next.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["BatchError", "entry_argv", "read_entries", "run_batch"]

#: Flags an entry may not give: they do not evaluate a layout (or print otherwise).
_REFUSED = ("batch", "dry_run", "measure_cpu", "json")


class BatchError(ValueError):
    """A ``--batch`` file that cannot be read; the message names the file and the entry."""


def read_entries(path: str | Path) -> list[dict[str, Any]]:
    """The entries of ``path``: a JSON list of objects, or one object per line."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise BatchError(f"--batch {path}: cannot read it ({err.strerror})") from err
    try:
        loaded = json.loads(text)
        entries = loaded if isinstance(loaded, list) else [loaded]
    except json.JSONDecodeError:
        try:
            entries = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as err:
            raise BatchError(f"--batch {path}: neither a JSON list nor JSON lines ({err})") from err
    for number, entry in enumerate(entries, start=1):
        if not isinstance(entry, dict):
            raise BatchError(
                f"--batch {path}: entry {number} is {type(entry).__name__}, not an object of "
                'flags such as {"gpus": 64, "tp": 4}'
            )
    return entries


def entry_argv(entry: dict[str, Any], known: Sequence[str]) -> list[str]:
    """The command-line words of ``entry``'s flags; ValueError for a flag that ``plait
    plan`` does not have (``known``: its destinations), one ``--batch`` refuses, or a value
    that is not a number, a string or a boolean."""
    argv: list[str] = []
    for key, value in entry.items():
        name = key.lstrip("-").replace("-", "_")
        if name not in known:
            raise ValueError(f"unknown flag {key!r}")
        if name in _REFUSED:
            raise ValueError(f"--{key.lstrip('-')} is not taken by a --batch entry")
        option = "--" + name.replace("_", "-")
        if value is True:
            argv.append(option)
        elif value is False or value is None:
            continue
        elif isinstance(value, (int, float, str)):
            argv += [option, str(value)]
        else:
            raise ValueError(f"{key!r}: {value!r} is not a number, a string or a boolean")
    return argv


def run_batch(
    parser: argparse.ArgumentParser,
    base: Sequence[str],
    known: Sequence[str],
    entries: list[dict[str, Any]],
    evaluate: Callable[[argparse.Namespace], list[dict[str, Any]]],
) -> list[dict[str, Any]]:
    """Each entry's result (module docstring): ``parser`` parses ``base`` (the command
    line) with the entry's flags added after it (so they win), ``known`` names the flags
    an entry may give, and ``evaluate`` turns the parsed flags into the layouts' JSON
    objects or raises ValueError."""
    results: list[dict[str, Any]] = []
    for entry in entries:
        try:
            args = _parse(parser, [*base, *entry_argv(entry, known)])
            results.append({"flags": entry, "layouts": evaluate(args)})
        except ValueError as err:
            results.append({"flags": entry, "error": str(err)})
    return results


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed; ValueError (not argparse's exit) for words it refuses."""
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as err:  # argparse printed why (a bad value, a choice): say it again
        raise ValueError(f"flags {' '.join(argv)} refused (see the message above)") from err
    if extra:
        raise ValueError(f"unrecognised {' '.join(extra)}")
    return args
