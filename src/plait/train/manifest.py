"""A checkpoint's manifest: the size and SHA-256 of each of its files.

Written last, just before the checkpoint's directory is renamed into place, and verified
before anything is loaded from it, so a truncated, corrupted or missing file is named
instead of being loaded as wrong weights::

    manifest.json   {"format": 1, "files": {"__0_0.distcp": {"bytes": 81920,
                                                             "sha256": "9f2c..."}, ...}}

Both directions are collective when a process group is given: rank ``r`` hashes every
``world``-th file from the ``r``-th, so no rank reads the whole checkpoint, and the ranks
exchange what they found, so every rank raises the same error (or none).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["MANIFEST", "CheckpointDamaged", "from_every_rank", "verify_manifest", "write_manifest"]

MANIFEST = "manifest.json"
_FORMAT = 1
_CHUNK = 1 << 20

T = TypeVar("T")


class CheckpointDamaged(RuntimeError):
    """A checkpoint's files are not what its manifest says (or it has no manifest)."""


def _files(directory: Path) -> list[str]:
    """Every file under ``directory`` but the manifest, as sorted relative paths."""
    found = (p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    return sorted(p.relative_to(directory).as_posix() for p in found)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _my_share(items: list[T], group: dist.ProcessGroup | None) -> list[T]:
    if group is None:
        return items
    return items[dist.get_rank(group) :: dist.get_world_size(group)]


def from_every_rank(value: T, group: dist.ProcessGroup | None) -> list[T]:
    """``value`` of every rank of ``group``, in rank order (collective); ``[value]`` alone
    without a group (one process, or a caller whose group is None by design)."""
    if group is None:
        return [value]
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, value, group=group)
    return every


def write_manifest(directory: Path, group: dist.ProcessGroup | None = None) -> None:
    """Hash the files of ``directory`` and (rank 0 of ``group``) write its manifest.

    Call it once every file is written and visible to every rank."""
    mine = {
        name: {"bytes": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
        for name in _my_share(_files(directory), group)
    }
    files: dict[str, Any] = {}
    for entries in from_every_rank(mine, group):
        files.update(entries)
    if group is not None and dist.get_rank(group) != 0:
        return
    with open(directory / MANIFEST, "w") as f:
        json.dump({"format": _FORMAT, "files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _read(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointDamaged(
            f"checkpoint {directory} has no {MANIFEST}: it is incomplete or was written "
            "by an older plait, and cannot be checked; refusing to load it"
        )
    try:
        files = json.loads(path.read_text())["files"]
        return {name: (int(e["bytes"]), str(e["sha256"])) for name, e in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointDamaged(
            f"checkpoint {directory}: {MANIFEST} is damaged ({type(error).__name__}: {error}); "
            "refusing to load the checkpoint"
        ) from None


def _problem(directory: Path, name: str, expected: tuple[int, str]) -> str | None:
    """What is wrong with file ``name``, or None."""
    path = directory / name
    if not path.is_file():
        return f"{path}: missing"
    size, digest = expected
    actual = path.stat().st_size
    if actual != size:
        how = "truncated" if actual < size else "longer than written"
        return f"{path}: {actual} bytes, but {MANIFEST} says {size}: the file is {how}"
    if _sha256(path) != digest:
        return f"{path}: its SHA-256 differs from {MANIFEST}'s: the file is corrupted"
    return None


def verify_manifest(directory: Path, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`CheckpointDamaged` naming each file of ``directory`` that its
    manifest does not describe (missing, truncated, corrupted); collective over ``group``."""
    files = _read(directory)  # every rank reads the same manifest: all raise, or none
    names = sorted(files)
    mine = [p for name in _my_share(names, group) if (p := _problem(directory, name, files[name]))]
    problems = [p for found in from_every_rank(mine, group) for p in found]
    if problems:
        listed = "; ".join(problems[:4]) + ("; ..." if len(problems) > 4 else "")
        raise CheckpointDamaged(f"checkpoint {directory} is damaged, refusing to load it: {listed}")
