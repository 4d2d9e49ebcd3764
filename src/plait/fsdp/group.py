"""A unit of ``fully_shard``: the parameters one call manages, gathered and freed together.

* ``unshard`` issues one all-gather of every rank's *segment* (its padded chunks back to
  back; as bytes when the unit mixes dtypes or pads, so any parameters travel together)
  and ``wait_for_unshard`` copies the result into the unsharded parameters and puts them
  on the modules. In the common case (one dtype, no padding) the unsharded parameters are
  views of one buffer, so this is one allocation and one split-copy kernel per unit;
* ``reshard`` puts the sharded DTensor parameters back and frees the unsharded storage;
  with a post-forward group (``reshard_after_forward=<int>``, ZeRO++ hpZ) resharding after
  forward keeps this rank's block of the gathered rows instead, so that backward's
  all-gather stays inside that smaller group;
* ``reduce_grads`` / ``finish_reduce`` reduce the gradients (``reduce.GradientReduction``).
"""

from __future__ import annotations

from enum import Enum, auto

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from plait import spmd
from plait.fsdp.collectives import Groups, all_gather_segments
from plait.fsdp.extensions import GatherExtension, has_extension
from plait.fsdp.param import FSDPParam
from plait.fsdp.reduce import GradientReduction
from plait.fsdp.settings import UnitSettings
from plait.hooks import traced

__all__ = ["FSDPParamGroup", "Groups", "ShardedState"]


