"""The gradient reduction of one ``fully_shard`` unit.

``start`` issues one reduce-scatter per gradient dtype of the unit's trainable parameters;
``finish`` waits for it, all-reduces across replicas (HSDP), runs the user's all-reduce
hook and adds this rank's part to the sharded gradients. The sum is divided into an
average (or by the user's ``gradient_divide_factor``) where torch's ``fully_shard``
divides, so low-precision gradients match torch's bit for bit
(``collectives.gradient_division``). Each row carries one count per parameter of how many
ranks produced a gradient, so a parameter no rank used keeps ``grad=None``, as in one
process (every division keeps a count's sign).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait import spmd
from plait.fsdp.collectives import (
    Division,
    Groups,
    all_reduce,
    allocate,
    divide_,
    gradient_division,
    reduce_scatter_segments,
)
from plait.fsdp.param import FSDPParam
from plait.fsdp.settings import UnitSettings


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


class GradientReduction:
    """A unit's gradients from the unsharded parameters to the sharded ones.

    Reads its knobs (divide factor, hooks, custom reduce-scatter, ``requires_all_reduce``)
    from the unit's :class:`UnitSettings` at each reduction, so setters take effect at the
    next one. ``owner`` (each call) names the unit in divergence reports.
    """

    def __init__(self, params: list[FSDPParam], groups: Groups, settings: UnitSettings) -> None:
        self.params = params
        self.groups = groups
        self.settings = settings
        # The reduce layout per set of trainable parameters (see ``_layout``).
        self._layouts: dict[tuple[bool, ...], list[_Reduction]] = {}
        self._reducing: list[_Reduction] = []
        self._premul_sum: bool | None = None  # the shard group's backend has PREMUL_SUM

    @property
    def world(self) -> int:
        return self.groups.world

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def forget_layout(self) -> None:
        """The parameters' dtypes may have changed (``module._apply``): lay out again."""
        self._layouts.clear()

    def stash(self) -> None:
        """Gradient sync is off: keep accumulating unsharded gradients (reduce dtype)."""
        for p in self.params:
            p.stash_grad()

    def zero_missing(self) -> None:
        """``set_reduce_scatter_unused_params``: a trainable parameter this rank did not use
        contributes zeros, so every rank reduces it and it ends with a zero gradient."""
        for p in self.params:
            unsharded = p.unsharded
            missing = unsharded is not None and unsharded.grad is None and p.accumulated is None
            if p.sharded.requires_grad and missing:
                p.zero_unsharded_grad()

    def _layout(self) -> list[_Reduction]:
        """The reduce layout for the current trainable parameters, one entry per dtype.

        Frozen parameters take no part; the layout depends only on ``requires_grad``,
        which is the same on every rank, so all ranks issue the same collectives.
        """
        key = tuple(p.sharded.requires_grad for p in self.params)
        if key not in self._layouts:
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
            self._layouts[key] = reductions
        return self._layouts[key]

    def _division(self, dtype: torch.dtype) -> Division:
        if self._premul_sum is None:  # NCCL has PREMUL_SUM; a mixed group names it too
            backend = str(dist.get_backend(self.groups.shard))
            self._premul_sum = "nccl" in backend and self.device.type == "cuda"
        return gradient_division(
            self.world,
            self.groups.replicate_world,
            dtype,
            self.settings.gradient_divide_factor,
            self.settings.force_sum_reduction_for_comms,
            self._premul_sum,
        )

    def start(self, owner: str) -> None:
        """Issue the reduce-scatter(s) of the accumulated unsharded gradients.

        The counts are divided along with the gradients: only their sign is read. The
        previous reduction must be finished (``finish``) first.
        """
        comm = self.settings.reduce_scatter_comm
        for red in self._layout():
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
                matrix, self.groups.shard, owner, division.scatter_op, comm
            )
            red.inflight = (*reduced, matrix)
            self._reducing.append(red)

    def finish(self, owner: str) -> None:
        """Wait for issued reductions and accumulate into the sharded gradients."""
        if not self._reducing:  # the common case: called for every unit at every forward
            return
        reducing, self._reducing = self._reducing, []
        for red in reducing:
            assert red.inflight is not None
            out, work, _ = red.inflight
            red.inflight = None
            spmd.wait(work, "reduce_scatter", owner)
            division = red.division
            assert division is not None
            divide_(out, division.between)
            if red.partial is not None:
                out += red.partial
                red.partial = None
            if self.groups.replicate is not None:
                if not self.settings.requires_all_reduce:
                    red.partial = out  # all-reduced with a later step's gradients
                    continue
                all_reduce(out, self.groups.replicate, owner, division.all_reduce_op)
            if self.settings.all_reduce_hook is not None:
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
        hook, stream = self.settings.all_reduce_hook, self.settings.all_reduce_hook_stream
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

    def discard(self) -> None:
        """Recovery after an exception: wait for the reductions in flight and drop them,
        with every gradient not yet reduced (no-sync accumulation and HSDP partial sums
        included)."""
        for red in self._reducing:
            if red.inflight is not None and red.inflight[1] is not None:
                red.inflight[1].wait()
            red.inflight = None
        self._reducing = []
        for reductions in self._layouts.values():
            for red in reductions:
                red.partial = None
        for p in self.params:
            p.take_grad()  # clears the unsharded gradient and the no-sync accumulator
