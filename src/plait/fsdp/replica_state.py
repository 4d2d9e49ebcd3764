"""The state of a ``replicate`` unit: ``FSDPState`` plus what data parallelism without
sharding adds on top of it.

A ``replicate`` unit runs through the same hooks and root pass as any ``fully_shard`` unit
(``state.FSDPState``; both kinds can sit in one tree). What differs:

* gradients are reduced in buckets, each launched as soon as all its gradients have been
  accumulated (the parameters' post-accumulate-grad hooks call :meth:`grad_arrived`), in
  order on every rank; the unit's post-backward launches the buckets still waiting, and so
  does the end of backward for a unit whose round is open (see ``reduce.py``); all are
  waited for at the end of backward. They are not counted against the root's limit of
  reductions in flight: like DDP's, they hold no more memory than the gradients they
  replace;
* a backward that raised leaves its end-of-backward work undone: the root's next forward
  forgets that step (``reset_iter_state``) instead of requiring the call;
* ``fully_shard`` or ``replicate`` applied to a submodule after ``replicate`` would reduce
  its parameters twice: refused at the first forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from plait import hooks
from plait.contract import get_registry
from plait.fsdp.param import FSDPParam
from plait.fsdp.state import FSDPState

__all__ = ["Bucket", "ReplicateState"]

_REDUCING_APIS = ("fully_shard", "replicate")


@dataclass(frozen=True)
class Bucket:
    """One all-reduce of a ``replicate`` unit: its parameters (the module's, in order)."""

    params: list[nn.Parameter]


class ReplicateState(FSDPState):
    """The state of one ``replicate`` call (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        # ids of the submodules managed by fully_shard or replicate when replicate was
        # applied (their parameters are theirs); the first forward checks none appeared since.
        self.managed_at_apply: set[int] = set()
        self._checked_inside = False

    @property
    def buckets(self) -> list[Bucket]:
        """The unit's all-reduces for its current trainable parameters, in launch order."""
        if self.unit is None:
            return []
        return [Bucket([p.sharded for p in ps]) for ps in self.unit.reduction.reductions()]

    @property
    def in_backward(self) -> bool:
        """A backward queued the root's end-of-backward work and has not run it (True after
        a backward that raised, until the next forward)."""
        root = self.root
        return root is not None and root.root_pass is not None and root.root_pass.callback_queued

    # --- hooks -------------------------------------------------------------------------------

    def grad_arrived(self, param: FSDPParam) -> None:
        """Post-accumulate-grad hook of the unit's parameters: count the gradient towards
        its bucket, launching every bucket that is complete (in order)."""
        unit = self.unit
        if unit is None or self.root is None or not self.settings.requires_gradient_sync:
            return
        self._root_pass().queue_finish()  # first: it refuses compiled autograd
        unit.reduction.grad_ready(param, unit.owner)

    def lazy_init(self, states_in_tree: list[FSDPState]) -> None:
        for state in states_in_tree:
            if isinstance(state, ReplicateState):
                state.refuse_apis_applied_inside()
        super().lazy_init(states_in_tree)
        assert self.root_pass is not None
        self.root_pass.api_name = "replicate"

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """As ``FSDPState.pre_forward``; a root first forgets a step whose backward raised
        (checkpoint recomputation runs inside backward: it must not)."""
        root_pass = self.root_pass
        stale = self.is_root and root_pass is not None and root_pass.callback_queued
        if stale and root_pass is not None and not hooks.in_backward():
            root_pass.reset()
        return super().pre_forward(module, args, kwargs)

    def reduce_or_stash(self) -> None:
        """The unit's backward is done: launch the buckets still waiting (or stash, with
        gradient sync off). Not while another forward's backward of the unit is to come
        (a module called twice): its gradients are not all accumulated yet."""
        unit = self.unit
        if unit is None or self.backwards_owed > 0:
            return
        if not self.settings.requires_gradient_sync:
            unit.stash_grads()
            return
        if self.settings.reduce_scatter_unused_params:
            unit.reduction.zero_missing()
        unit.reduce_grads()  # waited for at the end of backward, with the hooks' buckets

    def catch_up_backward(self) -> None:
        """End of backward: as ``FSDPState``'s, and a round some gradients opened is
        launched whole, so every rank issues every bucket."""
        super().catch_up_backward()
        unit = self.unit
        if unit is not None and unit.reduction.open and self.settings.requires_gradient_sync:
            unit.reduce_grads()

    # --- checks ------------------------------------------------------------------------------

    def refuse_apis_applied_inside(self) -> None:
        """Raise if ``fully_shard`` / ``replicate`` was applied to a submodule after
        ``replicate`` took its parameters (they would be reduced twice)."""
        if self._checked_inside or self.module is None:
            return
        for name, sub in self.module.named_modules():
            registry = get_registry(sub)
            if sub is self.module or id(sub) in self.managed_at_apply or registry is None:
                continue
            for api in _REDUCING_APIS:
                if api in registry:
                    raise RuntimeError(
                        f"{api} was applied to {name!r} inside the replicate-d "
                        f"{type(self.module).__name__} after replicate, which had already taken "
                        f"its parameters. Apply {api} to the submodules first, then replicate "
                        "to the parent (replicate leaves their parameters to them)."
                    )
        self._checked_inside = True