class ShardedState(Enum):
    """Which form of its parameters a unit's modules hold.

    Only :class:`FSDPParamGroup` changes it: ``wait_for_unshard`` goes to ``UNSHARDED``
    (``unshard`` only issues the all-gather: the state changes when it is waited on);
    ``reshard`` goes back to ``SHARDED``, or to ``SHARDED_POST_FORWARD`` when called after
    forward (``post_forward=True``) on a unit whose last all-gather kept a block for its
    post-forward group (``prepare_post_forward``); ``discard_inflight`` ends in ``SHARDED``.
    """

    SHARDED = auto()
    """The modules hold the sharded DTensor parameters; no unsharded storage is alive."""
    SHARDED_POST_FORWARD = auto()
    """As ``SHARDED``, but this rank also keeps the block of gathered rows it serves in its
    post-forward group (``reshard_after_forward=<int>``): the next unshard (backward's)
    all-gathers inside that smaller group."""
    UNSHARDED = auto()
    """The modules hold the full (unsharded) parameters, views of the unit's buffer."""


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` unit and their collectives.

    Owns the parameters' swaps between sharded and unsharded forms (its
    :class:`ShardedState`), the all-gather that produces the unsharded ones, and, through
    its :class:`~plait.fsdp.reduce.GradientReduction`, the reduction of their gradients.
    It knows nothing of modules' forward and backward: ``state.FSDPState`` decides when
    each operation runs. ``settings`` is the unit's :class:`UnitSettings`, shared with its
    state.
    """

    def __init__(self, params: list[FSDPParam], groups: Groups, settings: UnitSettings) -> None:
        self.params = params
        self.groups = groups
        self.settings = settings
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
        self.reduction = GradientReduction(params, groups, settings)
        # Parameters with all-gather extensions (extensions.py), found at the first unshard
        # (hooks may be patched on after fully_shard); ``None``: not looked for yet.
        self._extensions: dict[FSDPParam, GatherExtension] | None = None
        self._plain_order: list[FSDPParam] = []  # gather_order without them
        self.lay_out()
        self.sharded_state = ShardedState.SHARDED
        self._gather: tuple[torch.Tensor, dist.Work | None] | None = None  # (world, segment)
        self._post_forward_rows: torch.Tensor | None = None  # (world / k, segment) bytes
        self._keep_block = False  # the next unshard feeds a post-forward reshard
        self.owner = "a fully_shard unit"  # named by the root at lazy init (spmd reports)

    @property
    def world(self) -> int:
        return self.groups.world

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def busy(self) -> bool:
        """An all-gather is in flight (the modules are about to receive full parameters)."""
        return self._gather is not None

    # The flags the pipeline's gradient sync turns off for a step and restores after it
    # (``pipeline/grad_sync.py`` reaches them here): they live in the unit's settings.

    @property
    def requires_gradient_sync(self) -> bool:
        return self.settings.requires_gradient_sync

    @requires_gradient_sync.setter
    def requires_gradient_sync(self, value: bool) -> None:
        self.settings.requires_gradient_sync = value

    @property
    def reshard_after_backward(self) -> bool:
        return self.settings.reshard_after_backward

    @reshard_after_backward.setter
    def reshard_after_backward(self, value: bool) -> None:
        self.settings.reshard_after_backward = value

    @property
    def gradient_divide_factor(self) -> float | None:
        return self.settings.gradient_divide_factor

    # --- unshard / reshard ---------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Issue the all-gather unless the unit is unsharded or already being gathered.

        The gather, the copy-out and the unsharded storage are the unit's own, not part of
        the model's computation: they run outside functorch's transforms (a forward under
        ``torch.func.jvp`` or ``vmap`` gathers plain tensors, which the transform then
        treats as constants, and a later reshard can free them)."""
        with torch._C._DisableFuncTorch():
            self._unshard(async_op)

    def _unshard(self, async_op: bool) -> None:
        if self.sharded_state is not ShardedState.UNSHARDED and self._gather is None:
            if self._extensions is None:
                self._find_extensions()
            if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
                self._gather = self._gather_post_forward()
            elif self._extensions:
                self._gather = self._gather_with_extensions()
            else:
                self._gather = all_gather_segments(
                    self._segment(),
                    self.groups.shard,
                    self.world,
                    self.owner,
                    self.settings.all_gather_comm,
                )
        if not async_op:
            self._wait_for_unshard()

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
        self.reduction.forget_layout()  # reduce dtypes may have changed
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
            self.settings.all_gather_comm,
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
        self._extensions = {
            p: GatherExtension(p, self.world, self.settings.mp_policy) for p in found
        }
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
            row, self.groups.shard, self.world, self.owner, self.settings.all_gather_comm
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
        """Finish an issued all-gather (issuing one if needed) and swap in full parameters
        (outside functorch's transforms, as :meth:`unshard`)."""
        if self.sharded_state is ShardedState.UNSHARDED:
            return  # every forward asks; no context to enter then
        with torch._C._DisableFuncTorch():
            self._wait_for_unshard()

    def _wait_for_unshard(self) -> None:
        if self.sharded_state is ShardedState.UNSHARDED:
            return
        if self._gather is None:
            self._unshard(async_op=True)
        assert self._gather is not None
        gathered, work = self._gather
        self._gather = None
        with traced("plait.fsdp.copy_out", self.owner):
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

    # --- parameters replaced on the modules ---------------------------------------------------

    def adopt_replacements(self) -> None:
        """Take in parameters the user replaced on the modules while the unit is sharded."""
        if self.sharded_state is ShardedState.SHARDED and not self.busy:
            relaid = [p.adopt_replacement() for p in self.params]  # every one, no short cut
            if any(relaid):
                self.lay_out()

    def adopt_materialised(self) -> None:
        """Meta init: take in real full tensors the user assigned in place of parameters
        that are still on the meta device (e.g. a root parameter computed from its
        children's weights after their ``to_empty``), of which each rank keeps its own
        shard, and real shards in the unit's layout (a loader that assigns DTensors)."""
        changed = False
        for p in self.params:
            loc = p.locations[0]
            current = loc.module._parameters.get(loc.name)
            if not p.padded.is_meta or current is None or current is p.sharded:
                continue
            if p.same_layout(current):  # a loader assigned this rank's shard itself
                changed |= p.adopt_replacement()
                continue
            if isinstance(current, DTensor):
                continue  # another layout: adopt_replacement reports it
            if current.is_meta or current.shape != p.global_shape:
                continue  # still meta, or a mistake adopt_replacement reports
            layout = p.sharded
            assert isinstance(layout, DTensor)
            shard = distribute_tensor(
                current.detach(), layout.device_mesh, layout.placements, src_data_rank=None
            )
            p.set_on_modules(nn.Parameter(shard, requires_grad=current.requires_grad))
            p.reset_sharded()
            changed = True
        if changed:
            self.lay_out()

    # --- gradient reduction (reduce.py) ------------------------------------------------------

    def stash_grads(self) -> None:
        """Gradient sync is off: keep accumulating unsharded gradients (reduce dtype)."""
        self.reduction.stash()

    def reduce_grads(self) -> None:
        """Finish the previous reduction, then issue the reduce-scatter(s) of the
        accumulated unsharded gradients."""
        self.finish_reduce()
        self.reduction.start(self.owner)

    def finish_reduce(self) -> None:
        """Wait for issued reductions and accumulate into the sharded gradients."""
        self.reduction.finish(self.owner)

    def reduce_across(self) -> bool:
        """Wait for the issued reduce-scatters, issue HSDP's all-reduces across replicas
        and leave those in flight (``finish_reduce`` completes them); True if any is."""
        return self.reduction.finish_scatter(self.owner)

    def discard_inflight(self) -> None:
        """Recovery after an exception (``reset_iter_state``): wait for the collectives
        already issued, drop their results and every gradient not yet reduced (the failed
        step's, no-sync accumulation and HSDP partial sums included), and reshard."""
        if self._gather is not None:
            _, work = self._gather
            self._gather = None
            if work is not None:
                work.wait()
        self.reduction.discard()
        self._post_forward_rows = None
        self.reshard()
