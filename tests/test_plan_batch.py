"""``plait plan --batch FILE``: each entry evaluates as the command line with its flags added
would with ``--json``, in one process; an entry that cannot be planned reports its error
without losing the others; a file that cannot be read is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.plan.cli import main

BASE = ["--preset", "llama3-8b", "--gpus", "64", "--seq-len", "4096", "--top", "2"]


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> object:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_each_entry_equals_its_own_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = [{"tp": 2}, {"gpus": 128, "pp": 2, "ac": "full"}, {"seq-len": 8192, "top": 1}]
    batch = tmp_path / "sweep.json"
    batch.write_text(json.dumps(entries))
    got = _json(capsys, [*BASE, "--batch", str(batch)])
    assert isinstance(got, list) and [r["flags"] for r in got] == entries
    singles = [
        [*BASE, "--tp", "2"],
        [*BASE, "--gpus", "128", "--pp", "2", "--ac", "full"],
        [*BASE, "--seq-len", "8192", "--top", "1"],
    ]
    for result, argv in zip(got, singles, strict=True):
        assert result["layouts"] == _json(capsys, [*argv, "--json"])
    assert len(got[2]["layouts"]) == 1 and len(got[0]["layouts"]) == 2


def test_bad_entries_report_their_error_and_the_rest_still_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    batch = tmp_path / "sweep.jsonl"  # JSON lines
    lines = [{"tp": 3}, {"bogus": 1}, {"dry-run": True}, {"tp": [2]}, {"pp": 2}]
    batch.write_text("\n".join(json.dumps(e) for e in lines) + "\n")
    got = _json(capsys, [*BASE, "--batch", str(batch)])
    assert isinstance(got, list)
    errors = [r.get("error", "") for r in got]
    assert "--tp 3 does not divide --gpus 64" in errors[0]
    assert errors[1] == "unknown flag 'bogus'"
    assert "--dry-run is not taken by a --batch entry" in errors[2]
    assert "is not a number, a string or a boolean" in errors[3]
    assert errors[4] == "" and got[4]["layouts"][0]["layout"]["pp"] == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "cannot read it"),
        ("[1, 2]", "entry 1 is int, not an object of flags"),
        ("{not json", "neither a JSON list nor JSON lines"),
    ],
)
def test_unreadable_batch_files_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None, message: str
) -> None:
    batch = tmp_path / "sweep.json"
    if text is not None:
        batch.write_text(text)
    assert main([*BASE, "--batch", str(batch)]) == 2
    err = capsys.readouterr().err
    assert f"--batch {batch}" in err and message in err
