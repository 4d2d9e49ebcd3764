"""Point-to-point traffic between pipeline stages: one ``batch_isend_irecv`` per batch.

A *transfer* moves the tensors of one microbatch between neighbour stages: activations
forward (stage s to s + 1) or gradients backward (s + 1 to s). Its tensors travel packed
in one byte buffer (each at a 16-byte aligned offset; the receiver gets views of its
buffer, no copy), so a transfer is one message however many tensors it has.

Gradients need no description: the receiver knows their shapes and dtypes from its own
forward outputs. Activations do, and the receiver cannot know them in advance (the first
step, a new sequence length, an uneven last microbatch, a switch between training and
eval). So both ends of every forward link keep the last *metadata* (shape, dtype,
requires_grad of each tensor) they agreed on, per microbatch, and every activation
message starts with a 16-byte header holding one number:

* ``0``: "as agreed": the payload that follows has the agreed metadata;
* ``L > 0``: "new metadata of L numbers follows"; the payload bytes of this message are
  then meaningless (the message still has the agreed size, which the receiver posted),
  and the encoded metadata and the real payload follow as two more messages.

Before any agreement the first message is the header alone. The sender knows everything
up front and posts all of it at once; the receiver posts the first message's receive
early (:class:`P2PBatch`) and, when the data is needed, waits for it, then (only on
change) for the metadata, then for the payload. No extra message in the steady state, and
no hang when shapes change.

Gradient messages start with the same header (always ``0`` in a normal step). A negative
header ``-K`` in either kind of message means **abort**: the sender failed in this step,
and the job's key-value store holds why under key ``K`` (:meth:`P2PBatch.send_abort`;
the store, not a second message, so an abort is one message of the size the receiver
posted). The receiver raises :class:`PipelineAbort` with that text
instead of waiting for data that will never come; the runtime passes the abort on to its
own neighbours, so a failure on one rank ends the step on every rank of the pipeline,
with the cause. After an aborted step the group's pending receives are unusable: restart
the job (or the process group), as after any failed collective.

A DTensor travels as its local tensor; its layout is part of the activation metadata
(:mod:`plait.pipeline.dtensors`), so a change of layout is a change of metadata too.

Messages are told apart by tags (stage, microbatch, direction, part), so the order of
operations between two ranks does not matter on gloo. NCCL ignores tags and matches
messages in posting order; the generated schedules post in matching order in the steady
state.

Every operation is noted with :func:`plait.spmd.record_p2p` and waited for through
:func:`plait.spmd.wait`, named by its *owner* (e.g. "gradients of pipeline stage 1
microbatch 3"): with divergence checking on, a receive that never arrives fails after the
deadline with a report instead of hanging.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from plait import spmd
from plait.hooks import traced
from plait.pipeline.dtensors import DTensorLayout, decode_layout, encode_layout

__all__ = [
    "ActivationRecv",
    "Direction",
    "GradientRecv",
    "Meta",
    "P2PBatch",
    "PipelineAbort",
    "SentTensor",
    "TensorMeta",
    "abort_reason",
    "decode_meta",
    "encode_meta",
    "meta_of",
    "prune_sends",
    "publish_abort",
    "transfer_tag",
    "wait_sends",
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
_DTYPES: tuple[torch.dtype, ...] = (
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
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_ALIGN = 16  # bytes: every tensor of a packed buffer starts at a multiple of this
_HEADER = _ALIGN  # every message's header: one int64, padded to the alignment


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
        if m.dtype not in _DTYPE_CODE:
            raise TypeError(f"pipeline stages cannot send tensors of dtype {m.dtype}")
        values += [_DTYPE_CODE[m.dtype], int(m.requires_grad), len(m.shape), *m.shape]
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
        metas.append(TensorMeta(shape, _DTYPES[code], bool(requires_grad), layout))
    return tuple(metas)


def _offsets(meta: Meta, start: int) -> tuple[list[int], int]:
    """Byte offset of each tensor in a packed buffer, and the buffer's size."""
    offsets, end = [], start
    for m in meta:
        offsets.append(end)
        end += -(-_nbytes(m) // _ALIGN) * _ALIGN
    return offsets, end


def _nbytes(m: TensorMeta) -> int:
    return m.dtype.itemsize * math.prod(m.shape)


def _pack(
    tensors: Sequence[torch.Tensor], meta: Meta, start: int, device: torch.device
) -> torch.Tensor:
    """One byte buffer: ``start`` bytes for a header (holding 0: "as agreed"), then each
    tensor at its offset."""
    offsets, size = _offsets(meta, start)
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    if start:
        _write_header(buf, 0)
    for t, m, off in zip(tensors, meta, offsets, strict=True):
        _view(buf, m, off).copy_(t.detach())
    return buf


def _unpack(buf: torch.Tensor, meta: Meta, offsets: list[int]) -> list[torch.Tensor]:
    """Views of ``buf``'s tensors at ``offsets`` (fresh leaves: the caller may set
    requires_grad)."""
    return [_view(buf, m, off).detach() for m, off in zip(meta, offsets, strict=True)]


def _view(buf: torch.Tensor, m: TensorMeta, offset: int) -> torch.Tensor:
    return buf[offset : offset + _nbytes(m)].view(m.dtype).view(m.shape)


def _header(value: int, size: int, device: torch.device) -> torch.Tensor:
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    _write_header(buf, value)
    return buf


def _write_header(buf: torch.Tensor, value: int) -> None:
    buf[:8].view(torch.int64).fill_(value)


def _read_header(buf: torch.Tensor) -> int:
    return int(buf[:8].view(torch.int64).item())


class PipelineAbort(RuntimeError):
    """Another rank of the pipeline failed in this step; the message says which and why.

    ``reason`` names the rank that failed first and its error; ``source`` is the global
    rank this rank heard it from (which is not told again)."""

    def __init__(self, message: str, reason: str, source: int, key: int) -> None:
        super().__init__(message)
        self.reason, self.source, self.key = reason, source, key


class Direction(IntEnum):
    FORWARD = 0
    BACKWARD = 1


class _Part(IntEnum):
    HEADER = 0  # the header alone (no agreement yet)
    PACKED = 1  # header (activations only) + payload with the agreed metadata
    META = 2
    NEW_PAYLOAD = 3  # payload with the new metadata, no header


def transfer_tag(sender_stage: int, microbatch: int, direction: Direction, n_stages: int) -> int:
    """The base tag of one transfer; its parts add 0..3."""
    return ((microbatch * n_stages + sender_stage) * 2 + int(direction)) * len(_Part)


class _Recv:
    """A receive of one transfer: posted in a batch, waited for by its consumer."""

    def __init__(
        self, peer: int, owner: str, group: dist.ProcessGroup, device: torch.device
    ) -> None:
        self.peer, self.owner = peer, owner
        self.tag = 0  # the transfer's base tag, set by subclasses
        self.group = group
        self.device = device
        self.work: dist.Work | None = None  # set when the batch is posted

    def _wait_posted(self) -> None:
        if self.work is not None:
            spmd.wait(self.work, f"recv from rank {self.peer} of {self.owner}")
            self.work = None

    def _receive(self, tensor: torch.Tensor, part: _Part) -> None:
        """Receive one follow-up message now (the sender posted it with the header)."""
        op = _op(dist.irecv, tensor, self.peer, self.group, self.tag + part, self.owner)
        for work in dist.batch_isend_irecv([op]):
            spmd.wait(work, f"recv from rank {self.peer} of {self.owner} ({part.name.lower()})")

    def _raise_abort(self, key: int) -> None:
        """The header said abort: read the sender's reason from the store and raise it."""
        reason = abort_reason(key)
        raise PipelineAbort(
            f"plait: the pipeline step stopped because {reason} (this rank was waiting for "
            f"{self.owner} from rank {self.peer})",
            reason,
            self.peer,
            key,
        )


class ActivationRecv(_Recv):
    """An activation transfer being received; :meth:`wait` gives (metadata, tensors)."""

    def __init__(
        self,
        agreed: Meta | None,
        peer: int,
        tag: int,
        owner: str,
        group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        super().__init__(peer, owner, group, device)
        self.agreed, self.tag = agreed, tag
        self.offsets, size = ([], _HEADER) if agreed is None else _offsets(agreed, _HEADER)
        self.part = _Part.HEADER if agreed is None else _Part.PACKED
        self.first = torch.empty(size, dtype=torch.uint8, device=device)

    def wait(self) -> tuple[Meta, list[torch.Tensor]]:
        """The transfer's metadata and tensors; fetches the follow-up messages on change."""
        with traced("plait.pipeline.recv_wait"):
            self._wait_posted()
            length = _read_header(self.first)
            if length < 0:
                self._raise_abort(-length)
            if length == 0:
                assert self.agreed is not None
                return self.agreed, _unpack(self.first, self.agreed, self.offsets)
            encoded = torch.empty(length, dtype=torch.int64, device=self.device)
            self._receive(encoded, _Part.META)
            meta = decode_meta(encoded.cpu())
            offsets, size = _offsets(meta, 0)
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._receive(buf, _Part.NEW_PAYLOAD)
            return meta, _unpack(buf, meta, offsets)


class GradientRecv(_Recv):
    """A gradient transfer being received into a buffer of known layout (after the header)."""

    def __init__(
        self,
        meta: Meta,
        peer: int,
        tag: int,
        owner: str,
        group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        super().__init__(peer, owner, group, device)
        self.meta, self.tag = meta, tag
        self.offsets, size = _offsets(meta, _HEADER)
        self.buf = torch.empty(size, dtype=torch.uint8, device=device)

    def wait(self) -> list[torch.Tensor]:
        with traced("plait.pipeline.recv_wait"):
            if not self.meta:
                return []  # nothing was sent
            self._wait_posted()
            header = _read_header(self.buf)
            if header < 0:
                self._raise_abort(-header)
            return _unpack(self.buf, self.meta, self.offsets)


SentTensor = tuple[dist.Work, torch.Tensor, str]
"""A send in flight, its buffer (which must stay alive until the work completes) and what
it is, for error reports."""


class P2PBatch:
    """The point-to-point operations of consecutive send / receive actions.

    Add transfers with the ``send_*`` / ``recv_*`` methods, then :meth:`post` issues them
    in one ``batch_isend_irecv`` without waiting. Each receive is waited for by its
    consumer (``wait()`` on the returned receive object); the sends still in flight are
    returned, for the caller to keep until they complete (:func:`prune_sends`,
    :func:`wait_sends`).
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.ops: list[dist.P2POp] = []
        self.recvs: list[_Recv | None] = []  # per op: the receive it completes
        self.whats: list[str] = []  # per op: what it is, for error reports

    def __bool__(self) -> bool:
        return bool(self.ops)

    def _send(self, tensor: torch.Tensor, peer: int, tag: int, owner: str) -> None:
        self.ops.append(_op(dist.isend, tensor, peer, self.group, tag, owner))
        self.recvs.append(None)
        self.whats.append(f"send to rank {peer} of {owner}")

    def _recv(self, tensor: torch.Tensor, peer: int, tag: int, recv: _Recv) -> None:
        self.ops.append(_op(dist.irecv, tensor, peer, self.group, tag, recv.owner))
        self.recvs.append(recv)
        self.whats.append(f"recv from rank {peer} of {recv.owner}")

    def send_activations(
        self,
        tensors: Sequence[torch.Tensor],
        agreed: Meta | None,
        peer: int,
        tag: int,
        owner: str,
        meta: Meta | None = None,
    ) -> Meta:
        """Queue an activation transfer; returns the metadata both ends agree on after it.

        ``owner`` names the transfer in error reports; ``meta`` is ``tensors``' metadata
        when it says more than their own (DTensor layouts)."""
        meta = meta_of(tensors) if meta is None else meta
        if meta == agreed:
            buf = _pack(tensors, meta, _HEADER, self.device)
            self._send(buf, peer, tag + _Part.PACKED, owner)
            return meta
        encoded = encode_meta(meta)
        if agreed is None:
            header = _header(encoded.numel(), _HEADER, self.device)
            self._send(header, peer, tag + _Part.HEADER, owner)
        else:  # the size the receiver posted, with "changed" in the header
            size = _offsets(agreed, _HEADER)[1]
            header = _header(encoded.numel(), size, self.device)
            self._send(header, peer, tag + _Part.PACKED, owner)
        self._send(encoded.to(self.device), peer, tag + _Part.META, owner)
        self._send(_pack(tensors, meta, 0, self.device), peer, tag + _Part.NEW_PAYLOAD, owner)
        return meta

    def recv_activations(
        self, agreed: Meta | None, peer: int, tag: int, owner: str
    ) -> ActivationRecv:
        recv = ActivationRecv(agreed, peer, tag, owner, self.group, self.device)
        self._recv(recv.first, peer, tag + recv.part, recv)
        return recv

    def send_gradients(
        self, tensors: Sequence[torch.Tensor], peer: int, tag: int, owner: str
    ) -> None:
        if tensors:
            buf = _pack(tensors, meta_of(tensors), _HEADER, self.device)
            self._send(buf, peer, tag + _Part.PACKED, owner)

    def recv_gradients(self, meta: Meta, peer: int, tag: int, owner: str) -> GradientRecv:
        recv = GradientRecv(meta, peer, tag, owner, self.group, self.device)
        if meta:
            self._recv(recv.buf, peer, tag + _Part.PACKED, recv)
        return recv

    def send_abort(
        self, key: int, peer: int, tag: int, expected: Meta | None, first: bool, owner: str
    ) -> None:
        """Queue an abort in place of the transfer the peer waits for (see the module
        docstring); ``key`` is where :func:`publish_abort` put the reason. ``expected``:
        the metadata of the message the peer posted (header only if None, which gloo
        accepts into any larger buffer); ``first``: the peer posted an activation
        transfer's header alone (no agreement yet)."""
        size = _HEADER if expected is None else _offsets(expected, _HEADER)[1]
        part = _Part.HEADER if first else _Part.PACKED
        self._send(_header(-key, size, self.device), peer, tag + part, owner)

    def post(self) -> list[SentTensor]:
        """Issue every operation in one batch; returns the sends in flight."""
        if not self.ops:
            return []
        with traced("plait.pipeline.p2p_post"):
            works = dist.batch_isend_irecv(self.ops)
        if len(works) != len(self.ops):  # a coalescing backend (NCCL): one work for all
            what = "point-to-point batch: " + "; ".join(self.whats)
            for work in works:
                spmd.wait(work, what)
            return []
        sent = []
        for op, recv, what, work in zip(self.ops, self.recvs, self.whats, works, strict=True):
            if recv is not None:
                recv.work = work
            else:
                sent.append((work, op.tensor, what))
        return sent


def publish_abort(reason: str) -> int:
    """Put ``reason`` in the job's store under a fresh key; returns the key's number (a
    random one: keys of earlier aborts never collide with it)."""
    key = secrets.randbelow(2**62) + 1
    spmd.default_store().set(_abort_key(key), reason)
    return key


def abort_reason(key: int) -> str:
    """The reason :func:`publish_abort` put under ``key``."""
    return spmd.default_store().get(_abort_key(key)).decode(errors="replace")


def _abort_key(key: int) -> str:
    return f"plait/pipeline_abort/{key}"


def _op(
    kind: Callable[..., Any],
    tensor: torch.Tensor,
    peer: int,
    group: dist.ProcessGroup,
    tag: int,
    owner: str,
) -> dist.P2POp:
    spmd.record_p2p("send" if kind is dist.isend else "recv", tensor, peer, owner)
    return dist.P2POp(kind, tensor, peer, group, tag)


def prune_sends(sent: list[SentTensor]) -> None:
    """Drop completed sends (their buffers can be freed); never blocks."""
    sent[:] = [s for s in sent if not s[0].is_completed()]


def wait_sends(sent: list[SentTensor]) -> None:
    for work, _, what in sent:
        spmd.wait(work, what)
    sent.clear()
