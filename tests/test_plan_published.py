"""``benchmarks.plan_published``: the published-runs table of the README.

Its rows carry the figures of ``shared/reference/published_runs.md`` (checked against the
file where this checkout can see it), its predictions are ``plait.plan.evaluate``'s for
those layouts, the calibration row reproduces its run, and the README holds the table the
script prints now. Single process, seconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.plan_published import (
    DEVICE,
    PUBLISHED,
    README_END,
    README_START,
    format_table,
    published_table,
    update_readme,
)
from plait.plan import evaluate, preset
from plait.plan.calibration import CALIBRATION_RUN

ROOT = Path(__file__).resolve().parent.parent
GIB = 2.0**30


def _reference() -> Path | None:
    """The shared reference file, beside or inside the checkout (None where absent)."""
    for base in (ROOT, ROOT.parent):
        path = base / "shared" / "reference" / "published_runs.md"
        if path.is_file():
            return path
    return None


def _table_lines(text: str) -> dict[int, str]:
    """The torchtitan table's rows by their table number (``| 1 | 8B | ...``)."""
    rows = {}
    for line in text.splitlines():
        if m := re.match(r"\|\s*(\d+)\s*\|", line):
            rows[int(m.group(1))] = line
    return rows


def test_rows_carry_the_reference_figures() -> None:
    path = _reference()
    if path is None:
        pytest.skip("shared/reference/published_runs.md is not in this checkout")
    lines = _table_lines(path.read_text())
    for p in PUBLISHED:
        table = int(p.run.split()[0].removeprefix("T"))
        line = lines[table]
        # tokens/s and memory exactly as published, e.g. "5,762 (82.4)"
        assert f"{p.tokens_per_s:,.0f} ({p.memory_gib:.1f})" in line, p.run
        cells = [c.strip() for c in line.split("|")]
        assert cells[2] == p.model.removeprefix("llama3-").upper(), p.run
        assert int(cells[3]) == p.layout.world, p.run
        local = p.work.global_batch // p.layout.dp
        assert cells[5].split(" / ")[0] == str(local), p.run
        if " / " in cells[5]:
            assert int(cells[5].split(" / ")[1]) == p.work.global_batch, p.run
        assert cells[6] == p.layout.ac, p.run


def test_predictions_are_evaluates() -> None:
    rows = published_table()
    assert [r.published for r in rows] == list(PUBLISHED)
    for r in rows:
        p = r.published
        got = evaluate(preset(p.model), p.layout, p.work, DEVICE)
        assert r.tokens_per_s == got.timing.tokens_per_s_per_device
        assert r.memory_gib == got.memory.total / GIB
        assert r.fits == got.fits
    assert DEVICE.memory == 96 * GIB  # the published hosts' H100s, not the 80 GiB preset


def test_calibration_row_reproduces_its_run() -> None:
    first = published_table()[0]
    p = first.published
    assert (p.model, p.layout, p.work) == (
        CALIBRATION_RUN.model,
        CALIBRATION_RUN.layout,
        CALIBRATION_RUN.work,
    )
    assert p.tokens_per_s == CALIBRATION_RUN.tokens_per_s_per_device
    assert abs(first.tokens_diff) < 1.0


def test_readme_holds_the_current_table() -> None:
    text = (ROOT / "README.md").read_text()
    start, end = text.index(README_START), text.index(README_END)
    assert text[start + len(README_START) : end].strip() == format_table(published_table()), (
        "README.md's published-runs table is stale: run "
        "`.venv/bin/python -m benchmarks.plan_published --update-readme`"
    )


def test_update_readme_replaces_only_the_block(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text(f"# a\n\n{README_START}\nold\n{README_END}\n\n## b\n")
    assert update_readme(path, "| new |")
    assert path.read_text() == f"# a\n\n{README_START}\n| new |\n{README_END}\n\n## b\n"
    assert not update_readme(path, "| new |")
    (tmp_path / "bare.md").write_text("# nothing\n")
    with pytest.raises(ValueError, match="plan-published"):
        update_readme(tmp_path / "bare.md", "x")
