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
no hang when shapes change. Training and eval steps keep agreements of their own (their
tensors differ in requires_grad), so alternating them changes nothing. Where messages match
in posting order (below), a change after the first agreement travels through the job's
key-value store instead (the header message still on the link), since the receiver could
only post the two extra messages late.

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
operations between two ranks does not matter on gloo. NCCL (and every backend of device
tensors) ignores tags and matches the messages between two ranks in posting order, runs a
communicator's operations one batch after another, and gives one work for a whole batch
(:func:`matches_in_order`). There the runtime posts every send and receive at its place
in the schedule, none ahead (the lowering places each receive where its send happens:
:mod:`plait.pipeline.lowering`). The first activation receive of a microbatch (no
agreement yet) is *settled* as soon as it is posted, its batch ending with it: the
runtime waits for the header and receives the metadata and payload at once, so that they
follow the header at both ends before anything else this rank posts. A later change of
metadata (a new sequence length, an uneven last microbatch that comes and goes) sends the
header message alone on the link, and the metadata and payload through the job's store
(:func:`_put_change`): slower, but the receiver never has to post a message out of its
place. Steady-state transfers are one message, waited for where they are consumed.

Every operation is noted with :func:`plait.spmd.record_p2p` and waited for through
:func:`plait.spmd.wait`, named by its *owner* (e.g. "gradients of pipeline stage 1
microbatch 3"): with divergence checking on, a receive that never arrives fails after the
deadline with a report instead of hanging.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from plait import spmd
from plait.hooks import traced
from plait.mesh import host_copy
from plait.pipeline.wire import (
    HEADER,
    Meta,
    TensorMeta,
    decode_meta,
    encode_meta,
    header_buffer,
    meta_of,
    offsets_of,
    pack,
    read_header,
    unpack,
)

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
    "matches_in_order",
    "meta_of",
    "prune_sends",
    "publish_abort",
    "transfer_tag",
    "wait_sends",
]

logger = logging.getLogger(__name__)


def matches_in_order(device: torch.device) -> bool:
    """Whether the backend moving ``device``'s tensors matches messages in posting order
    (NCCL and the backends of other accelerators) rather than by tag (gloo, for CPU
    tensors); module docstring."""
    return device.type != "cpu"


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


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream receives' headers are read on, one per device."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


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

    def _header(self, buf: torch.Tensor) -> int:
        """Wait for the posted batch and read the transfer's header from ``buf``.

        On a GPU the header is read on a side stream that waits for the receive alone: the
        host then waits for the message, not for everything queued on the compute stream
        before it (``.item()`` there would leave the GPU idle while the host launches the
        next action). The compute stream then waits for the batch as before."""
        if self.work is not None and buf.device.type == "cuda":
            side = _side_stream(buf.device)
            with torch.cuda.stream(side):
                self.work.wait()  # the side stream waits for the receive
                host = host_copy(buf[:8])
                done = torch.cuda.Event()
                done.record(side)
            done.synchronize()
            self._wait_posted()
            return int(host.view(torch.int64).item())
        self._wait_posted()
        return read_header(buf)

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
    """An activation transfer being received; :meth:`wait` gives (metadata, tensors).
    ``in_order``: the backend matches messages in posting order, so a change of metadata
    after the agreement arrives through the store (module docstring)."""

    def __init__(
        self,
        agreed: Meta | None,
        peer: int,
        tag: int,
        owner: str,
        group: dist.ProcessGroup,
        device: torch.device,
        in_order: bool = False,
    ) -> None:
        super().__init__(peer, owner, group, device)
        self.agreed, self.tag = agreed, tag
        self.offsets, size = ([], HEADER) if agreed is None else offsets_of(agreed, HEADER)
        self.part = _Part.HEADER if agreed is None else _Part.PACKED
        self.first = torch.empty(size, dtype=torch.uint8, device=device)
        self._result: tuple[Meta, list[torch.Tensor]] | None = None
        self.in_order = in_order

    def wait(self) -> tuple[Meta, list[torch.Tensor]]:
        """The transfer's metadata and tensors; fetches the follow-up messages on change."""
        with traced("plait.pipeline.recv_wait"):
            return self.settle()

    def settle(self) -> tuple[Meta, list[torch.Tensor]]:
        """Wait for the first message and, on change, receive the metadata and payload
        that follow it; once (later calls give the same result)."""
        if self._result is not None:
            return self._result
        length = self._header(self.first)
        if length < 0:
            self._raise_abort(-length)
        if length == 0:
            assert self.agreed is not None
            self._result = self.agreed, unpack(self.first, self.agreed, self.offsets)
            return self._result
        if self.in_order and self.agreed is not None:
            meta, buf = _take_change(self.peer, self.tag, self.device)
            self._result = meta, unpack(buf, meta, offsets_of(meta, 0)[0])
            return self._result
        encoded = torch.empty(length, dtype=torch.int64, device=self.device)
        self._receive(encoded, _Part.META)
        meta = decode_meta(encoded.cpu())
        offsets, size = offsets_of(meta, 0)
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._receive(buf, _Part.NEW_PAYLOAD)
        self._result = meta, unpack(buf, meta, offsets)
        return self._result


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
        self.offsets, size = offsets_of(meta, HEADER)
        self.buf = torch.empty(size, dtype=torch.uint8, device=device)

    def wait(self) -> list[torch.Tensor]:
        with traced("plait.pipeline.recv_wait"):
            if not self.meta:
                return []  # nothing was sent
            header = self._header(self.buf)
            if header < 0:
                self._raise_abort(-header)
            return unpack(self.buf, self.meta, self.offsets)


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

    def __init__(
        self, group: dist.ProcessGroup, device: torch.device, in_order: bool = False
    ) -> None:
        self.group = group
        self.device = device
        self.in_order = in_order  # the backend matches messages in posting order
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
            buf = pack(tensors, meta, HEADER, self.device)
            self._send(buf, peer, tag + _Part.PACKED, owner)
            return meta
        encoded = encode_meta(meta)
        if agreed is None:
            header = header_buffer(encoded.numel(), HEADER, self.device)
            self._send(header, peer, tag + _Part.HEADER, owner)
        else:  # the size the receiver posted, with "changed" in the header
            size = offsets_of(agreed, HEADER)[1]
            header = header_buffer(encoded.numel(), size, self.device)
            self._send(header, peer, tag + _Part.PACKED, owner)
            if self.in_order:  # the rest goes through the store (module docstring)
                _put_change(peer, tag, encoded, pack(tensors, meta, 0, torch.device("cpu")))
                return meta
        self._send(encoded.to(self.device), peer, tag + _Part.META, owner)
        self._send(pack(tensors, meta, 0, self.device), peer, tag + _Part.NEW_PAYLOAD, owner)
        return meta

    def recv_activations(
        self, agreed: Meta | None, peer: int, tag: int, owner: str
    ) -> ActivationRecv:
        recv = ActivationRecv(agreed, peer, tag, owner, self.group, self.device, self.in_order)
        self._recv(recv.first, peer, tag + recv.part, recv)
        return recv

    def send_gradients(
        self, tensors: Sequence[torch.Tensor], peer: int, tag: int, owner: str
    ) -> None:
        if tensors:
            buf = pack(tensors, meta_of(tensors), HEADER, self.device)
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
        size = HEADER if expected is None else offsets_of(expected, HEADER)[1]
        part = _Part.HEADER if first else _Part.PACKED
        self._send(header_buffer(-key, size, self.device), peer, tag + part, owner)

    def post(self) -> list[SentTensor]:
        """Issue every operation in one batch; returns the sends in flight."""
        if not self.ops:
            return []
        with traced("plait.pipeline.p2p_post"):
            works = dist.batch_isend_irecv(self.ops)
        if len(works) != len(self.ops):  # a coalescing backend (NCCL): one work for all,
            (work,) = works  # which each operation's waiter waits for
            works = [work] * len(self.ops)
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


