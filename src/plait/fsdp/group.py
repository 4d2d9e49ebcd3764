"""A unit of ``fully_shard``: the parameters one call manages, communicated together.

The unit owns the state transitions and the gradient reduction:

* ``unshard`` issues one all-gather of every rank's *segment* (its padded chunks back to
  back; as bytes when the unit mixes dtypes or pads, so any parameters travel together)
  and ``wait_for_unshard`` copies the result into the unsharded parameters and puts them
  on the modules. In the common case (one dtype, no padding) the unsharded parameters are
  views of one buffer, so this is one allocation and one split-copy kernel per unit;
* ``reshard`` puts the sharded DTensor parameters back and frees the unsharded storage;
  with a post-forward group (``reshard_after_forward=<int>``, ZeRO++ hpZ) resharding after
  forward keeps this rank's block of the gathered rows instead, so that backward's
  all-gather stays inside that smaller group;
* ``reduce_grads`` issues one reduce-scatter per gradient dtype and ``finish_reduce``
  all-reduces it across replicas (HSDP), runs the user's all-reduce hook and adds this
  rank's part to the sharded gradients. The sum is divided into an average (or by the
  user's ``gradient_divide_factor``) where torch's ``fully_shard`` divides, so low-precision
  gradients match torch's bit for bit (``collectives.gradient_division``). Each row
  carries one count per parameter of how many ranks produced a gradient, so a parameter no
  rank used keeps ``grad=None``, as in one process (every division keeps a count's sign).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist

from plait import spmd
from plait.fsdp.collectives import (
    Comm,
    Division,
    all_gather_segments,
    all_reduce,
    allocate,
    divide_,
    gradient_division,
    reduce_scatter_segments,
)
from plait.fsdp.extensions import GatherExtension, has_extension
from plait.fsdp.param import FSDPParam
from plait.hooks import traced


class ShardedState(Enum):
    SHARDED = auto()
    SHARDED_POST_FORWARD = auto()  # only a block of the gathered rows kept (int reshard)
    UNSHARDED = auto()


@dataclass(frozen=True)
class Groups:
    """The process groups a unit communicates over.

    ``shard`` all-gathers and reduce-scatters (``rank`` / ``world`` are this rank's place
    in it); ``replicate`` all-reduces gradients across shard groups (HSDP), ``None`` for a
    1-D mesh; ``post_forward`` is the smaller group of ``reshard_after_forward=<int>``.
    """

    shard: dist.ProcessGroup
    rank: int
    world: int
    replicate: dist.ProcessGroup | None = None
    replicate_world: int = 1
    post_forward: dist.ProcessGroup | None = None
    post_forward_world: int = 1


@dataclass
class _Reduction:
    """The gradients of the parameters of one reduce dtype, and the state of their reduction."""

    params: list[FSDPParam]
    sizes: list[int]  # the columns of the matrix: each parameter's padded_numel, then counts
    columns: int  # sum(sizes)
    width: int  # the gradient columns (without the counts)
    dtype: torch.dtype
    even: bool  # no parameter is padded: the gradients concatenate in one kernel
    ones: torch.Tensor  # (world, len(params)) of ones: the counts when every grad is there
    all_used: bool = False  # this rank had a gradient for every parameter (this reduction)
    partial: torch.Tensor | None = None  # reduce-scattered, not yet all-reduced (HSDP)
    division: Division | None = None  # of the reduction in flight
    # (output, work, input): the input stays referenced until the collective has finished
    inflight: tuple[torch.Tensor, dist.Work | None, torch.Tensor] | None = field(
        default=None, repr=False
    )


class FSDPParamGroup:
    def __init__(self, params: list[FSDPParam], groups: Groups) -> None:
        self.params = params
        self.groups = groups
        # Where each location of each parameter lives on the modules, for the swaps.
        self._slots = [(loc.module._parameters, loc.name, p) for p in params for loc in p.locations]
        self.flat: torch.Tensor | None = None
        self._ready_segment: torch.Tensor | None = None  # ``flat`` when it needs no cast
        # The unsharded parameters are views of this one byte buffer (see _alloc_unsharded);
        # ``_unsharded_data`` are the copy-out destinations, ``_copy_outs`` their (world, -1)
        # views for the split-copy kernel.
        self._unsharded_buffer: torch.Tensor | None = None
        self._unsharded_data: list[torch.Tensor] = []
        self._copy_outs: list[torch.Tensor] = []
        self._reductions: dict[tuple[bool, ...], list[_Reduction]] = {}
        # Parameters with all-gather extensions (extensions.py), found at the first unshard
        # (hooks may be patched on after fully_shard); ``None``: not looked for yet.
        self._extensions: dict[FSDPParam, GatherExtension] | None = None
        self._plain_order: list[FSDPParam] = []  # gather_order without them
        self.mp_policy: Any = None  # handed to 5-argument fsdp_pre_all_gather hooks
        self.lay_out()
        self.sharded_state = ShardedState.SHARDED
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.reshard_after_backward = True
        self._gather: tuple[torch.Tensor, dist.Work | None] | None = None  # (world, segment)
        self._post_forward_rows: torch.Tensor | None = None  # (world / k, segment) bytes
        self._keep_block = False  # the next unshard feeds a post-forward reshard
        self._reducing: list[_Reduction] = []
        self.owner = "a fully_shard unit"  # named by the root at lazy init (spmd reports)
        # Set through FSDPModule's methods of the same names (torch's semantics).
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction_for_comms = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: Any = None  # a device stream to run the hook on
        self.all_gather_comm: Comm | None = None
        self.reduce_scatter_comm: Comm | None = None
        self._premul_sum: bool | None = None  # the shard group's backend has PREMUL_SUM

    @property
    def world(self) -> int:
        return self.groups.world

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    # --- unshard / reshard ---------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Issue the all-gather unless the unit is unsharded or already being gathered."""
        if self.sharded_state is not ShardedState.UNSHARDED and self._gather is None:
            if self._extensions is None:
                self._find_extensions()
            if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
                self._gather = self._gather_post_forward()
            elif self._extensions:
                self._gather = self._gather_with_extensions()
            else:
                self._gather = all_gather_segments(
                    self._segment(), self.groups.shard, self.world, self.owner, self.all_gather_comm
                )
        if not async_op:
            self.wait_for_unshard()

    def lay_out(self) -> None:
        """Derive the segment layout from the parameters' current dtypes and devices.

        Called at construction and again after ``module._apply`` (``.double()``, ``.to``,
        ``to_empty``), which may change both.
        """
        # Widest dtypes first, so every parameter's byte offset is aligned for its dtype.
        self.gather_order = sorted(self.params, key=lambda p: -p.param_dtype.itemsize)
        offset = 0
        for p in self.gather_order:
            p.gather_offset = offset
            offset += p.gather_nbytes
        align = self.gather_order[0].param_dtype.itemsize
        self.segment_tail = -offset % align  # keeps every row of the gathered matrix aligned
        # Common case (one dtype, no padding): the copy-out is one split-copy kernel.
        dtypes = {p.param_dtype for p in self.params}
        even = all(p.even for p in self.params)
        self.split_copy = len(dtypes) == 1 and not self.segment_tail and even
        self.split_sizes = [p.padded_numel for p in self.gather_order]
        # split_copy units gather in their parameter dtype, others as bytes.
        self.gather_dtype = self.gather_order[0].param_dtype if self.split_copy else torch.uint8
        self._reductions.clear()  # reduce dtypes may have changed
        self._unsharded_buffer = None  # rebuilt at the next unshard, in the new dtypes
        self._extensions = None  # local tensors may have been replaced
        self.adopt_flat_storage()

    def adopt_flat_storage(self) -> None:
        """Keep every padded shard inside one flat buffer laid out like the segment.

        Then the all-gather input is that buffer itself (or one cast of it under mixed
        precision): no concatenation per unshard. Only for units of one dtype on one
        device; others concatenate.
        """
        params = self.gather_order
        kinds = {(p.padded.dtype, p.padded.device) for p in params}
        self.flat = self._ready_segment = None
        if len(kinds) != 1 or params[0].padded.is_meta or self.segment_tail:
            return
        if any(type(p.padded) is not torch.Tensor for p in params):
            return  # a subclass shard (all-gather extensions) must stay its own tensor
        first = params[0]
        flat = torch.empty(sum(self.split_sizes), dtype=first.dtype, device=first.padded.device)
        if first.policy.offload and first.policy.pin_memory and torch.cuda.is_available():
            flat = flat.pin_memory()
        for p, piece in zip(params, flat.split(self.split_sizes), strict=True):
            p.move_padded(piece.view(p.padded.shape))
        self.flat = flat
        if flat.dtype == first.param_dtype and flat.device == first.device:  # no cast to do
            self._ready_segment = self._as_segment(flat)

    def _segment(self) -> torch.Tensor:
        """This rank's all-gather input: one row, ``gather_dtype``."""
        if self._ready_segment is not None:
            return self._ready_segment
        if self.flat is not None:
            first = self.gather_order[0]
            return self._as_segment(
                self.flat.to(first.device, first.param_dtype, non_blocking=True)
            )
        pieces = [p.gather_input() for p in self.gather_order]
        if self.segment_tail:
            pieces.append(torch.zeros(self.segment_tail, dtype=torch.uint8, device=self.device))
        return self._as_segment(torch.cat(pieces) if len(pieces) > 1 else pieces[0])

    def _as_segment(self, chunks: torch.Tensor) -> torch.Tensor:
        """``chunks`` (this rank's padded chunks back to back, flat) as the segment row."""
        return chunks.view(torch.uint8).view(self.gather_dtype).view(1, -1)

    def _gather_post_forward(self) -> tuple[torch.Tensor, dist.Work | None]:
        """All-gather the kept blocks inside the post-forward group (hpZ backward)."""
        rows = self._post_forward_rows
        assert rows is not None and self.groups.post_forward is not None
        self._post_forward_rows = None
        return all_gather_segments(
            rows,
            self.groups.post_forward,
            self.groups.post_forward_world,
            self.owner,
            self.all_gather_comm,
        )

    # --- all-gather extensions (extensions.py) ----------------------------------------------

    def _find_extensions(self) -> None:
        """Look for parameters with all-gather hooks; units without keep the fast path."""
        found = [p for p in self.params if has_extension(p)]
        if found:
            if len({p.device for p in self.params}) != 1:
                raise ValueError(
                    f"{self.owner}: all-gather extensions need every parameter of the unit "
                    "on one compute device"
                )
            for p in found:
                if p.dim != 0:
                    raise ValueError(
                        f"fully_shard: parameter {p.fqn!r} has all-gather extensions and "
                        f"shard_placement_fn chose Shard({p.dim}); extensions gather along "
                        "dim 0 only: return Shard(0) or None for it"
                    )
            self.split_copy = False  # the plain parameters' copy-out goes one by one
        self._extensions = {p: GatherExtension(p, self.world, self.mp_policy) for p in found}
        self._plain_order = [p for p in self.gather_order if p not in self._extensions]
        self._unsharded_buffer = None  # laid out again without the extended parameters

    def _gather_with_extensions(self) -> tuple[torch.Tensor, dist.Work | None]:
        """One all-gather of the plain parameters' chunks and every hook's inputs, as bytes.

        The pre-all-gather hooks run here, on every gather (their inputs may change).
        """
        assert self._extensions is not None
        pieces = [p.gather_input() for p in self._plain_order]
        for extension in self._extensions.values():
            pieces.extend(extension.inputs())
        row = torch.cat(pieces).view(1, -1)
        return all_gather_segments(
            row, self.groups.shard, self.world, self.owner, self.all_gather_comm
        )

    def _copy_out_extensions(
        self, gathered: torch.Tensor, destinations: list[torch.Tensor]
    ) -> None:
        """Fill the plain parameters from the gathered bytes, then rebuild the extended ones
        through their post-all-gather hooks."""
        assert self._extensions is not None
        gathered = gathered.view(self.world, -1)
        offset = 0
        for p, dest in zip(self._plain_order, destinations, strict=True):
            # A copy: the columns are not aligned for the parameter's dtype in general.
            p.copy_out(gathered[:, offset : offset + p.gather_nbytes].clone(), dest)
            offset += p.gather_nbytes
        for extension in self._extensions.values():
            columns = []
            for nbytes in extension.nbytes:
                columns.append(gathered[:, offset : offset + nbytes])
                offset += nbytes
            extension.finish(columns)

    def wait_for_unshard(self) -> None:
        """Finish an issued all-gather (issuing one if needed) and swap in full parameters."""
        if self.sharded_state is ShardedState.UNSHARDED:
            return
        if self._gather is None:
            self.unshard(async_op=True)
        assert self._gather is not None
        gathered, work = self._gather
        self._gather = None
        with traced("plait.fsdp.copy_out"):
            spmd.wait(work, "all_gather", self.owner)
            destinations = self._alloc_unsharded()
            if self._extensions:
                self._copy_out_extensions(gathered, destinations)
            elif self.split_copy:
                torch.split_with_sizes_copy(gathered, self.split_sizes, 1, out=self._copy_outs)
            else:
                for p, dest in zip(self.gather_order, destinations, strict=True):
                    offset = p.gather_offset
                    p.copy_out(gathered[:, offset : offset + p.gather_nbytes], dest)
            for parameters, name, p in self._slots:
                parameters[name] = p.unsharded
            if self._keep_block:
                self._keep_rows(gathered)
        self.sharded_state = ShardedState.UNSHARDED

    def _alloc_unsharded(self) -> list[torch.Tensor]:
        """Give the unsharded parameters live storage; return their copy-out destinations
        (in gather order).

        Every unsharded parameter is a view of one byte buffer, created once, so an unshard
        is one allocation and a reshard one free. Widest dtypes come first in the buffer as
        in the segment, so every view is aligned for its dtype.
        """
        buffer = self._unsharded_buffer
        if buffer is None:  # first use, or the parameters changed (lay_out resets it)
            order = self._plain_order
            nbytes = [p.numel * p.param_dtype.itemsize for p in order]
            buffer = torch.empty(sum(nbytes), dtype=torch.uint8, device=self.device)
            self._unsharded_data = []
            for p, piece in zip(order, buffer.split(nbytes), strict=True):
                view = piece.view(p.param_dtype).view(p.shape)
                # ``.data`` twice: the parameter and the copy destination get their own
                # version counters, so the copy-out does not look like an in-place change
                # of a parameter autograd saved in forward.
                p.unsharded = p.new_unsharded(view.data)
                self._unsharded_data.append(view.data)
            self._copy_outs = (
                [d.view(self.world, -1) for d in self._unsharded_data] if self.split_copy else []
            )
            self._unsharded_buffer = buffer
            return self._unsharded_data
        storage = buffer.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(buffer.numel())
        for p in self.params:
            p.follow_requires_grad()
        return self._unsharded_data

    def _keep_rows(self, gathered: torch.Tensor) -> None:
        """Keep the rows this rank serves inside its post-forward group (a copy, so the
        rest of the gathered matrix is freed)."""
        per_member = self.world // self.groups.post_forward_world
        first = (self.groups.rank % self.groups.post_forward_world) * per_member
        self._post_forward_rows = gathered[first : first + per_member].clone()

    def prepare_post_forward(self, enabled: bool) -> None:
        """Say whether the coming forward's unshard should keep an hpZ block.

        Not for units with all-gather extensions (their gathered rows are the hooks'
        inputs, not the parameters): those reshard fully, as with ``True``.
        """
        self._keep_block = enabled and self.groups.post_forward is not None
        if self._keep_block and self._extensions is None:
            self._find_extensions()
        if self._extensions:
            self._keep_block = False

    def reshard(self, post_forward: bool = False) -> None:
        """Back to the sharded parameters; ``post_forward`` keeps the hpZ block if any."""
        if self._gather is not None:  # a prefetch nobody used: complete it, then drop it
            self.wait_for_unshard()
        keep = post_forward and self._post_forward_rows is not None
        if not keep:
            self._post_forward_rows = None
        self._keep_block = False
        if self.sharded_state is not ShardedState.UNSHARDED:
            if not keep:
                self.sharded_state = ShardedState.SHARDED
            return
        for parameters, name, p in self._slots:
            parameters[name] = p.sharded
        if self._unsharded_buffer is not None:
            self._unsharded_buffer.untyped_storage().resize_(0)
        for extension in (self._extensions or {}).values():
            extension.free()
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD if keep else ShardedState.SHARDED

    # --- gradient reduction -------------------------------------------------------------

    def stash_grads(self) -> None:
        """Gradient sync is off: keep accumulating unsharded gradients (reduce dtype)."""
        for p in self.params:
            p.stash_grad()

    def _reductions_now(self) -> list[_Reduction]:
        """The reduce layout for the current trainable parameters, one entry per dtype.

        Frozen parameters take no part; the layout depends only on ``requires_grad``,
        which is the same on every rank, so all ranks issue the same collectives.
        """
        key = tuple(p.sharded.requires_grad for p in self.params)
        if key not in self._reductions:
            by_dtype: dict[torch.dtype, list[FSDPParam]] = {}
            for p, trainable in zip(self.params, key, strict=True):
                if trainable and p.reduce_dtype is not None:
                    by_dtype.setdefault(p.reduce_dtype, []).append(p)
            reductions = []
            for dtype, params in by_dtype.items():
                sizes = [p.padded_numel for p in params]
                even = all(p.even for p in params)
                # One element, expanded: the counts column costs no memory between steps.
                one = torch.ones((), dtype=dtype, device=self.device)
                ones = one.expand(self.world, len(params))
                width = sum(sizes)
                sizes.append(len(params))
                reductions.append(
                    _Reduction(params, sizes, width + len(params), width, dtype, even, ones)
                )
            self._reductions[key] = reductions
        return self._reductions[key]

    def _division(self, dtype: torch.dtype) -> Division:
        if self._premul_sum is None:  # NCCL has PREMUL_SUM; a mixed group names it too
            backend = str(dist.get_backend(self.groups.shard))
            self._premul_sum = "nccl" in backend and self.device.type == "cuda"
        return gradient_division(
            self.world,
            self.groups.replicate_world,
            dtype,
            self.gradient_divide_factor,
            self.force_sum_reduction_for_comms,
            self._premul_sum,
        )

    def reduce_grads(self) -> None:
        """Issue the reduce-scatter(s) of the accumulated unsharded gradients.

        The counts are divided along with the gradients: only their sign is read.
        """
        self.finish_reduce()
        comm = self.reduce_scatter_comm
        for red in self._reductions_now():
            matrix = allocate(comm, (self.world, red.columns), red.dtype, self.device)
            grads = [p.take_grad() for p in red.params]
            used = [g is not None for g in grads]
            red.all_used = False not in used  # then every count is positive: none is read
            if red.even and red.all_used:  # one kernel
                views = [g.view(self.world, -1) for g in grads]  # type: ignore[union-attr]
                torch.cat([*views, red.ones], dim=1, out=matrix)
            else:
                *columns, counts = matrix.split_with_sizes(red.sizes, dim=1)
                for p, g, column in zip(red.params, grads, columns, strict=True):
                    p.copy_grad_in(g, column)
                counts.copy_(torch.tensor(used, dtype=red.dtype))  # broadcast over rows
            red.division = division = self._division(red.dtype)
            divide_(matrix, division.pre)
            if division.scale is not None:
                matrix.mul_(division.scale)
            reduced = reduce_scatter_segments(
                matrix, self.groups.shard, self.owner, division.scatter_op, comm
            )
            red.inflight = (*reduced, matrix)
            self._reducing.append(red)

    def finish_reduce(self) -> None:
        """Wait for issued reductions and accumulate into the sharded gradients."""
        if not self._reducing:  # the common case: called for every unit at every forward
            return
        reducing, self._reducing = self._reducing, []
        for red in reducing:
            assert red.inflight is not None
            out, work, _ = red.inflight
            red.inflight = None
            spmd.wait(work, "reduce_scatter", self.owner)
            division = red.division
            assert division is not None
            divide_(out, division.between)
            if red.partial is not None:
                out += red.partial
                red.partial = None
            if self.groups.replicate is not None:
                if not self.requires_all_reduce:
                    red.partial = out  # all-reduced with a later step's gradients
                    continue
                all_reduce(out, self.groups.replicate, self.owner, division.all_reduce_op)
            if self.all_reduce_hook is not None:
                self._run_all_reduce_hook(out[: red.width])
            divide_(out, division.post)
            *chunks, counts_chunk = out.split_with_sizes(red.sizes)
            counts = [1] * len(red.params) if red.all_used else counts_chunk.tolist()
            for p, chunk, count in zip(red.params, chunks, counts, strict=True):
                if count > 0:
                    p.accumulate_sharded_grad(chunk)

    def _run_all_reduce_hook(self, reduced: torch.Tensor) -> None:
        """The user's hook on this rank's reduced gradients (after HSDP's all-reduce),
        on the stream the user chose, if any; later work waits for it."""
        hook, stream = self.all_reduce_hook, self.all_reduce_hook_stream
        assert hook is not None
        if stream is None:
            hook(reduced)
            return
        module = torch.get_device_module(reduced.device.type)
        current = module.current_stream()
        stream.wait_stream(current)
        with module.stream(stream):
            hook(reduced)
        current.wait_stream(stream)

    def discard_inflight(self) -> None:
        """Recovery after an exception (``reset_iter_state``): wait for the collectives
        already issued, drop their results and every gradient not yet reduced (the failed
        step's, no-sync accumulation and HSDP partial sums included), and reshard."""
        if self._gather is not None:
            _, work = self._gather
            self._gather = None
            if work is not None:
                work.wait()
        for red in self._reducing:
            if red.inflight is not None and red.inflight[1] is not None:
                red.inflight[1].wait()
            red.inflight = None
        self._reducing = []
        for reductions in self._reductions.values():
            for red in reductions:
                red.partial = None
        for p in self.params:
            p.take_grad()  # clears the unsharded gradient and the no-sync accumulator
        self._post_forward_rows = None
        self.reshard()

    @property
    def busy(self) -> bool:
        """An all-gather is in flight (the modules are about to receive full parameters)."""
        return self._gather is not None
