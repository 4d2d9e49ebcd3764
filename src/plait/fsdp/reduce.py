"""The gradient reduction of one unit, for ``fully_shard`` and ``replicate`` alike.

A unit's trainable parameters are split into *reductions*: one per gradient dtype for a
``fully_shard`` unit; for a ``replicate`` unit (``UnitSettings.bucket_cap_bytes``) buckets
of at most that many bytes, the parameters in reverse registration order (about the order
backward produces their gradients), the first bucket capped at 1 MiB so communication
starts early. Each reduction packs its gradients into one (world, width + counts) matrix,
reduce-scatters it over the shard group (skipped when that group is this rank alone, as
for ``replicate``), all-reduces the result across replicas (HSDP, ``replicate``), runs the
user's all-reduce hook and adds this rank's part to the sharded gradients.

The sum is divided into an average (or by the user's ``gradient_divide_factor``) where
torch's ``fully_shard`` divides, so low-precision gradients match torch's bit for bit
(``collectives.gradient_division``). Each row carries one count per parameter of how many
ranks produced a gradient, so a parameter no rank used keeps ``grad=None``, as in one
process (every division keeps a count's sign).

Reductions are launched strictly in layout order, so every rank issues the same
collectives whatever order its gradients arrive in: all at once (``start``, when the unit's
backward is done), or one by one as their gradients become ready (``grad_ready``, which
``replicate`` calls from post-accumulate-grad hooks) with ``start`` launching the rest.
Between the first launch (or ready gradient) and ``finish`` a *round* is open.
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

_FIRST_BUCKET_BYTES = 1024 * 1024  # replicate's first bucket: communication starts early


@dataclass
class _InFlight:
    """A launched reduction: ``work`` is its reduce-scatter, or (``across``) its all-reduce
    across replicas, already issued because there was nothing to scatter."""

    out: torch.Tensor
    work: dist.Work | None
    input: torch.Tensor  # referenced until the collective has finished
    across: bool
    deferred: bool = False  # ``requires_all_reduce`` off: kept as a partial sum instead


@dataclass
class _Reduction:
    """The gradients of some of a unit's parameters, reduced together, and their state."""

    params: list[FSDPParam]
    sizes: list[int]  # the columns of the matrix: each parameter's padded_numel, then counts
    columns: int  # sum(sizes)
    width: int  # the gradient columns (without the counts)
    dtype: torch.dtype
    device: torch.device
    even: bool  # no parameter is padded: the gradients concatenate in one kernel
    ones: torch.Tensor  # (world, len(params)) of ones: the counts when every grad is there
    name: str | None  # a bucket's name in reports; None: the unit's own
    ready: int = 0  # gradients arrived in this round (grad_ready)
    all_used: bool = False  # this rank had a gradient for every parameter (this reduction)
    partial: torch.Tensor | None = None  # reduce-scattered, not yet all-reduced (HSDP)
    division: Division | None = None  # of the reduction in flight
    inflight: _InFlight | None = field(default=None, repr=False)
    # Per pattern of used parameters, its counts on the device: a copy from the host would
    # make the host wait for the stream (pageable memory) in every such backward.
    _counts: dict[tuple[bool, ...], torch.Tensor] = field(default_factory=dict, repr=False)

    def label(self, owner: str) -> str:
        """This reduction in reports: the unit's name (``owner``), with a bucket's own."""
        return owner if self.name is None else f"{self.name} in {owner}"

    def used_counts(self, used: list[bool]) -> torch.Tensor:
        """``used`` as counts (1 or 0 per parameter) on the reduction's device."""
        key = tuple(used)
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = torch.tensor(used, dtype=self.dtype).to(self.device)
        return counts


