"""A small text dataset made locally, in the layout torchtitan's ``c4_test`` loader reads.

torchtitan loads ``c4_test`` with ``datasets.load_dataset(path, split="train")`` and reads
each row's ``"text"``. We write one JSON-lines file of documents cut from the Python
standard library's own sources: no download, and the same bytes on every run of one
Python installation (both implementations read the same file).
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

DOCUMENTS = 400
DOCUMENT_CHARS = 2000


def build(folder: Path) -> Path:
    """Write ``folder/train.jsonl`` unless it is there; return its path."""
    out = folder / "train.jsonl"
    if out.exists():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rows: list[str] = []
    for source in sorted(stdlib.glob("*.py")):
        text = source.read_text(encoding="utf-8", errors="replace")
        for start in range(0, len(text), DOCUMENT_CHARS):
            rows.append(json.dumps({"text": text[start : start + DOCUMENT_CHARS]}))
            if len(rows) == DOCUMENTS:
                break
        if len(rows) == DOCUMENTS:
            break
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(rows) + "\n")
    tmp.replace(out)
    return out
