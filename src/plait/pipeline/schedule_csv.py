"""Schedules as CSV files, in torch's layout: one row per pipeline rank, one action per cell.

Cells hold the text form of an action (``0F3``, ``1SEND_B2``, ``0UNSHARD``); rows are ranks
0, 1, ... in order, so a rank without actions is an empty row. Files written by torch's
``_dump_csv`` read back too: empty cells (torch's ``None`` gaps) are skipped, and torch's
``(0F3;7B2)OVERLAP_F_B`` cell becomes its two actions in order, ``0F3`` then ``7B2``: plait
keeps DualPipeV's overlapped pairs as consecutive F and B actions (see
:func:`~plait.pipeline.schedules.dualpipe_v`), which torch's runtime also runs one after the
other. :func:`parse_pair` reads such a cell as the :class:`~plait.pipeline.actions.OverlappedPair`
it is, and :func:`load_csv_cells` gives a file's cells as text, for a reader that keeps the
pairs (:mod:`~plait.pipeline.ordering`).
"""

from __future__ import annotations

import csv
import io
import os
import re

from plait.pipeline.actions import Action, OverlappedPair, Schedule, parse_action

__all__ = [
    "dump_csv",
    "format_csv",
    "load_csv",
    "load_csv_cells",
    "parse_cell",
    "parse_csv",
    "parse_pair",
]

_OVERLAP_RE = re.compile(r"\((.*)\)OVERLAP_F_B")


def parse_cell(text: str) -> list[Action]:
    """The actions of one CSV cell: none for an empty cell, two for torch's overlapped pair
    ``(<F>;<B>)OVERLAP_F_B``, else one. Raises ValueError on anything else."""
    text = text.strip()
    if not text:
        return []
    overlap = _OVERLAP_RE.fullmatch(text)
    if overlap is None:
        return [parse_action(text)]
    parts = [parse_action(t) for t in overlap[1].split(";") if t.strip()]
    if not parts:
        raise ValueError(f"Invalid action {text!r}: an OVERLAP_F_B cell with no actions")
    return parts


def parse_pair(text: str) -> OverlappedPair | None:
    """The overlapped pair a cell ``(<F>;<B>)OVERLAP_F_B`` holds; None for any other cell.
    Raises ValueError for an OVERLAP_F_B cell that is not one F and one B (or I)."""
    actions = parse_cell(text) if _OVERLAP_RE.fullmatch(text.strip()) else []
    if not actions:
        return None
    if len(actions) != 2:
        raise ValueError(f"Invalid action {text!r}: an OVERLAP_F_B pair has two actions")
    return OverlappedPair(*actions)


def parse_csv(text: str) -> Schedule:
    """Read CSV text (row r: rank r's actions) into a schedule; ValueError naming the row
    and cell of a bad action."""
    schedule: Schedule = {}
    for rank, row in enumerate(csv.reader(io.StringIO(text))):
        schedule[rank] = []
        for col, cell in enumerate(row):
            try:
                schedule[rank] += parse_cell(cell)
            except ValueError as err:
                raise ValueError(f"CSV row {rank} (rank {rank}), cell {col}: {err}") from None
    return schedule


def format_csv(schedule: Schedule) -> str:
    """CSV text of ``schedule``: row r holds rank r's actions (ranks must be 0..n-1)."""
    if sorted(schedule) != list(range(len(schedule))):
        raise ValueError(f"format_csv needs ranks 0..n-1, got {sorted(schedule)}")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in range(len(schedule)):
        writer.writerow([str(a) for a in schedule[rank]])
    return out.getvalue()


def load_csv(filename: str | os.PathLike[str]) -> Schedule:
    """:func:`parse_csv` of a file."""
    with open(filename, newline="") as f:
        return parse_csv(f.read())


def load_csv_cells(filename: str | os.PathLike[str]) -> dict[int, list[str]]:
    """A CSV file's cells as text, row r (rank r) in entry r (for :func:`parse_cell` and
    :func:`parse_pair`)."""
    with open(filename, newline="") as f:
        return dict(enumerate(csv.reader(f)))


def dump_csv(schedule: Schedule, filename: str | os.PathLike[str]) -> None:
    """Write :func:`format_csv` of ``schedule`` to a file."""
    with open(filename, "w", newline="") as f:
        f.write(format_csv(schedule))
