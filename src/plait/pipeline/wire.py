"""The wire format of pipeline transfers: tensor metadata, its encoding, and packed buffers.

A transfer's tensors travel in one byte buffer, each at a 16-byte aligned offset
(:data:`ALIGN`) after an optional header of one int64 padded to the alignment
(:data:`HEADER`); the receiver gets views of its buffer, no copy. The metadata (shape,
dtype, requires_grad, a DTensor's layout) of a transfer encodes as int64s
(:func:`encode_meta`). The protocol built on them is :mod:`plait.pipeline.p2p`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from plait.pipeline.dtensors import DTensorLayout, decode_layout, encode_layout

__all__ = [
    "ALIGN",
    "HEADER",
    "Meta",
    "TensorMeta",
    "decode_meta",
    "encode_meta",
    "header_buffer",
    "meta_of",
    "nbytes",
    "offsets_of",
    "pack",
    "read_header",
    "unpack",
    "view",
    "write_header",
]


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate one tensor of a transfer."""

    shape: tuple[int, ...]  # of the local tensor, for a DTensor
    dtype: torch.dtype
    requires_grad: bool
    layout: DTensorLayout | None = None  # a DTensor's, rebuilt by the receiver


Meta = tuple[TensorMeta, ...]

# Dtype <-> small integer for the wire; the order is part of the protocol.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}
ALIGN = 16  # bytes: every tensor of a packed buffer starts at a multiple of this
HEADER = ALIGN  # every message's header: one int64, padded to the alignment


def meta_of(
    tensors: Sequence[torch.Tensor], layouts: Sequence[DTensorLayout | None] | None = None
) -> Meta:
    """The metadata of plain tensors; ``layouts`` marks the local tensors of DTensors."""
    if layouts is None:
        layouts = [None] * len(tensors)
    return tuple(
        TensorMeta(tuple(t.shape), t.dtype, t.requires_grad, layout)
        for t, layout in zip(tensors, layouts, strict=True)
    )


def encode_meta(meta: Meta) -> torch.Tensor:
    """``[n, (dtype code, requires_grad, ndim, *shape, is DTensor, *layout) per tensor]``
    as int64 (the layout encoded by :func:`~plait.pipeline.dtensors.encode_layout`)."""
    values = [len(meta)]
    for m in meta:
        if m.dtype not in DTYPE_CODE:
            raise TypeError(f"pipeline stages cannot send tensors of dtype {m.dtype}")
        values += [DTYPE_CODE[m.dtype], int(m.requires_grad), len(m.shape), *m.shape]
        values += [0] if m.layout is None else [1, *encode_layout(m.layout)]
    return torch.tensor(values, dtype=torch.int64)


def decode_meta(encoded: torch.Tensor) -> Meta:
    values = encoded.tolist()
    metas, pos = [], 1
    for _ in range(values[0]):
        code, requires_grad, ndim = values[pos : pos + 3]
        shape = tuple(values[pos + 3 : pos + 3 + ndim])
        pos += 3 + ndim
        layout = None
        if values[pos]:
            layout, pos = decode_layout(values, pos + 1)
        else:
            pos += 1
        metas.append(TensorMeta(shape, DTYPES[code], bool(requires_grad), layout))
    return tuple(metas)


def offsets_of(meta: Meta, start: int) -> tuple[list[int], int]:
    """Byte offset of each tensor in a packed buffer, and the buffer's size."""
    offsets, end = [], start
    for m in meta:
        offsets.append(end)
        end += -(-nbytes(m) // ALIGN) * ALIGN
    return offsets, end


def nbytes(m: TensorMeta) -> int:
    return m.dtype.itemsize * math.prod(m.shape)


def pack(
    tensors: Sequence[torch.Tensor], meta: Meta, start: int, device: torch.device
) -> torch.Tensor:
    """One byte buffer: ``start`` bytes for a header (holding 0: "as agreed"), then each
    tensor at its offset."""
    offsets, size = offsets_of(meta, start)
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    if start:
        write_header(buf, 0)
    for t, m, off in zip(tensors, meta, offsets, strict=True):
        view(buf, m, off).copy_(t.detach())
    return buf


def unpack(buf: torch.Tensor, meta: Meta, offsets: list[int]) -> list[torch.Tensor]:
    """Views of ``buf``'s tensors at ``offsets`` (fresh leaves: the caller may set
    requires_grad)."""
    return [view(buf, m, off).detach() for m, off in zip(meta, offsets, strict=True)]


def view(buf: torch.Tensor, m: TensorMeta, offset: int) -> torch.Tensor:
    return buf[offset : offset + nbytes(m)].view(m.dtype).view(m.shape)


def header_buffer(value: int, size: int, device: torch.device) -> torch.Tensor:
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    write_header(buf, value)
    return buf


def write_header(buf: torch.Tensor, value: int) -> None:
    buf[:8].view(torch.int64).fill_(value)


def read_header(buf: torch.Tensor) -> int:
    return int(buf[:8].view(torch.int64).item())
