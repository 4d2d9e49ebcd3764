"""``plait tokenizer``: the command over the tokenizer library.

It reads ``--data`` the way ``plait train`` does (:mod:`plait.train.sources`) and trains a
byte-level BPE on it (:func:`plait.train.tokenizer.train_bpe`). It stands above both:
neither the data nor the tokenizer modules import it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from plait.train.config import ConfigError
from plait.train.sources import data_files, read_records
from plait.train.tokenizer import train_bpe

__all__ = ["tokenizer_command"]


def tokenizer_command(
    action: str, data: str, vocab: int, out: str, text_field: str, messages_field: str
) -> str:
    """``plait tokenizer train``: train :func:`train_bpe` on ``data``'s records (texts,
    and the content of every chat message); a line saying what was written."""
    if action != "train":
        raise ConfigError(f"plait tokenizer {action}: unknown; the action is: train")

    def texts() -> Iterator[str]:
        for record in read_records(data_files(data), text_field, messages_field):
            if record.text is not None:
                yield record.text
            else:
                assert record.messages is not None
                yield from (m["content"] for m in record.messages)

    tok = train_bpe(texts(), vocab, out)
    config = Path(out).parent / "tokenizer_config.json"
    return f"plait tokenizer: wrote {out} ({tok.vocab_size} ids) and {config}"
