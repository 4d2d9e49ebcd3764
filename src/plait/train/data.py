"""Training text as bytes, split into train and validation, sampled by step number.

The built-in corpus needs no download: the Python standard library's own top-level source
files (``Lib/*.py``), read as bytes in sorted order. ``--data PATH`` reads a file, or every
file under a directory (sorted, hidden files skipped), instead. Tokens are bytes
(vocabulary 256), so any text works without a tokenizer.

The split is by 4 KiB blocks of the concatenated stream: every 20th block is validation,
the rest training, so both halves sample every part of the corpus.

A batch is a pure function of ``(seed, split, step)``: window offsets are drawn from a
generator seeded with those, never from global RNG state. So every rank draws the same
global batch and takes its own slice, and a resumed run sees exactly the batches the
uninterrupted run would have: the data position is the step number.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from plait.train.config import ConfigError

__all__ = ["Corpus", "global_batch", "load_corpus", "local_slice", "stdlib_files"]

BLOCK = 4096
VAL_EVERY = 20  # every 20th block is validation: 5% of the corpus
_SEPARATOR = b"\n\n"
_SPLIT_SEEDS = {"train": 0, "val": 1}


@dataclass(frozen=True)
class Corpus:
    """Byte tokens (uint8) of both splits and a one-line description of where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    source: str

    def split(self, name: str) -> torch.Tensor:
        return self.train if name == "train" else self.val


def stdlib_files() -> list[Path]:
    """The standard library's top-level ``*.py`` files, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"))


def _user_files(path: str) -> list[Path]:
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


def load_corpus(data: str, seq_len: int) -> Corpus:
    """Read ``data`` ("" for the standard library) and split it; refuse a too-small corpus."""
    files = _user_files(data) if data else stdlib_files()
    stream = _SEPARATOR.join(f.read_bytes() for f in files)
    tokens = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
    blocks = torch.arange(len(tokens)) // BLOCK
    is_val = blocks % VAL_EVERY == VAL_EVERY - 1
    train, val = tokens[~is_val], tokens[is_val]
    where = data or f"the Python standard library ({len(files)} files)"
    needed = seq_len + 1
    if len(train) <= needed or len(val) <= needed:
        raise ConfigError(
            f"--data {where}: {len(tokens)} bytes split into {len(train)} for training and "
            f"{len(val)} for validation, but a sequence needs {needed}: give more text "
            f"(at least {VAL_EVERY * BLOCK + needed} bytes) or a smaller --seq-len"
        )
    return Corpus(train, val, f"{where}: {len(train):,} training / {len(val):,} validation bytes")


def global_batch(
    corpus: Corpus,
    split: str,
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    part: int = 0,
    parts: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, both ``(batch_size // parts, seq_len)`` int64: part
    ``part`` of ``parts`` equal contiguous parts of the global batch of ``step`` (by
    default the whole of it). Only that part's windows are read."""
    tokens = corpus.split(split)
    generator = torch.Generator().manual_seed(_mix(seed, _SPLIT_SEEDS[split], step))
    starts = torch.randint(len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    mine = local_slice(starts, part, parts).tolist()
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in mine]).long()
    return windows[:, :-1], windows[:, 1:]  # (B, T), (B, T)


def local_slice(t: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """Part ``index`` of ``parts`` equal contiguous parts of ``t`` along the batch dim."""
    size = t.shape[0] // parts
    return t[index * size : (index + 1) * size]


def _mix(seed: int, split: int, step: int) -> int:
    """One 63-bit generator seed from (seed, split, step), distinct for distinct inputs."""
    return ((seed * 1_000_003 + split) * 2_147_483_647 + step) & (2**63 - 1)
