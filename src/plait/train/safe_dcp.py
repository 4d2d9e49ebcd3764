"""Reading DCP checkpoints without running pickled code: DCP's metadata file read by an
unpickler that admits only DCP's metadata classes (:class:`SafeFileSystemReader`), and
entries that are not tensors, which DCP would ``torch.load`` with ``weights_only=False``,
refused (:class:`TensorsOnlyPlanner`). :mod:`plait.train.checkpointing` loads with both."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["SafeFileSystemReader", "TensorsOnlyPlanner"]


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's metadata is made of: its dataclasses, torch sizes, dtypes
    and memory formats, and plain containers."""

    _ALLOWED_MODULES = ("torch.distributed.checkpoint.",)
    _ALLOWED = frozenset(
        {
            ("collections", "OrderedDict"),
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),  # maps a name to a torch.layout
            ("pathlib", "PosixPath"),  # DCP records the checkpoint's path
            ("pathlib", "WindowsPath"),
            ("builtins", "set"),
            ("builtins", "frozenset"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(self._ALLOWED_MODULES) or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint does not "
            "contain: refusing to load it (the file may have been tampered with)"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with its metadata read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold DCP metadata")
        # What DCP's own reader also fills in before the plan is made.
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, refusing non-tensor entries (DCP would ``torch.load`` them with
    ``weights_only=False``, which can run arbitrary code)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise RuntimeError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is not a tensor; plait checkpoints "
            "hold tensors only, refusing to unpickle it"
        )
