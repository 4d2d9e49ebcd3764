"""The token cache: a corpus tokenized once, kept in one file, read back instead.

Tokenizing is the slow part, so its result (every document's tokens, which of them are
targets, the documents' lengths and the hashes the split ranks them by) is kept in one
file per corpus in the cache directory: ``PLAIT_DATA_CACHE``, default
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
and then the others read the file (:func:`shared_docs`). A cache directory that cannot be
written only costs the time: each rank then tokenizes for itself.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import socket
import tempfile
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.train.config import ConfigError, DataConfig, TrainConfig
from plait.train.documents import Document

__all__ = [
    "CACHE_VERSION",
    "cache_dir",
    "cache_file",
    "cache_fingerprint",
    "cached_docs",
    "shared_docs",
]

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


def cache_file(folder: Path, fingerprint: str) -> Path:
    """The cache file in ``folder`` of the corpus whose :func:`cache_fingerprint` is
    ``fingerprint``."""
    return folder / f"{fingerprint[:40]}{_CACHE_SUFFIX}"


def cache_fingerprint(
    cfg: DataConfig | TrainConfig, files: list[Path], template: str | None
) -> str:
    """Names what tokenizing ``files`` gives: the files (path, size, modification time),
    ``cfg``'s tokenizer (its files' content) and record fields, the template and
    :data:`CACHE_VERSION`."""
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


def cached_docs(
    path: Path, fingerprint: str, tokenize: Callable[[], list[Document]]
) -> list[Document]:
    """The documents from the cache file ``path``, else ``tokenize()``'s, written there.

    Called straight from :func:`plait.train.data.load_data` (or through
    :func:`shared_docs`): the warnings' stack levels point at load_data's caller."""
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


_TOKENIZING = timedelta(hours=4)
"""How long the other ranks wait for their machine's rank that tokenizes the corpus."""


def shared_docs(
    path: Path, fingerprint: str, tokenize: Callable[[], list[Document]]
) -> list[Document]:
    """:func:`cached_docs` on one rank per machine while the others wait, then read."""
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    writer = _local_leader(device)
    docs: list[Document] | None = None
    failure: BaseException | None = None
    if writer:
        try:
            docs = cached_docs(path, fingerprint, tokenize)
        except Exception as err:  # every rank must hear of it before it is raised
            failure = err
    # The barrier waits for every writer, on a gloo group of its own: tokenizing a corpus
    # may take far longer than any collective of training is allowed to wait.
    ok = torch.tensor([0 if failure else 1], dtype=torch.int64)
    waiting = dist.new_group(backend="gloo", timeout=_TOKENIZING)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=waiting)
    dist.destroy_process_group(waiting)
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
        docs = cached_docs(path, fingerprint, tokenize)
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


def _write_cache(path: Path, fingerprint: str, docs: list[Document]) -> None:
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


def _read_cache(path: Path, fingerprint: str) -> list[Document]:
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
        Document(t, m if has else None, keys[8 * i : 8 * i + 8])
        for i, (t, m, has) in enumerate(zip(tokens, trained, masked, strict=True))
    ]
