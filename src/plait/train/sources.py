"""Where the training documents come from: ``--data``'s files read as records (:class:`Record`).

``--data PATH`` is a file or a directory (every file under it, sorted by path, hidden
files and folders skipped; kinds may mix), its kind told by the extension:

* ``.jsonl`` / ``.json``: one JSON object per line (a ``.json`` file holding one JSON
  array of objects is read too). Each object is a document: its ``--text-field`` (default
  ``text``), a string, or else its ``--messages-field`` (default ``messages``), a chat: a
  list of ``{"role": ..., "content": ...}``. An object with neither is refused, naming
  the file and line.
* ``.parquet``: the same, one row per record (columns of those names; needs pyarrow).
* anything else: text, the whole file one document (UTF-8; invalid bytes replaced).

Without ``--data``, the documents are the Python standard library's own top-level source
files (``Lib/*.py``), one per file: no download needed.

Every refusal is a :class:`~plait.train.config.ConfigError` naming the file (and the line
or row) and how to fix it. Nothing here tokenizes: see :mod:`plait.train.documents`.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.train.config import ConfigError
from plait.train.extras import require

__all__ = ["Record", "data_files", "read_records", "stdlib_files"]

_JSON_KINDS = (".jsonl", ".json")
_PARQUET_KINDS = (".parquet",)


@dataclass(frozen=True)
class Record:
    """One document as read: a text, or a chat's messages (exactly one is set)."""

    where: str  # "file", "file:line" or "file: row N", for messages
    text: str | None = None
    messages: list[dict[str, Any]] | None = None

    @property
    def key(self) -> bytes:
        """The content, for the validation split's hash."""
        if self.text is not None:
            return self.text.encode("utf-8", errors="surrogatepass")
        return json.dumps(self.messages, sort_keys=True).encode()


def stdlib_files() -> list[Path]:
    """The standard library's top-level ``*.py`` files, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"))


def data_files(path: str) -> list[Path]:
    """``--data``'s files: the file ``path``, or every file under the directory ``path``
    (sorted, hidden files and folders skipped); ``""``: :func:`stdlib_files`."""
    if not path:
        return stdlib_files()
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ConfigError(f"--data {path}: no such file or directory")
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    if not files:
        raise ConfigError(f"--data {path}: the directory holds no files")
    return files


def read_records(
    files: list[Path], text_field: str = "text", messages_field: str = "messages"
) -> Iterator[Record]:
    """Every record of ``files``, in order (see the module's docstring for the kinds)."""
    for file in files:
        suffix = file.suffix.lower()
        if suffix in _JSON_KINDS:
            yield from _json_records(file, text_field, messages_field)
        elif suffix in _PARQUET_KINDS:
            yield from _parquet_records(file, text_field, messages_field)
        else:
            yield Record(str(file), text=file.read_bytes().decode("utf-8", errors="replace"))


def _record(obj: Any, where: str, text_field: str, messages_field: str) -> Record:
    if not isinstance(obj, dict):
        raise ConfigError(f"--data {where}: a record must be a JSON object, got {_kind(obj)}")
    text = obj.get(text_field)
    if text is not None:
        if not isinstance(text, str):
            raise ConfigError(
                f"--data {where}: the {text_field!r} field must be a string, got {_kind(text)}"
            )
        return Record(where, text=text)
    messages = obj.get(messages_field)
    if messages is not None:
        return Record(where, messages=_check_messages(messages, where, messages_field))
    raise ConfigError(
        f"--data {where}: the record has neither a {text_field!r} field (a text) nor a "
        f"{messages_field!r} field (a chat); its keys: {', '.join(map(str, obj)) or 'none'}. "
        "Name the fields with --text-field / --messages-field"
    )


def _check_messages(messages: Any, where: str, field: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(
            f"--data {where}: the {field!r} field must be a non-empty list of "
            f'{{"role": ..., "content": ...}}, got {_kind(messages)}'
        )
    for i, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ConfigError(
                f"--data {where}: message {i} of {field!r} must be an object with string "
                f"'role' and 'content', got {message!r:.80}"
            )
    return messages


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _json_records(file: Path, text_field: str, messages_field: str) -> Iterator[Record]:
    content = file.read_text(encoding="utf-8", errors="replace")
    if content.lstrip().startswith("["):  # one JSON array of records
        try:
            items = json.loads(content)
        except ValueError as err:
            raise ConfigError(f"--data {file}: not valid JSON: {err}") from err
        for i, obj in enumerate(items):
            yield _record(obj, f"{file}: item {i}", text_field, messages_field)
        return
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{number}"
        try:
            obj = json.loads(line)
        except ValueError as err:
            raise ConfigError(
                f"--data {where}: not a JSON object ({err}); JSON-lines files hold one "
                "object per line"
            ) from err
        yield _record(obj, where, text_field, messages_field)


def _parquet_records(file: Path, text_field: str, messages_field: str) -> Iterator[Record]:
    pq = require("pyarrow.parquet", f"--data {file}: reading Parquet")
    try:
        table = pq.ParquetFile(str(file))
    except Exception as err:  # pyarrow's own error types
        raise ConfigError(f"--data {file}: not a readable Parquet file: {err}") from err
    columns = [c for c in (text_field, messages_field) if c in table.schema_arrow.names]
    if not columns:
        raise ConfigError(
            f"--data {file}: no column {text_field!r} (a text) or {messages_field!r} (a chat); "
            f"its columns: {', '.join(table.schema_arrow.names)}. Name them with "
            "--text-field / --messages-field"
        )
    row = 0
    for batch in table.iter_batches(columns=columns):
        for obj in batch.to_pylist():
            yield _record(obj, f"{file}: row {row}", text_field, messages_field)
            row += 1