@dataclass
class _Layout:
    """The reductions for one set of trainable parameters, and each parameter's."""

    reductions: list[_Reduction]
    of_param: dict[int, _Reduction]  # id(FSDPParam) -> its reduction


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
        self._layouts: dict[tuple[bool, ...], _Layout] = {}
        self._round: _Layout | None = None  # the layout of the open round
        self._launched = 0  # reductions of the open round launched so far, in order
        self._reducing: list[_Reduction] = []
        self._premul_sum: bool | None = None  # the shard group's backend has PREMUL_SUM

    @property
    def world(self) -> int:
        return self.groups.world

    @property
    def open(self) -> bool:
        """A round is open: some gradient arrived or some reduction was launched."""
        return self._round is not None

    def forget_layout(self) -> None:
        """The parameters' dtypes may have changed (``module._apply``): lay out again."""
        self._layouts.clear()

    def reductions(self) -> list[list[FSDPParam]]:
        """The parameters of each reduction for the current trainable parameters, in launch
        order (``replicate``'s buckets)."""
        return [red.params for red in self._layout().reductions]

    def stash(self) -> None:
        """Gradient sync is off: keep accumulating unsharded gradients (reduce dtype)."""
        for p in self.params:
            p.stash_grad()

    def zero_missing(self) -> None:
        """``set_reduce_scatter_unused_params``: a trainable parameter this rank did not use
        contributes zeros, so every rank reduces it and it ends with a zero gradient
        (parameters of reductions already launched in this round were reduced as they were)."""
        launched = self._round.reductions[: self._launched] if self._round is not None else []
        done = {id(p) for red in launched for p in red.params}
        for p in self.params:
            unsharded = p.unsharded
            missing = unsharded is not None and unsharded.grad is None and p.accumulated is None
            if p.sharded.requires_grad and missing and id(p) not in done:
                p.zero_unsharded_grad()

    def _layout(self) -> _Layout:
        """The reduce layout for the current trainable parameters.

        Frozen parameters take no part; the layout depends only on ``requires_grad``,
        which is the same on every rank, so all ranks issue the same collectives.
        """
        key = tuple(p.sharded.requires_grad for p in self.params)
        layout = self._layouts.get(key)
        if layout is None:
            trainable = [
                p
                for p, wanted in zip(self.params, key, strict=True)
                if wanted and p.reduce_dtype is not None
            ]
            cap = self.settings.bucket_cap_bytes
            if cap is None:
                by_dtype: dict[torch.dtype, list[FSDPParam]] = {}
                for p in trainable:
                    by_dtype.setdefault(p.reduce_dtype, []).append(p)  # type: ignore[arg-type]
                reductions = [self._reduction(ps, None) for ps in by_dtype.values()]
            else:
                buckets = _buckets(trainable[::-1], cap)
                reductions = [
                    self._reduction(ps, f"{self.settings.api_name} bucket {i} ({ps[0].fqn!r}...)")
                    for i, ps in enumerate(buckets)
                ]
            of_param = {id(p): red for red in reductions for p in red.params}
            layout = self._layouts[key] = _Layout(reductions, of_param)
        return layout

    def _reduction(self, params: list[FSDPParam], name: str | None) -> _Reduction:
        dtype = params[0].reduce_dtype
        assert dtype is not None
        device = params[0].device
        sizes = [p.padded_numel for p in params]
        # One element, expanded: the counts column costs no memory between steps.
        ones = torch.ones((), dtype=dtype, device=device).expand(self.world, len(params))
        width = sum(sizes)
        sizes.append(len(params))
        even = all(p.even for p in params)
        return _Reduction(
            params, sizes, width + len(params), width, dtype, device, even, ones, name
        )

    def _division(self, dtype: torch.dtype) -> Division:
        if self._premul_sum is None:  # NCCL has PREMUL_SUM; a mixed group names it too
            shard = self.groups.shard
            backend = "" if shard is None else str(dist.get_backend(shard))
            self._premul_sum = "nccl" in backend and self.params[0].device.type == "cuda"
        return gradient_division(
            self.world,
            self.groups.replicate_world,
            dtype,
            self.settings.gradient_divide_factor,
            self.settings.force_sum_reduction_for_comms,
            self._premul_sum,
        )

    # --- launching ------------------------------------------------------------------------

    def grad_ready(self, param: FSDPParam, owner: str) -> None:
        """``param``'s gradient for this round has arrived: launch, in order, every
        reduction whose gradients have all arrived (a later one waits for earlier ones)."""
        if self._round is None:
            self._round = self._layout()
        red = self._round.of_param.get(id(param))
        if red is None:  # frozen when the round began: it takes no part
            return
        red.ready += 1
        reductions = self._round.reductions
        while self._launched < len(reductions):
            nxt = reductions[self._launched]
            if nxt.ready < len(nxt.params):
                return
            self._launch(nxt, owner)
            self._launched += 1

    def start(self, owner: str) -> None:
        """Launch every reduction of this round not launched yet, with whatever gradients
        there are (zeros and a zero count for the missing ones).

        The counts are divided along with the gradients: only their sign is read.
        """
        if self._round is None:
            self._round = self._layout()
        reductions = self._round.reductions
        for red in reductions[self._launched :]:
            self._launch(red, owner)
        self._launched = len(reductions)

    def _launch(self, red: _Reduction, owner: str) -> None:
        """Pack ``red``'s gradients and counts and issue its first collective."""
        name = red.label(owner)
        comm = self.settings.reduce_scatter_comm
        matrix = allocate(comm, (self.world, red.columns), red.dtype, red.device)
        grads = [p.take_grad() for p in red.params]
        used = [g is not None for g in grads]
        red.all_used = False not in used  # then every count is positive: none is read
        if red.even and red.all_used:  # one kernel
            views = [g.reshape(self.world, -1) for g in grads]  # type: ignore[union-attr]
            torch.cat([*views, red.ones], dim=1, out=matrix)
        else:
            *columns, counts = matrix.split_with_sizes(red.sizes, dim=1)
            for p, g, column in zip(red.params, grads, columns, strict=True):
                p.copy_grad_in(g, column)
            counts.copy_(red.used_counts(used))  # broadcast over rows
        red.division = division = self._division(red.dtype)
        divide_(matrix, division.pre)
        if division.scale is not None:
            matrix.mul_(division.scale)
        if self.groups.shard is None:  # nothing to scatter: straight across the replicas
            out = matrix.view(-1)
            deferred, work = self._across_replicas(red, out, name)
            red.inflight = _InFlight(out, work, matrix, across=True, deferred=deferred)
        else:
            out, work = reduce_scatter_segments(
                matrix, self.groups.shard, name, division.scatter_op, comm
            )
            red.inflight = _InFlight(out, work, matrix, across=False)
        self._reducing.append(red)

    def _across_replicas(
        self, red: _Reduction, out: torch.Tensor, name: str
    ) -> tuple[bool, dist.Work | None]:
        """After the reduce-scatter: divide, add a deferred partial sum, and start the
        all-reduce across replicas. Returns (deferred, work); deferred: kept as the partial
        sum for a later step (``requires_all_reduce`` off), nothing issued."""
        assert red.division is not None
        divide_(out, red.division.between)
        if red.partial is not None:
            out += red.partial
            red.partial = None
        if self.groups.replicate is None:
            return False, None
        if not self.settings.requires_all_reduce:
            red.partial = out  # all-reduced with a later step's gradients
            return True, None
        return False, all_reduce(out, self.groups.replicate, name, red.division.all_reduce_op)

    # --- finishing ------------------------------------------------------------------------

    def finish_scatter(self, owner: str) -> bool:
        """Close the round and wait for its reduce-scatters. Where an all-reduce across
        replicas follows (HSDP), issue it and leave it in flight for :meth:`finish`, so
        the backward run in between hides it; finish the other reductions. True when an
        all-reduce was left in flight."""
        if self._round is None and not self._reducing:
            return False
        reducing, self._reducing = self._reducing, []
        self._close_round()
        finished = []
        for red in reducing:
            flight = red.inflight
            assert flight is not None
            if flight.across or self.groups.replicate is None:
                finished.append(red)  # one collective, or none across replicas
                continue
            name = red.label(owner)
            spmd.wait(flight.work, "reduce_scatter", name)
            deferred, work = self._across_replicas(red, flight.out, name)
            red.inflight = _InFlight(flight.out, work, flight.out, across=True, deferred=deferred)
            self._reducing.append(red)
        self._complete(finished, owner)
        return bool(self._reducing)

    def finish(self, owner: str) -> None:
        """Wait for the launched reductions, accumulate into the sharded gradients, and
        close the round."""
        if self._round is None and not self._reducing:  # the common case: every forward
            return
        reducing, self._reducing = self._reducing, []
        self._close_round()
        self._complete(reducing, owner)

    def _complete(self, reducing: list[_Reduction], owner: str) -> None:
        """Wait for ``reducing``'s collectives and accumulate their results."""
        for red in reducing:
            name = red.label(owner)
            out = self._wait(red, name)
            if out is not None:
                self._accumulate(red, out)
        for red in reducing:  # gradients copied to the host: ready before anyone reads them
            for p in red.params:
                p.wait_grad_copy()

    def _wait(self, red: _Reduction, name: str) -> torch.Tensor | None:
        """Wait for ``red``'s collectives (issuing the all-reduce across replicas after a
        reduce-scatter); its reduced row, or None when deferred (``requires_all_reduce``)."""
        flight = red.inflight
        assert flight is not None
        red.inflight = None
        if flight.across:
            spmd.wait(flight.work, "all_reduce", name)
            return None if flight.deferred else flight.out
        spmd.wait(flight.work, "reduce_scatter", name)
        deferred, work = self._across_replicas(red, flight.out, name)
        spmd.wait(work, "all_reduce", name)
        return None if deferred else flight.out

    def _accumulate(self, red: _Reduction, out: torch.Tensor) -> None:
        """Run the all-reduce hook, divide, and add each parameter's part (if any rank
        produced a gradient for it) to its sharded gradient."""
        assert red.division is not None
        if self.settings.all_reduce_hook is not None:
            self._run_all_reduce_hook(out[: red.width])
        divide_(out, red.division.post)
        *chunks, counts_chunk = out.split_with_sizes(red.sizes)
        counts = [1] * len(red.params) if red.all_used else counts_chunk.tolist()
        for p, chunk, count in zip(red.params, chunks, counts, strict=True):
            if count > 0:
                p.accumulate_sharded_grad(chunk)

    def _close_round(self) -> None:
        if self._round is not None:
            for red in self._round.reductions:
                red.ready = 0
        self._round = None
        self._launched = 0

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
        included), and close the round."""
        for red in self._reducing:
            if red.inflight is not None and red.inflight.work is not None:
                red.inflight.work.wait()
            red.inflight = None
        self._reducing = []
        self._close_round()
        for layout in self._layouts.values():
            for red in layout.reductions:
                red.partial = None
        for p in self.params:
            p.take_grad()  # clears the unsharded gradient and the no-sync accumulator


def _buckets(params: list[FSDPParam], cap_bytes: int) -> list[list[FSDPParam]]:
    """``params`` in order, packed into buckets of one reduce dtype and device of at most
    ``cap_bytes`` (the first at most 1 MiB); a parameter larger than the cap gets its own."""
    buckets: list[list[FSDPParam]] = []
    current: list[FSDPParam] = []
    current_bytes = 0
    limit = min(cap_bytes, _FIRST_BUCKET_BYTES)
    for p in params:
        assert p.reduce_dtype is not None
        nbytes = p.padded_numel * p.reduce_dtype.itemsize
        first = current[0] if current else None
        same_kind = first is not None and (first.reduce_dtype, first.device) == (
            p.reduce_dtype,
            p.device,
        )
        if current and (not same_kind or current_bytes + nbytes > limit):
            buckets.append(current)
            current, current_bytes, limit = [], 0, cap_bytes
        current.append(p)
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets
