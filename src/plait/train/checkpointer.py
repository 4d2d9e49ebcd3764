"""Writing a session's checkpoints: synchronously, or (``--async-checkpoint``) from a staged
copy on a background thread while training goes on.

Synchronous (the default): :meth:`Checkpointer.save` writes the checkpoint
(:func:`~plait.train.checkpointing.write_checkpoint` of the live state) and returns once
it is published; training waits for the whole write.

Asynchronous: :meth:`Checkpointer.save`, on the training thread, between two steps,

1. waits for the previous checkpoint's write, if it is still running (at most one write
   in flight, so at most one staged copy exists);
2. stages: copies every tensor of this rank's checkpoint (parameters, optimizer state,
   RNG states; its DTensor shards only) into one host arena of exactly their size,
   page-locked on CUDA, allocated at the first checkpoint and reused by the next ones
   (:class:`Stager`). The copy is taken
   exactly where a synchronous save reads the live tensors, so the two checkpoints hold
   the same values;
3. hands the staged copy to a background thread, which writes it exactly as a synchronous
   save does (:func:`~plait.train.checkpointing.write_checkpoint`: a ``.tmp-`` directory,
   the manifest last, then the rename), its collectives on the checkpoint process group,
   which training never uses.

So the guarantees are the synchronous save's: a checkpoint becomes visible (renamed into
``step_N``) only once complete, and a kill at any moment of the write leaves the previous
checkpoint intact (``--resume`` and ``--max-restarts`` continue from it). The training
thread's cost is the staging copy (and any wait for the previous write); the staging
memory, one copy of this rank's checkpoint, is counted (:attr:`Checkpointer.staged_bytes`)
and reported. A failed write raises on the training thread at the next checkpoint or at
:meth:`Checkpointer.close`, which the session calls before it ends, so a run never exits
with a checkpoint still being written.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait.train.checkpointing import checkpoint_state, checkpoints_dir, write_checkpoint
from plait.train.config import ConfigError
from plait.train.snapshots import first_on_machine, write_snapshot

__all__ = ["Checkpointer", "SaveReport", "Stager", "WriteReport"]


@dataclass(frozen=True)
class SaveReport:
    """One checkpoint, as the training thread saw it. ``blocked_s``: how long training
    waited (the whole write when synchronous; the wait for the previous write plus the
    staging copy when asynchronous); ``staged_bytes``: the staging copy's size (0 when
    synchronous); ``snapshot``: a snapshot in memory (:mod:`plait.train.snapshots`)."""

    step: int
    path: Path
    background: bool
    blocked_s: float
    staged_bytes: int
    snapshot: bool = False

    def record(self) -> dict[str, Any]:
        """Its metrics.jsonl row (:mod:`plait.train.metrics`): event ``checkpoint``, or
        ``snapshot``."""
        return {
            "step": self.step,
            "event": "snapshot" if self.snapshot else "checkpoint",
            "checkpoint": self.path.name,
            "async": self.background,
            "blocked_s": self.blocked_s,
            "staged_bytes": self.staged_bytes,
        }


@dataclass(frozen=True)
class WriteReport:
    """An asynchronous checkpoint's (or snapshot's) write, finished: how long the
    background thread took."""

    step: int
    path: Path
    write_s: float
    snapshot: bool = False


class Stager:
    """Host copies of a checkpoint's tensors, reused from one checkpoint to the next.

    :meth:`stage` returns a state of the same structure whose tensors are copies (a
    DTensor's copy is a DTensor of the same mesh and placements around a copy of its
    local shard). The copies are views of one host arena of exactly their size (each
    tensor's start aligned to :data:`ALIGN` bytes), kept while the checkpoint's tensors
    keep their names, shapes and dtypes. With ``pin`` (CUDA runs) the arena is page-locked
    by registering it with CUDA (``cudaHostRegister``), so device-to-host copies run
    asynchronously: pinned tensors from torch's host allocator would each be rounded up to
    a power of two, up to twice the checkpoint's size in host memory. Registration that
    fails leaves the arena pageable (copies then wait; the values are the same), with a
    warning. :meth:`close` releases the registration."""

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._buffers: dict[tuple[str, ...], torch.Tensor] = {}
        self._layout: tuple[tuple[tuple[str, ...], torch.Size, torch.dtype], ...] = ()
        self._arena: torch.Tensor | None = None
        self._registered = False

    @property
    def nbytes(self) -> int:
        """Bytes of the staged tensors."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def reserved(self) -> int:
        """Bytes of the arena: :attr:`nbytes` and the alignment between tensors."""
        return 0 if self._arena is None else self._arena.numel()

    @property
    def pinned(self) -> bool:
        """Whether the arena is registered (page-locked) with CUDA."""
        return self._registered

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` (nested dicts of tensors) in the staging buffers."""
        self._lay_out(list(_leaves(state, ())))
        staged = self._copy(state, ())
        if self._pin:  # the copies were queued non-blocking: done before the thread reads
            torch.cuda.current_stream().synchronize()
        return staged

    def close(self) -> None:
        """Release the arena (its CUDA registration first). Call once no staged copy is
        in use (no write in flight)."""
        if self._registered and self._arena is not None:
            torch.cuda.cudart().cudaHostUnregister(self._arena.data_ptr())
        self._arena, self._registered = None, False
        self._buffers, self._layout = {}, ()

    def _lay_out(self, leaves: list[tuple[tuple[str, ...], torch.Tensor]]) -> None:
        """One arena for ``leaves`` (path, local tensor), unless the current one fits."""
        layout = tuple((path, t.shape, t.dtype) for path, t in leaves)
        if layout == self._layout:
            return
        self.close()
        offsets, total = [], 0
        for _, t in leaves:
            total = -(-total // ALIGN) * ALIGN
            offsets.append(total)
            total += t.numel() * t.element_size()
        arena = torch.empty(total, dtype=torch.uint8)
        self._arena, self._layout = arena, layout
        if self._pin and total and any(t.device.type == "cuda" for _, t in leaves):
            self._registered = _register(arena)
        for (path, t), start in zip(leaves, offsets, strict=True):
            piece = arena[start : start + t.numel() * t.element_size()]
            self._buffers[path] = piece.view(t.dtype).view(t.shape)

    def _copy(self, value: Any, path: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            return {key: self._copy(item, (*path, key)) for key, item in value.items()}
        if isinstance(value, DTensor):
            local = self._buffer(path, value.to_local())
            # Around the host buffer with the original's spec (mesh, placements, global
            # shape): DTensor.from_local would move the buffer back to a CUDA mesh's device.
            return DTensor(local, value._spec, requires_grad=False)
        return self._buffer(path, value)

    def _buffer(self, path: tuple[str, ...], tensor: torch.Tensor) -> torch.Tensor:
        return self._buffers[path].copy_(tensor.detach(), non_blocking=self._registered)


#: Bytes each staged tensor's start is aligned to in the arena (any dtype's element size).
ALIGN = 16


def _leaves(value: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
    """(path, tensor) of every tensor of a checkpoint state (a DTensor's local shard), in
    the order :meth:`Stager._copy` visits them; TypeError naming an entry that is not one."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, DTensor):
        yield path, value.to_local()
    elif isinstance(value, torch.Tensor):
        yield path, value
    else:
        raise TypeError(f"cannot stage checkpoint entry {'.'.join(path)}: {type(value).__name__}")


def _register(arena: torch.Tensor) -> bool:
    """Page-lock ``arena`` with CUDA; False (and a warning) where CUDA refuses."""
    # Flag 1, cudaHostRegisterPortable: page-locked for every CUDA context, as DCP's
    # own stager registers its buffers.
    error = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 1)
    if int(error) == 0:
        return True
    warnings.warn(
        f"plait train: could not page-lock the {arena.numel():,}-byte checkpoint staging "
        f"buffer (cudaHostRegister: {error}); staging copies wait for the device instead",
        stacklevel=3,
    )
    return False


class Checkpointer:
    """Saves this rank's checkpoints of ``modules`` and ``optimizer`` into ``run_dir``
    (module docstring), and its snapshots into ``snapshots`` (a snapshot root,
    :mod:`plait.train.snapshots`: only the newest kept); ``background``: asynchronously,
    one write in flight whichever its kind. Collective: every rank saves at the same steps.
    Call :meth:`close` (on every rank) before the session ends."""

    def __init__(
        self,
        run_dir: str | Path,
        modules: Sequence[nn.Module],
        optimizer: torch.optim.Optimizer,
        config: dict[str, Any],
        keep: int,
        group: dist.ProcessGroup | None,
        *,
        background: bool,
        snapshots: Path | None = None,
    ) -> None:
        self.run_dir, self.snapshots = Path(run_dir), snapshots
        self.modules, self.optimizer = modules, optimizer
        self.config, self.keep, self.group = config, keep, group
        self.background = background
        self.stager = Stager(pin=config["device"] == "cuda")
        self._pending: _Background | None = None
        self._room_checked = False

    @property
    def staged_bytes(self) -> int:
        """The staging copy's size on this rank (0 when synchronous)."""
        return self.stager.nbytes

    def save(self, step: int, snapshot: bool = False) -> tuple[SaveReport, list[WriteReport]]:
        """Checkpoint step ``step`` (``snapshot``: snapshot it); returns its report, and the
        previous asynchronous write if this save had to wait for it (re-raising its error
        if it failed)."""
        began = time.perf_counter()
        root = self.snapshots if snapshot else self.run_dir
        if root is None:
            raise ValueError("Checkpointer.save(snapshot=True): no snapshot root was given")
        state = checkpoint_state(self.modules, self.optimizer, self.config["device"])
        if snapshot:
            self._check_room(root, state)
        if not self.background:
            path = self._write(root, step, state, snapshot, background=False).path
            return SaveReport(step, path, False, time.perf_counter() - began, 0, snapshot), []
        finished = self.wait()  # the previous write's staged copy is free then
        staged = self.stager.stage(state)
        self._pending = _Background(lambda: self._write(root, step, staged, snapshot))
        blocked = time.perf_counter() - began
        path = checkpoints_dir(root) / f"step_{step:06d}"  # once written
        return SaveReport(step, path, True, blocked, self.staged_bytes, snapshot), finished

    def _check_room(self, root: Path, state: dict[str, Any]) -> None:
        """Before the first snapshot: ConfigError, with the fix, if ``root``'s file system
        (memory) has no room for two snapshots of this machine's ranks (the newest is kept
        until the next one is published), each the size of this rank's ``state``, and as
        much again on a job over several machines (the copies this machine keeps)."""
        if self._room_checked:
            return
        self._room_checked = True
        root.mkdir(parents=True, exist_ok=True)
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        world = dist.get_world_size() if dist.is_initialized() else 1
        copies = 2 if ranks < world else 1  # several machines: the previous one's kept here
        state_bytes = sum(t.numel() * t.element_size() for _, t in _leaves(state, ()))
        need = 2 * copies * ranks * state_bytes
        free = shutil.disk_usage(root).free
        if free < need:
            raise ConfigError(
                f"--snapshot-every: {root.parent} has {free / 2**30:.2f} GiB free, and "
                f"snapshots of this machine's {ranks} rank(s) need {need / 2**30:.2f} GiB "
                "(two of each rank's state, the newest kept while the next is written): "
                "give it more room (e.g. mount -o remount,size=... /dev/shm) or drop "
                "--snapshot-every"
            )

    def _write(
        self, root: Path, step: int, state: dict[str, Any], snapshot: bool, background: bool = True
    ) -> WriteReport:
        """Write ``state`` as the checkpoint, or the snapshot, of ``step`` under ``root``."""
        began = time.perf_counter()
        if snapshot:
            path = write_snapshot(root, step, state, self.config, self.group, background=background)
        else:
            path = write_checkpoint(
                root, step, state, self.config, self.keep, self.group, background=background
            )
        return WriteReport(step, path, time.perf_counter() - began, snapshot)

    def wait(self) -> list[WriteReport]:
        """Wait for the write in flight, if any; its report (its error, if it failed)."""
        pending, self._pending = self._pending, None
        return [] if pending is None else [pending.result()]

    def close(self) -> list[WriteReport]:
        """Wait for the last write (the session's end: nothing is left being written),
        then release the staging buffers, and remove the snapshots (each machine's first
        rank: the session's last save is a checkpoint, newer than every snapshot)."""
        try:
            written = self.wait()
        finally:
            self.stager.close()
        if self.snapshots is not None and first_on_machine():
            shutil.rmtree(self.snapshots, ignore_errors=True)
        return written


class _Background:
    """``work`` run on a daemon thread: a session that fails (an exception on the training
    thread) exits without waiting for a write whose peers may be gone, which would
    otherwise hold the process for the checkpoint group's whole timeout."""

    def __init__(self, work: Callable[[], WriteReport]) -> None:
        self._work = work
        self._result: WriteReport | None = None
        self._error: BaseException | None = None
        # The rank's GPU: a new thread's current device is 0, where anything the write does
        # on the current device (DCP's writer synchronizes its current stream) would create
        # a CUDA context on every rank.
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._device = torch.cuda.current_device() if cuda else None
        self._thread = threading.Thread(target=self._run, name="plait-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._device is not None:
                torch.cuda.set_device(self._device)
            self._result = self._work()
        except BaseException as error:  # re-raised on the training thread by result()
            self._error = error

    def result(self) -> WriteReport:
        """Wait for ``work``; its result, or its exception raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return cast(WriteReport, self._result)  # set: the work returned
