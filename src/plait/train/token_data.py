"""Tokenized documents split into training and validation, packed into rows by step.

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

**Memory.** A split reads its documents where they are: documents from the token cache are
views of one memory-mapped array (:mod:`plait.train.token_cache`), which every worker on a
machine shares through the page cache, so no worker copies the corpus (a 10B-token corpus
would otherwise take 40 GB per worker). Only documents that are not views of one array (a
run without the cache) are concatenated. The loss mask takes memory only where some
document has one (chats).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from plait.train.config import ConfigError
from plait.train.documents import Document
from plait.train.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["IGNORE", "Batch", "TokenData"]

IGNORE = -100  # target id that takes no loss (F.cross_entropy's ignore_index default)

PIECE = 4096  # tokens per piece of a single-document corpus
VAL_EVERY = 20  # ~5% validation: 1 document (or piece) in 20
_SPLIT_SEEDS = {"train": 0, "val": 1}


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


class _Split:
    """One split's documents, packed into rows per epoch."""

    def __init__(self, docs: list[Document], seq_len: int, seed: int) -> None:
        self.seq_len = seq_len
        self.seed = seed
        self.n_docs = len(docs)
        lengths = [len(d.tokens) for d in docs]
        self.lengths = torch.tensor(lengths, dtype=torch.int64)
        self.n_tokens = int(self.lengths.sum())
        #: The tokens the documents are read from, and where each document starts in them:
        #: the one array they are views of (the token cache's, shared), else their
        #: concatenation (module docstring, "Memory").
        self.tokens, self.starts = _stream(docs)
        #: Per token of :attr:`tokens`, whether it takes loss as a target; None when every
        #: token does (no chat prompts), as is then every target of a batch.
        self.trained: torch.Tensor | None = None
        if any(doc.trained is not None for doc in docs):
            self.trained = torch.ones(len(self.tokens), dtype=torch.bool)
            for doc, start, n in zip(docs, self.starts.tolist(), lengths, strict=True):
                if doc.trained is not None:
                    self.trained[start : start + n] = doc.trained
        # Tokens of other documents (of the shared array) stay True: only this split's
        # masks can make it False.
        self.all_trained = self.trained is None or bool(self.trained.all())
        self.rows_per_epoch = max(0, (self.n_tokens - 1) // seq_len)
        self._epochs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def document(self, i: int, of: torch.Tensor | None = None) -> torch.Tensor:
        """Document ``i``'s tokens (a view), or its part of ``of`` (indexed like
        :attr:`tokens`: :attr:`trained`)."""
        start = int(self.starts[i])
        return (self.tokens if of is None else of)[start : start + int(self.lengths[i])]

    def hash_into(self, digest: Any) -> None:
        """Feed ``digest`` the split's tokens, loss mask (one byte per token, 1 where
        trained) and document lengths, each in document order: the bytes of their
        concatenation, read document by document (nothing concatenated)."""
        for i in range(self.n_docs):
            digest.update(self.document(i).numpy())
        if self.trained is not None:
            for i in range(self.n_docs):
                digest.update(self.document(i, self.trained).numpy())
        else:  # every token trained: as many ones as tokens
            for left in range(self.n_tokens, 0, -_ONES_CHUNK):
                digest.update(_ONES[: min(left, _ONES_CHUNK)])
        digest.update(self.lengths.numpy())

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
        targets = tokens[:, 1:]
        if self.trained is not None:
            targets = targets.masked_fill(~self.trained[src[:, 1:]], IGNORE)
        return Batch(tokens[:, :-1], targets, doc[:, :-1] - doc[:, :1])


_ONES_CHUNK = 1 << 20
_ONES = b"\x01" * _ONES_CHUNK


def _stream(docs: list[Document]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, starts)``: the 1-D array every document's tokens are a contiguous view of,
    and each one's offset in it, where there is one (no copy); else the documents
    concatenated and their offsets there."""
    views = [d.tokens for d in docs if len(d.tokens)]
    if views and all(
        t.dim() == 1
        and t.is_contiguous()
        and t.dtype == views[0].dtype
        and t.untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()
        for t in views
    ):
        first = views[0]
        base = torch.empty(0, dtype=first.dtype).set_(first.untyped_storage())
        starts = [d.tokens.storage_offset() if len(d.tokens) else 0 for d in docs]
        return base, torch.tensor(starts, dtype=torch.int64)
    lengths = torch.tensor([len(d.tokens) for d in docs], dtype=torch.int64)
    tokens = torch.cat([d.tokens for d in docs]) if docs else torch.zeros(0, dtype=torch.int32)
    return tokens, torch.cumsum(lengths, 0) - lengths


def _split(docs: list[Document], seq_len: int) -> tuple[list[Document], list[Document]]:
    """(training, validation) documents: a single document is cut into pieces first."""
    if len(docs) == 1:
        (doc,) = docs
        n = len(doc.tokens)
        size = PIECE if n >= PIECE * VAL_EVERY else max(1, -(-n // VAL_EVERY))
        mask = doc.trained
        pieces = [
            Document(doc.tokens[i : i + size], None if mask is None else mask[i : i + size], b"")
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
    """A corpus, tokenized, split and packed: what :func:`plait.train.data.load_data` returns."""

    def __init__(
        self,
        docs: list[Document],
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
            self.splits[name].hash_into(digest)
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
