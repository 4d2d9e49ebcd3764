"""Training data: documents read from files, tokenized once, packed into rows by step number.

**Sources.** ``--data PATH`` is a file or a directory (every file under it, sorted by
path, hidden files and folders skipped; kinds may mix), its kind told by the extension:

* ``.jsonl`` / ``.json``: one JSON object per line (a ``.json`` file holding one JSON
  array of objects is read too). Each object is a document: its ``--text-field`` (default
  ``text``), a string, or else its ``--messages-field`` (default ``messages``), a chat: a
  list of ``{"role": ..., "content": ...}``. An object with neither is refused, naming
  the file and line.
* ``.parquet``: the same, one row per record (columns of those names; needs pyarrow).
* anything else: text, the whole file one document (UTF-8; invalid bytes replaced).

Without ``--data``, the documents are the Python standard library's own top-level source
files (``Lib/*.py``), one per file: no download needed.

**Tokens.** Every document is tokenized once by ``--tokenizer`` (default: bytes, see
:mod:`plait.train.tokenizer`): a text document is the tokenizer's bos (if it has one), the
text's tokens and its eos (if it has one), every token a target. A chat is rendered with
the chat template (``--chat-template``, else the tokenizer's; the byte tokenizer has a
plain one) and ends with the eos; only its assistant answers are targets. An answer is
told by rendering the conversation before the assistant turn with
``add_generation_prompt=True`` and through that turn: the tokens between are the answer
(the template's own closing of the turn, like ChatML's ``<|im_end|>``, included). Both
renderings must tokenize to prefixes of the whole conversation's tokens, else the chat is
refused (the answer could not be told apart).

**Splits.** Validation is a deterministic ~5% of the documents (at least one, and more
when needed for one row, up to half of them), chosen by a hash of each document's
content: the choice does not depend on the files' order, and duplicated documents fall on
the same side. Validation documents are never trained on. A single document is cut into
pieces (4096 tokens, or 1/20 of it when shorter) and every 20th piece is validation; the
pieces count as documents below.

**Packing.** Per epoch, a split's documents are shuffled by ``(seed, split, epoch)``,
concatenated into one stream, and cut into rows of ``seq_len + 1`` tokens that start
``seq_len`` apart (consecutive rows share one token, so every next-token pair of the
stream is in exactly one row; the tail too short for a row is left out of that epoch):
inputs are ``row[:-1]``, targets ``row[1:]``, :data:`IGNORE` where the target token takes
no loss (a chat's prompt). A target across a document boundary is kept: the last token of
a document, its eos when the tokenizer has one, predicts the first of the next document
(with an eos this teaches how documents begin, which sampling from the eos relies on).
The rows of an epoch are then taken in an order shuffled by ``(seed, split, epoch)`` too,
so a batch mixes rows from all over the corpus instead of neighbours from a few documents
(its loss and gradient vary much less from step to step). Global batch ``step`` takes
rows ``step * batch_size ...`` of the concatenation of epochs in that order (epoch = row
// rows per epoch), so a batch is a pure function of ``(seed, split, step)``:
every rank builds the same global batch and keeps its part, and a resumed run sees exactly
the batches the uninterrupted run would have, mid-epoch too, with no loader state to save.

**Token cache.** Tokenizing is the slow part, so its result (every document's tokens,
which of them are targets, the documents' lengths and the hashes the split ranks them by)
is kept in one file per corpus in the cache directory: ``PLAIT_DATA_CACHE``, default
``~/.cache/plait/data`` (``off``, ``0`` or ``none``: no cache). The file is named by a
fingerprint of the data files (resolved paths, sizes, modification times and their
first and last 64 KiB), the tokenizer (the content of its ``tokenizer.json`` and
``tokenizer_config.json``), the chat template, ``--text-field`` / ``--messages-field``
and :data:`CACHE_VERSION`: changing any of them tokenizes anew. A run whose file is there
neither reads the records nor tokenizes (the file is mapped into memory); the batches are
the same bit for bit. The file is written to a temporary name and renamed, so a reader
never sees half of one; its header holds a hash of its contents, and a file that does not
match (cut short, damaged) is tokenized again and rewritten, with a warning. No pickle: a
JSON header and raw arrays. Old files are not removed: delete the folder to reclaim it.

When a process group is initialised, one rank per machine tokenizes and writes the file
(local rank 0: ``LOCAL_RANK`` under torchrun, else the lowest rank on the host), while
the others wait in a collective on the default group (so under its timeout); every rank
learns whether the writers succeeded, so a failure is an error on every rank, not a hang,
and then the others read the file. A cache directory that cannot be written only costs
the time: each rank then tokenizes for itself.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import socket
import sysconfig
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.train.config import ConfigError, TrainConfig
from plait.train.extras import require
from plait.train.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer, render_chat

__all__ = [
    "CACHE_VERSION",
    "DATA_FILE",
    "IGNORE",
    "Batch",
    "Record",
    "TokenData",
    "cache_dir",
    "data_files",
    "load_data",
    "read_records",
    "record_fingerprint",
    "stdlib_files",
]

IGNORE = -100  # target id that takes no loss (F.cross_entropy's ignore_index default)

PIECE = 4096  # tokens per piece of a single-document corpus
VAL_EVERY = 20  # ~5% validation: 1 document (or piece) in 20
_SPLIT_SEEDS = {"train": 0, "val": 1}
_JSON_KINDS = (".jsonl", ".json")
_PARQUET_KINDS = (".parquet",)
_ENCODE_CHUNK = 1024  # documents a Hugging Face tokenizer encodes per call


@dataclass(frozen=True)
class Batch:
    """Rows of a global batch (or of one part of it)."""

    inputs: torch.Tensor  # (b, T) int64 token ids
    targets: torch.Tensor  # (b, T) int64: next token ids, IGNORE where no loss
    # (b, T) int64: per row, the index (0, 1, 2, ..., non-decreasing) of the document each
    # input token belongs to
    documents: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.inputs.to(device), self.targets.to(device), self.documents.to(device))


# ----------------------------------------------------------------------------------------
# Reading records
# ----------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------
# Tokenizing
# ----------------------------------------------------------------------------------------


@dataclass
class _Doc:
    tokens: torch.Tensor  # (n,) uint8 (bytes) or int32 ids
    # (n,) bool: whether each token takes loss as a target; None: every token does
    trained: torch.Tensor | None
    key: bytes  # 8 bytes: a hash of the content, for the validation split (_key)


def _key(record: Record) -> bytes:
    return hashlib.blake2b(record.key, digest_size=8).digest()


def _encode_texts(tok: Tokenizer, texts: list[str]) -> list[torch.Tensor]:
    """Each text's ids, without bos or eos: bytes (uint8) straight from the buffer, a
    Hugging Face tokenizer's (int32) in batches."""
    if isinstance(tok, ByteTokenizer):
        return [
            torch.frombuffer(bytearray(t.encode("utf-8")), dtype=torch.uint8)
            if t
            else torch.zeros(0, dtype=torch.uint8)
            for t in texts
        ]
    if isinstance(tok, HFTokenizer):
        out: list[torch.Tensor] = []
        for i in range(0, len(texts), _ENCODE_CHUNK):
            ids = tok.encode_batch(texts[i : i + _ENCODE_CHUNK])
            out.extend(torch.tensor(x, dtype=torch.int32) for x in ids)
        return out
    return [torch.tensor(tok.encode(t), dtype=torch.int32) for t in texts]


