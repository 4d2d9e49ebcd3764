"""Data parallelism inside pipeline stages: when to gather, free and reduce.

A stage module may be (or contain) ``fully_shard`` units or ``replicate`` modules over a
data-parallel group (a ``replicate`` module is a unit too: one whose shard group is this
rank alone). Left to their own hooks they would communicate once per microbatch;
in a pipeline the schedule decides instead (its ``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD``
actions, see :func:`~plait.pipeline.schedules.add_fsdp_actions`):

* for the step, gradient sync is off and units neither reshard after forward nor after
  backward, so their hooks only accumulate gradients; after every backward action the
  runtime moves each microbatch's gradients into the units' accumulators, in the reduce
  dtype (:meth:`StageGradSync.stash_grads`): with a bf16 ``MixedPrecisionPolicy`` the sum
  over microbatches is then exact in fp32, also for the weight gradients that a split
  backward's ``W`` adds to ``.grad`` by hand (no hook sees those);
* ``UNSHARD`` issues the all-gather of every unit of the stage and ``RESHARD`` frees
  them: the parameters are full in between. The gathers are awaited just before the
  stage's next compute (:meth:`StageGradSync.wait_unshard`), as torch's runtime does, so an
  UNSHARD placed ahead (``max_active_stages``) overlaps the computes before it;
* ``REDUCE_GRAD`` reduces the accumulated gradients once: one reduce-scatter per unit,
  one all-reduce per ``replicate`` bucket;
* after the step, the flags are restored.

This is the one place where the pipeline reaches below the public APIs of
``fully_shard`` / ``replicate`` (as torch's pipelining does): neither has a public "reduce
the accumulated gradients now" call, because outside a pipeline the last backward does it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from plait.fsdp.api import FSDPModule, UnshardHandle, fsdp_states_in
from plait.fsdp.group import FSDPParamGroup
from plait.fsdp.state import FSDPState
from plait.hooks import traced

__all__ = ["StageGradSync"]


@dataclass(frozen=True)
class _FSDPFlags:
    reshard_after_forward: bool | None
    reshard_after_backward: bool
    requires_gradient_sync: bool


class StageGradSync:
    """The data-parallel modules of one stage module, driven by the schedule's actions."""

    def __init__(self, module: nn.Module) -> None:
        self.fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
        self.fsdp_units: list[tuple[FSDPState, FSDPParamGroup]] = [
            (s, s.unit) for s in fsdp_states_in(module) if s.unit is not None
        ]
        # Units whose gradients are accumulated in another dtype than the parameters'.
        self._stashing = [
            unit
            for _, unit in self.fsdp_units
            if any(p.reduce_dtype != p.param_dtype for p in unit.params)
        ]
        self._saved_fsdp: list[_FSDPFlags] = []
        self._gathering: list[UnshardHandle] = []  # issued by unshard, not yet awaited

    @property
    def active(self) -> bool:
        """True when the stage has anything to gather or reduce."""
        return bool(self.fsdp_units)

    def begin_step(self) -> None:
        self._saved_fsdp = [
            _FSDPFlags(
                s.reshard_after_forward, unit.reshard_after_backward, unit.requires_gradient_sync
            )
            for s, unit in self.fsdp_units
        ]
        for s, unit in self.fsdp_units:
            s.reshard_after_forward = False
            unit.reshard_after_backward = False
            unit.requires_gradient_sync = False

    def end_step(self) -> None:
        # A step that failed may leave a gather issued: the unit completes it when it
        # next reshards or unshards (waiting here could wait on a peer that died).
        self._gathering = []
        for (s, unit), f in zip(self.fsdp_units, self._saved_fsdp, strict=True):
            # A unit first run inside the pipeline never resolved its default: keep False.
            if f.reshard_after_forward is not None:
                s.reshard_after_forward = f.reshard_after_forward
            unit.reshard_after_backward = f.reshard_after_backward
            unit.requires_gradient_sync = f.requires_gradient_sync
        self._saved_fsdp = []

    def unshard(self) -> None:
        """Issue every unit's all-gather; :meth:`wait_unshard` completes them."""
        with traced("plait.pipeline.unshard"):
            for m in self.fsdp_modules:
                handle = m.unshard(async_op=True)
                if handle is not None:
                    self._gathering.append(handle)

    def wait_unshard(self) -> None:
        """Complete the all-gathers :meth:`unshard` issued (none pending: nothing)."""
        if self._gathering:
            with traced("plait.pipeline.wait_unshard"):
                for handle in self._gathering:
                    handle.wait()
                self._gathering = []

    def stash_grads(self) -> None:
        """After a backward action (B, I or W): move the unsharded gradients it left in
        ``.grad`` (parameter dtype) into the units' reduce-dtype accumulators."""
        for unit in self._stashing:
            unit.stash_grads()

    def reshard(self) -> None:
        self.wait_unshard()  # a gather still in flight writes into what reshard frees
        with traced("plait.pipeline.reshard"):
            for m in self.fsdp_modules:
                m.reshard()

    def reduce_grads(self) -> None:
        """Reduce the gradients accumulated over the step's microbatches, once."""
        with traced("plait.pipeline.reduce_grad"):
            for _, unit in self.fsdp_units:
                unit.reduce_grads()
            for _, unit in self.fsdp_units:
                unit.finish_reduce()
