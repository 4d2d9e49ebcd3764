"""The run directory's record of the data it trains on, so a resumed run can tell whether
the data or the tokenizer changed under it.

:func:`record_fingerprint` writes :data:`DATA_FILE` (the packed data's fingerprint and
one line describing it) and, when resuming, first compares it with the one recorded: a
changed fingerprint means the resumed run's batches differ from the uninterrupted run's,
which is worth a warning but not a refusal (training on new data is a choice).
"""

from __future__ import annotations

import json
from pathlib import Path

from plait.train.token_data import TokenData

__all__ = ["DATA_FILE", "record_fingerprint"]

#: The run directory's record of its data (:func:`record_fingerprint`).
DATA_FILE = "data.json"


def record_fingerprint(run_dir: Path, data: TokenData, resume: bool) -> str | None:
    """Write ``data``'s fingerprint and description to ``run_dir``'s :data:`DATA_FILE`;
    when resuming, first compare with the one recorded: a warning to show when the data or
    the tokenizer changed (the batches then differ from the uninterrupted run's), else None."""
    path = run_dir / DATA_FILE
    note = None
    if resume and path.is_file():
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            saved = {}
        if saved.get("fingerprint") == data.fingerprint:
            return None
        note = (
            f"the data or the tokenizer changed since the run began (then: "
            f"{saved.get('source', 'unknown')}; now: {data.source}): the resumed run trains "
            "on other batches than the uninterrupted run would have"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"fingerprint": data.fingerprint, "source": data.source}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return note