def _chat(tok: Tokenizer, template: str, record: Record) -> tuple[list[int], list[bool]]:
    """A chat's tokens, and which are targets: its assistant answers."""
    messages = record.messages
    assert messages is not None
    whole = tok.encode(render_chat(template, messages, False, tok))
    trained = [False] * len(whole)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tok.encode(render_chat(template, messages[:turn], True, tok))
        through = tok.encode(render_chat(template, messages[: turn + 1], False, tok))
        start, end = len(before), len(through)
        if start > end or whole[:start] != before or whole[:end] != through:
            raise ConfigError(
                f"--data {record.where}: the chat template's rendering of the conversation "
                f"before assistant turn {turn} (with add_generation_prompt) or through it "
                "does not tokenize to a prefix of the whole conversation's tokens, so the "
                "answer cannot be told apart from the prompt: use a chat template "
                "(--chat-template) whose turns end at a token boundary"
            )
        trained[start:end] = [True] * (end - start)
    return whole, trained


def _tokenize(records: list[Record], tok: Tokenizer, template: str | None) -> list[_Doc]:
    """Every record as a document (empty texts dropped)."""
    texts = [r.text for r in records if r.text is not None]
    encoded = iter(_encode_texts(tok, texts))
    bos = [tok.bos_id] if tok.bos_id is not None else []
    eos = [tok.eos_id] if tok.eos_id is not None else []
    docs = []
    for record in records:
        if record.text is not None:
            body = next(encoded)
            if not len(body):
                continue
            if bos or eos:
                ends = (torch.tensor(x, dtype=body.dtype) for x in (bos, eos))
                body = torch.cat([next(ends), body, next(ends)])
            trained = None
        else:
            if template is None:
                raise ConfigError(
                    f"--data {record.where}: a chat, but the tokenizer {tok.name} has no "
                    "chat_template (tokenizer_config.json): give one with --chat-template"
                )
            ids, mask = _chat(tok, template, record)
            dtype = torch.uint8 if isinstance(tok, ByteTokenizer) else torch.int32
            body = torch.tensor(ids + eos, dtype=dtype)
            trained = torch.tensor(mask + [False] * len(eos), dtype=torch.bool)
        if len(body):  # an empty document would number no token
            docs.append(_Doc(body, trained, _key(record)))
    return docs