_changes: dict[str, int] = {}
"""Per link and transfer tag: the changes of metadata sent or received so far (both ends
count alike, so each change has its own key in the store)."""


def _change_key(sender: int, receiver: int, tag: int) -> str:
    link = f"plait/pipeline_change/{sender}->{receiver}/{tag}"
    n = _changes[link] = _changes.get(link, 0) + 1
    return f"{link}/{n}"


def _put_change(peer: int, tag: int, encoded: torch.Tensor, payload: torch.Tensor) -> None:
    """Put a changed transfer's metadata and payload (on the CPU) in the job's store for
    ``peer``: where messages match in posting order, a message the receiver could not
    post in its place would hang (module docstring)."""
    if not _changes:
        logger.warning(
            "plait: pipeline activations changed shape, dtype or requires_grad after the "
            "first step; on this backend (NCCL) such a transfer goes through the job's "
            "store, which is slow for large tensors: keep each microbatch's shapes fixed "
            "(pad sequences to one length)"
        )
    size = encoded.numel().to_bytes(8, "little")
    blob = size + encoded.numpy().tobytes() + payload.numpy().tobytes()
    key = _change_key(dist.get_rank(), peer, tag)
    spmd.default_store().set(key, blob)  # type: ignore[arg-type]  # bytes: torch's stub says str


def _take_change(peer: int, tag: int, device: torch.device) -> tuple[Meta, torch.Tensor]:
    """The metadata and payload :func:`_put_change` put for this rank, removed from the
    store; the payload as a byte buffer on ``device``."""
    store, key = spmd.default_store(), _change_key(peer, dist.get_rank(), tag)
    blob = bytearray(store.get(key))
    store.delete_key(key)
    n = int.from_bytes(blob[:8], "little")
    encoded = torch.frombuffer(blob, dtype=torch.int64, offset=8, count=n)
    start = 8 + 8 * n
    if start == len(blob):  # a transfer of empty tensors (frombuffer refuses no bytes)
        return decode_meta(encoded), torch.empty(0, dtype=torch.uint8, device=device)
    payload = torch.frombuffer(blob, dtype=torch.uint8, offset=start)
    return decode_meta(encoded), payload.to(device)


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
