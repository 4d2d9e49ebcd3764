"""Training data: documents read from files, tokenized once, packed into rows by step number.

:func:`load_data` is the entry: it turns the data settings (a
:class:`~plait.train.config.DataConfig`, a TrainConfig's ``corpus``) into the
:class:`TokenData` that ``plait train`` draws its batches from, through four steps, each
a module that states its own contract:

* :mod:`plait.train.sources`: ``--data``'s files (text, JSON lines, Parquet; default the
  Python standard library) read as records, texts or chats;
* :mod:`plait.train.documents`: every record tokenized once by ``--tokenizer``, a chat's
  assistant answers the only targets;
* :mod:`plait.train.token_cache`: that tokenization kept in one file per corpus
  (``PLAIT_DATA_CACHE``), and with a process group, done by one rank per machine;
* :mod:`plait.train.token_data`: the documents split into training and validation and
  packed into rows, so that a batch is a pure function of ``(seed, split, step)``.

:mod:`plait.train.data_record` keeps the run directory's record of its data
(:func:`record_fingerprint`). The names of those modules that callers use are re-exported
here, where they were defined before the split.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from plait.train.config import ConfigError, DataConfig, TrainConfig
from plait.train.data_record import DATA_FILE, record_fingerprint
from plait.train.documents import Document, tokenize_records
from plait.train.sources import Record, data_files, read_records, stdlib_files
from plait.train.token_cache import (
    CACHE_VERSION,
    cache_dir,
    cache_file,
    cache_fingerprint,
    cached_docs,
    shared_docs,
)
from plait.train.token_data import IGNORE, Batch, TokenData
from plait.train.tokenizer import load_tokenizer

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

# load_data calls the tokenizing step through this module's global, so that a test can
# replace it here to count how often a corpus is tokenized (cache hits tokenize nothing).
_tokenize = tokenize_records


def load_data(
    cfg: DataConfig | TrainConfig, cache: Path | None = None, use_cache: bool = True
) -> TokenData:
    """``cfg``'s corpus (``--data``, default the standard library) tokenized by its
    ``--tokenizer``, split (by ``--seed``) and packed for ``--seq-len``; ConfigError for a
    record that cannot be read or a corpus too small for one row per split. ``cfg``: the
    data group (``TrainConfig.corpus``), or the whole configuration.

    The tokens come from the token cache in ``cache`` (default :func:`cache_dir`) when it
    holds them, else are tokenized and written there; ``use_cache=False``: no cache. With
    an initialised process group, one rank per machine tokenizes
    (:mod:`plait.train.token_cache`)."""
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

    def tokenize() -> list[Document]:
        records = list(read_records(files, cfg.text_field, cfg.messages_field))
        return _tokenize(records, tokenizer, template)

    folder = (cache if cache is not None else cache_dir()) if use_cache else None
    if folder is None:
        docs = tokenize()
    else:
        fingerprint = cache_fingerprint(cfg, files, template)
        path = cache_file(folder, fingerprint)
        # Called from here, not through a helper: the cache's warnings point at
        # load_data's caller by their stack level.
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            docs = shared_docs(path, fingerprint, tokenize)
        else:
            docs = cached_docs(path, fingerprint, tokenize)
    return TokenData(docs, tokenizer, cfg.seq_len, cfg.seed, where)