# ----------------------------------------------------------------------------------------
# Splitting and packing
# ----------------------------------------------------------------------------------------


class _Split:
    """One split's documents, packed into rows per epoch."""

    def __init__(self, docs: list[_Doc], seq_len: int, seed: int) -> None:
        self.seq_len = seq_len
        self.seed = seed
        self.n_docs = len(docs)
        lengths = [len(d.tokens) for d in docs]
        self.lengths = torch.tensor(lengths, dtype=torch.int64)
        self.starts = torch.cumsum(self.lengths, 0) - self.lengths  # in self.tokens
        self.n_tokens = int(self.lengths.sum())
        self.tokens = torch.cat([d.tokens for d in docs]) if docs else torch.zeros(0)
        self.trained = torch.ones(self.n_tokens, dtype=torch.bool)
        for doc, start, n in zip(docs, self.starts.tolist(), lengths, strict=True):
            if doc.trained is not None:
                self.trained[start : start + n] = doc.trained
        #: Every token takes loss (no chat prompts): a batch's loss tokens are all of them.
        self.all_trained = bool(self.trained.all())
        self.rows_per_epoch = max(0, (self.n_tokens - 1) // seq_len)
        self._epochs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def epoch(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The documents in ``epoch``'s order, where each ends in its stream, and the
        order the epoch's rows are taken in (``k``-th row taken: row ``rows[k]`` of the
        stream)."""
        if epoch not in self._epochs:
            generator = torch.Generator().manual_seed(_mix(self.seed, epoch))
            order = torch.randperm(self.n_docs, generator=generator)
            rows = torch.randperm(self.rows_per_epoch, generator=generator)
            if len(self._epochs) >= 4:  # a batch spans one or two epochs: keep a few
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[epoch] = (order, torch.cumsum(self.lengths[order], 0), rows)
        return self._epochs[epoch]

    def rows(self, rows: torch.Tensor) -> Batch:
        """Rows ``rows`` (global indices over the concatenation of epochs)."""
        t = self.seq_len
        b = len(rows)
        src = torch.empty(b, t + 1, dtype=torch.int64)
        doc = torch.empty(b, t + 1, dtype=torch.int64)
        epochs = rows // self.rows_per_epoch
        for e in epochs.unique().tolist():
            mine = epochs == e
            order, ends, taken = self.epoch(e)
            first = taken[rows[mine] % self.rows_per_epoch] * t
            pos = first[:, None] + torch.arange(t + 1)  # (rows, T + 1) in the epoch's stream
            k = torch.searchsorted(ends, pos, right=True)  # the epoch's k-th document
            begins = ends[k] - self.lengths[order[k]]
            src[mine] = self.starts[order[k]] + pos - begins
            doc[mine] = k
        tokens = self.tokens[src].long()
        targets = tokens[:, 1:].masked_fill(~self.trained[src[:, 1:]], IGNORE)
        return Batch(tokens[:, :-1], targets, doc[:, :-1] - doc[:, :1])


def _split(docs: list[_Doc], seq_len: int) -> tuple[list[_Doc], list[_Doc]]:
    """(training, validation) documents: a single document is cut into pieces first."""
    if len(docs) == 1:
        (doc,) = docs
        n = len(doc.tokens)
        size = PIECE if n >= PIECE * VAL_EVERY else max(1, -(-n // VAL_EVERY))
        mask = doc.trained
        pieces = [
            _Doc(doc.tokens[i : i + size], None if mask is None else mask[i : i + size], b"")
            for i in range(0, n, size)
        ]
        val = [p for i, p in enumerate(pieces) if i % VAL_EVERY == VAL_EVERY - 1]
        train = [p for i, p in enumerate(pieces) if i % VAL_EVERY != VAL_EVERY - 1]
        return train, val
    ranked = sorted(range(len(docs)), key=lambda i: (docs[i].key, i))
    wanted = max(1, round(len(docs) / VAL_EVERY))
    chosen: set[int] = set()
    held = 0
    for i in ranked[: len(docs) // 2]:  # at most half: most of the data is for training
        if len(chosen) >= wanted and held > seq_len:
            break
        chosen.add(i)
        held += len(docs[i].tokens)
    train = [d for i, d in enumerate(docs) if i not in chosen]
    val = [d for i, d in enumerate(docs) if i in chosen]
    return train, val


class TokenData:
    """A corpus, tokenized, split and packed: what :func:`load_data` returns."""

    def __init__(
        self,
        docs: list[_Doc],
        tokenizer: Tokenizer,
        seq_len: int,
        seed: int,
        where: str,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.seq_len = seq_len
        train, val = _split(docs, seq_len)
        self.splits = {
            name: _Split(part, seq_len, seed * 1_000_003 + _SPLIT_SEEDS[name])
            for name, part in (("train", train), ("val", val))
        }
        n_train, n_val = self.splits["train"].n_tokens, self.splits["val"].n_tokens
        unit = "bytes" if isinstance(tokenizer, ByteTokenizer) else "tokens"
        if min(n_train, n_val) <= seq_len:
            total = n_train + n_val
            raise ConfigError(
                f"--data {where}: {len(docs)} document(s), {total:,} {unit} split into "
                f"{n_train:,} for training and {n_val:,} for validation, but one row of "
                f"--seq-len {seq_len} needs {seq_len + 1} in each: give more text (at least "
                f"{VAL_EVERY * (seq_len + 1):,} {unit}) or a smaller --seq-len"
            )
        self.source = (
            f"{where}: {len(docs):,} documents ({tokenizer.name} tokenizer): "
            f"{n_train:,} training / {n_val:,} validation {unit}"
        )
        digest = hashlib.sha256(tokenizer.name.encode())
        for name in ("train", "val"):
            part = self.splits[name]
            digest.update(part.tokens.numpy().tobytes())
            digest.update(part.trained.numpy().tobytes())
            digest.update(part.lengths.numpy().tobytes())
        #: Identifies the packed data (tokens, loss mask, documents, tokenizer path): a
        #: resumed run compares it to warn when the data changed under it.
        self.fingerprint = digest.hexdigest()

    def rows_per_epoch(self, split: str) -> int:
        return self.splits[split].rows_per_epoch

    def loss_tokens(self, split: str, batch_size: int) -> int | None:
        """The loss tokens of every global batch of ``batch_size`` rows of ``split`` when the
        data alone says so (no target is :data:`IGNORE`: all of them), else None (count
        them per batch)."""
        return batch_size * self.seq_len if self.splits[split].all_trained else None

    def batch(self, split: str, step: int, batch_size: int, part: int = 0, parts: int = 1) -> Batch:
        """Part ``part`` of ``parts`` equal contiguous parts of global batch ``step`` of
        ``split`` ("train" or "val"): a pure function of (seed, split, step), so every rank
        slices the same global batch and a resumed run sees exactly the batches the
        uninterrupted run would have (mid-epoch too). Only this part's rows are built."""
        if split not in self.splits:
            raise ValueError(f"split {split!r}: expected 'train' or 'val'")
        if batch_size % parts or not 0 <= part < parts:
            raise ValueError(f"part {part} of {parts} of a batch of {batch_size} rows")
        size = batch_size // parts
        first = step * batch_size + part * size
        rows = torch.arange(first, first + size, dtype=torch.int64)
        return self.splits[split].rows(rows)


def _mix(seed: int, epoch: int) -> int:
    """One 63-bit generator seed from (split seed, epoch), distinct for distinct inputs."""
    return (seed * 2_147_483_647 + epoch) & (2**63 - 1)


def load_data(cfg: TrainConfig, cache: Path | None = None, use_cache: bool = True) -> TokenData:
    """``cfg``'s corpus (``--data``, default the standard library) tokenized by its
    ``--tokenizer``, split and packed for ``--seq-len``; ConfigError for a record that
    cannot be read or a corpus too small for one row per split.

    The tokens come from the token cache in ``cache`` (default :func:`cache_dir`) when it
    holds them, else are tokenized and written there; ``use_cache=False``: no cache. With
    an initialised process group, one rank per machine tokenizes (module docstring)."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    template = tokenizer.chat_template
    if cfg.chat_template:
        try:
            template = Path(cfg.chat_template).read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(
                f"--chat-template {cfg.chat_template}: cannot read it ({err.strerror})"
            ) from err
    files = data_files(cfg.data)
    where = cfg.data or f"the Python standard library ({len(files)} files)"

    def tokenize() -> list[_Doc]:
        records = list(read_records(files, cfg.text_field, cfg.messages_field))
        return _tokenize(records, tokenizer, template)

    folder = (cache if cache is not None else cache_dir()) if use_cache else None
    if folder is None:
        docs = tokenize()
    else:
        fingerprint = _cache_fingerprint(cfg, files, template)
        path = folder / f"{fingerprint[:40]}{_CACHE_SUFFIX}"
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            docs = _shared_docs(path, fingerprint, tokenize)
        else:
            docs = _cached_docs(path, fingerprint, tokenize)
    return TokenData(docs, tokenizer, cfg.seq_len, cfg.seed, where)


# ----------------------------------------------------------------------------------------
# The token cache
# ----------------------------------------------------------------------------------------

#: Changes whenever what tokenizing produces, or the cache file's layout, changes.
CACHE_VERSION = 1
_CACHE_MAGIC = b"PLAITTOK"
_CACHE_SUFFIX = ".tokens"
_PEEK = 1 << 16  # bytes of each data file's start and end in the fingerprint
_ALIGN = 64  # each array starts at a multiple of this many bytes
_OFF = ("", "0", "off", "none", "no", "false")
_DTYPES = {"uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}


def cache_dir() -> Path | None:
    """The token cache's directory: ``PLAIT_DATA_CACHE``, default ``~/.cache/plait/data``;
    None when it says ``off`` (or ``0``, ``none``, empty)."""
    value = os.environ.get("PLAIT_DATA_CACHE")
    if value is None:
        return Path.home() / ".cache" / "plait" / "data"
    if value.strip().lower() in _OFF:
        return None
    return Path(value).expanduser()


def _cache_fingerprint(cfg: TrainConfig, files: list[Path], template: str | None) -> str:
    """Names what tokenizing ``files`` gives: the files (path, size, modification time),
    the tokenizer's files' content, the template, the fields and :data:`CACHE_VERSION`."""
    digest = hashlib.sha256()

    def add(*parts: object) -> None:
        for part in parts:
            data = part if isinstance(part, bytes) else repr(part).encode()
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)

    add(CACHE_VERSION, cfg.text_field, cfg.messages_field, template)
    if cfg.tokenizer:
        tok = Path(cfg.tokenizer)
        tok = tok / "tokenizer.json" if tok.is_dir() else tok
        add("tokenizers", _library_version("tokenizers"))
        for file in (tok, tok.parent / "tokenizer_config.json"):
            add(file.name, file.read_bytes() if file.is_file() else None)
    else:
        add("bytes")
    for file in files:
        stat = file.stat()
        # Modification times tick coarsely (milliseconds): the first and last bytes too
        # tell most rewrites of the same size within one tick.
        with open(file, "rb") as f:
            head = f.read(_PEEK)
            f.seek(max(len(head), stat.st_size - _PEEK))
            tail = f.read(_PEEK)
        add(str(file.resolve()), stat.st_size, stat.st_mtime_ns, head, tail)
    return digest.hexdigest()


def _library_version(name: str) -> str:
    try:
        return str(__import__(name).__version__)
    except (ImportError, AttributeError):
        return ""


class _CacheError(Exception):
    """A cache file of another version or other data, or damaged."""


def _cached_docs(path: Path, fingerprint: str, tokenize: Callable[[], list[_Doc]]) -> list[_Doc]:
    """The documents from the cache file ``path``, else ``tokenize()``'s, written there."""
    try:
        return _read_cache(path, fingerprint)
    except (FileNotFoundError, NotADirectoryError):
        pass  # not cached yet (a cache folder that cannot be made warns when written)
    except OSError as err:
        warnings.warn(f"token cache {path}: cannot read it ({err}); tokenizing", stacklevel=3)
    except _CacheError as err:
        warnings.warn(f"token cache {path}: {err}; tokenizing again", stacklevel=3)
    docs = tokenize()
    _write_cache(path, fingerprint, docs)
    return docs


def _shared_docs(path: Path, fingerprint: str, tokenize: Callable[[], list[_Doc]]) -> list[_Doc]:
    """:func:`_cached_docs` on one rank per machine while the others wait, then read."""
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    writer = _local_leader(device)
    docs: list[_Doc] | None = None
    failure: BaseException | None = None
    if writer:
        try:
            docs = _cached_docs(path, fingerprint, tokenize)
        except Exception as err:  # every rank must hear of it before it is raised
            failure = err
    ok = torch.tensor([0 if failure else 1], dtype=torch.int64, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # the barrier: waits for every writer
    if failure is not None:
        raise failure
    if not int(ok.item()):
        raise ConfigError(
            "--data: tokenizing the corpus failed on another rank (the one that tokenizes "
            "for its machine): see its error"
        )
    if docs is None:
        # Written by this machine's writer; should its file be missing here after all
        # (a cache directory it could not write), this rank tokenizes on its own.
        docs = _cached_docs(path, fingerprint, tokenize)
    return docs


def _local_leader(device: torch.device) -> bool:
    """Whether this rank tokenizes for its machine: ``LOCAL_RANK`` 0 when set, else the
    lowest rank on this host (host names gathered from every rank)."""
    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.strip().isdigit():
        return int(local) == 0
    host = hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest()
    mine = torch.tensor([int.from_bytes(host, "little")], dtype=torch.int64, device=device)
    hosts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(hosts, mine)
    first = next(r for r, h in enumerate(hosts) if int(h.item()) == int(mine.item()))
    return first == dist.get_rank()


def _write_cache(path: Path, fingerprint: str, docs: list[_Doc]) -> None:
    """``docs`` to ``path``: a header (magic, length, JSON) and the arrays, written to a
    temporary file then renamed; a failure to write is a warning (the run goes on)."""
    dtype = docs[0].tokens.dtype if docs else torch.uint8
    arrays = {
        "tokens": torch.cat([d.tokens for d in docs]) if docs else torch.zeros(0, dtype=dtype),
        "trained": torch.cat(
            [
                d.trained if d.trained is not None else torch.ones(len(d.tokens), dtype=torch.bool)
                for d in docs
            ]
        )
        if docs
        else torch.zeros(0, dtype=torch.bool),
        "lengths": torch.tensor([len(d.tokens) for d in docs], dtype=torch.int64),
        "masked": torch.tensor([d.trained is not None for d in docs], dtype=torch.bool),
        "keys": torch.frombuffer(bytearray(b"".join(d.key for d in docs)), dtype=torch.uint8)
        if docs
        else torch.zeros(0, dtype=torch.uint8),
    }
    blobs: list[bytes] = []
    layout: dict[str, Any] = {}
    offset = 0
    digest = hashlib.blake2b(digest_size=32)
    for name, array in arrays.items():
        blob = array.contiguous().numpy().tobytes()
        pad = -offset % _ALIGN
        blobs.append(b"\0" * pad + blob)
        offset += pad
        layout[name] = {
            "dtype": str(array.dtype).removeprefix("torch."),
            "offset": offset,
            "count": array.numel(),
        }
        offset += len(blob)
        digest.update(blob)
    header = json.dumps(
        {
            "version": CACHE_VERSION,
            "fingerprint": fingerprint,
            "arrays": layout,
            "size": offset,
            "digest": digest.hexdigest(),
        }
    ).encode()
    head = _CACHE_MAGIC + len(header).to_bytes(8, "little") + header
    head += b"\0" * (-len(head) % _ALIGN)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from other users' runs
        with os.fdopen(fd, "wb") as out:
            out.write(head)
            for blob in blobs:
                out.write(blob)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        warnings.warn(f"token cache {path}: cannot write it ({err}); not cached", stacklevel=4)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _read_cache(path: Path, fingerprint: str) -> list[_Doc]:
    """The documents of the cache file ``path`` (mapped into memory, copy on write);
    FileNotFoundError when there is none, :class:`_CacheError` when it is not whole."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            raise _CacheError("the file is empty")
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        if mapped[: len(_CACHE_MAGIC)] != _CACHE_MAGIC:
            raise _CacheError("not a token cache file")
        n = int.from_bytes(mapped[len(_CACHE_MAGIC) : len(_CACHE_MAGIC) + 8], "little")
        begin = len(_CACHE_MAGIC) + 8
        try:
            header = json.loads(bytes(mapped[begin : begin + n]))
        except ValueError as err:
            raise _CacheError(f"its header is not JSON ({err})") from err
        if not isinstance(header, dict) or header.get("version") != CACHE_VERSION:
            raise _CacheError("of another version")
        if header.get("fingerprint") != fingerprint:
            raise _CacheError("of other data")
        base = begin + n + (-(begin + n) % _ALIGN)
        if size != base + int(header["size"]):
            raise _CacheError(f"{size} bytes, expected {base + int(header['size'])}")
        digest = hashlib.blake2b(digest_size=32)
        arrays: dict[str, torch.Tensor] = {}
        for name, spec in header["arrays"].items():
            dtype = _DTYPES[spec["dtype"]]
            count = int(spec["count"])
            start = base + int(spec["offset"])
            width = torch.empty(0, dtype=dtype).element_size()
            digest.update(memoryview(mapped)[start : start + count * width])
            arrays[name] = (
                torch.frombuffer(mapped, dtype=dtype, count=count, offset=start)
                if count
                else torch.zeros(0, dtype=dtype)
            )
        if digest.hexdigest() != header.get("digest"):
            raise _CacheError("its contents do not match their hash (damaged)")
    except (KeyError, TypeError, ValueError) as err:
        raise _CacheError(f"its header is malformed ({err!r})") from err
    lengths = arrays["lengths"].tolist()
    keys = arrays["keys"].numpy().tobytes()
    tokens = arrays["tokens"].split(lengths)
    trained = arrays["trained"].split(lengths)
    masked = arrays["masked"].tolist()
    if len(keys) != 8 * len(lengths) or len(masked) != len(lengths):
        raise _CacheError("its arrays do not agree")
    return [
        _Doc(t, m if has else None, keys[8 * i : 8 * i + 8])
        for i, (t, m, has) in enumerate(zip(tokens, trained, masked, strict=True))
    ]


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
