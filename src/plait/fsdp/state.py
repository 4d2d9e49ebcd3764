"""The per-call state of ``fully_shard`` and the hooks that drive a unit through a step.

Timeline of one training step, for a unit U under a root R:

1. ``pre_forward`` (forward pre-hook): R lazily initialises on its first forward; U waits
   for its all-gather (issued earlier by a prefetch, or now), prefetches the next unit in
   forward order, and wraps its tensor inputs so that their gradient marks the end of U's
   backward (``_PostBackward``).
2. ``post_forward`` (forward hook): U reshards if ``reshard_after_forward`` (always under
   ``no_grad``), and hooks its outputs so that their first gradient triggers
   ``pre_backward``.
3. ``pre_backward``: U is unsharded again (prefetching the unit that comes next in
   backward) and R's end-of-backward callback is queued.
4. ``post_backward`` (when U's input gradients are computed): U reduce-scatters its
   gradients and reshards. At most one unit's reduction is left in flight, so memory stays
   bounded.
5. ``finish_backward`` (R, once per backward): runs ``post_backward`` for units whose
   inputs needed no gradient (their step 4 never fired), waits for all reductions and
   reshards everything, in a fixed order so all ranks issue the same collectives.

Forwards that run *inside* backward (activation-checkpoint recomputation) only make sure
the unit is unsharded; they register nothing and reshard nothing.
"""

from __future__ import annotations

from enum import Enum, auto
from itertools import pairwise
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from plait import spmd
from plait.contract import APIState
from plait.fsdp.group import FSDPParamGroup, ShardedState
from plait.fsdp.policies import MixedPrecisionPolicy
from plait.hooks import in_backward, queue_end_of_backward, traced


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class FSDPState(APIState):
    def __init__(self) -> None:
        self.module: nn.Module | None = None
        self.unit: FSDPParamGroup | None = None
        self.reshard_after_forward: bool | None = None
        self.mp_policy = MixedPrecisionPolicy()
        # conditional=True: the unit may not run on every rank in a step. Its collectives
        # then run at fixed points instead: all-gather when its parent unit unshards,
        # reduce-scatter (zeros where it did not run) at the end of backward.
        self.conditional = False
        self.conditional_children: list[FSDPState] = []
        self.is_root: bool | None = None
        self.root: FSDPState | None = None
        self.training_state = TrainingState.IDLE
        self.backwards_owed = 0  # forwards with grad whose post_backward has not run yet
        self.forward_prefetch: list[FSDPState] | None = None  # explicit, else implicit order
        self.backward_prefetch: list[FSDPState] | None = None
        # root only
        self.all_states: list[FSDPState] = []
        self.forward_order: list[FSDPState] = []  # pre-forward order of units with params
        self.post_forward_order: list[FSDPState] = []  # its reverse is the backward order
        # Implicit prefetch targets, derived from the two orders once they are recorded.
        self.next_in_forward: dict[int, FSDPState] = {}
        self.next_in_backward: dict[int, FSDPState] = {}
        self.recording_order = False
        self.callback_queued = False
        self.is_last_backward = True
        self.reducing: FSDPParamGroup | None = None  # the unit whose reduction is in flight

    @property
    def name(self) -> str:
        return type(self.module).__name__

    # --- lazy initialisation ------------------------------------------------------------

    def lazy_init(self, states_in_tree: list[FSDPState]) -> None:
        """Become the root of every ``fully_shard`` state in this module's subtree."""
        for state in states_in_tree[1:]:
            if state.is_root is not None:
                raise RuntimeError(
                    f"fully_shard: the unit on {state.name} already ran its own forward (it "
                    f"became a root) before its parent {self.name} did. Run forward through "
                    "the top-level module only, or call fully_shard on it last and never "
                    "call the submodule on its own before it."
                )
        self.is_root = True
        self.all_states = states_in_tree
        assert self.module is not None
        names = {id(m): name for name, m in self.module.named_modules()}
        for state in states_in_tree:
            state.root = self
            if state is not self:
                state.is_root = False
            if state.reshard_after_forward is None:
                state.reshard_after_forward = state is not self
            if state.unit is not None:
                state.check_params_materialised()
                name = names.get(id(state.module), state.name) or "<root>"
                state.unit.owner = f"fully_shard unit {name!r}"
        for state in states_in_tree:
            state.conditional_children = []
        _link_conditional_units(self.module, self, {id(s.module): s for s in states_in_tree})
        self.recording_order = True

    def check_params_materialised(self) -> None:
        assert self.unit is not None
        meta = [p.fqn for p in self.unit.params if p.padded.is_meta]
        if meta:
            raise RuntimeError(
                f"fully_shard: parameters of {self.name} are still on the meta device at the "
                f"first forward: {meta}. Call module.to_empty(device=...) and initialise them "
                "(e.g. reset_parameters()) after fully_shard and before the first forward."
            )
        self.adopt_replacements()

    def adopt_replacements(self) -> None:
        """Take in parameters the user replaced on the modules while the unit is sharded."""
        unit = self.unit
        if unit is not None and unit.sharded_state is ShardedState.SHARDED and not unit.busy:
            for p in unit.params:
                p.adopt_replacement()

    # --- forward ---------------------------------------------------------------------------

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if in_backward():  # recomputation under activation checkpointing
            if self.unit is not None:
                self.unit.wait_for_unshard()
            return None
        if self.is_root is None:
            from plait.fsdp.api import fsdp_states_in

            self.lazy_init(fsdp_states_in(module))
        root = self.root
        assert root is not None
        if self.is_root:
            self.root_pre_forward()
        elif root.training_state is not TrainingState.FORWARD:
            raise RuntimeError(
                f"fully_shard: forward was called on {self.name}, a non-root unit, outside its "
                f"root's ({root.name}) forward. Once the root has run, call forward through "
                "the root only (use register_fsdp_forward_method for other entry points)."
            )
        self.training_state = TrainingState.FORWARD
        grad = torch.is_grad_enabled()
        if self.unit is not None:
            if root.recording_order and not self.conditional:
                root.forward_order.append(self)
            with traced("plait.fsdp.pre_forward"):
                self.unit.prepare_post_forward(grad and bool(self.reshard_after_forward))
                self.unit.wait_for_unshard()
                for target in self.prefetch_targets(forward=True):
                    target.unit.unshard(async_op=True)  # type: ignore[union-attr]
        for child in self.conditional_children:  # every rank gathers them, run or not
            child.unit.unshard(async_op=True)  # type: ignore[union-attr]
        dtype = self.mp_policy.param_dtype
        cast = dtype is not None and self.mp_policy.cast_forward_inputs
        if cast:
            assert dtype is not None
            args, kwargs = _cast_floats((args, kwargs), dtype)
        wrapped = _PostBackward.wrap_inputs(self, args, kwargs) if grad else None
        return wrapped or ((args, kwargs) if cast else None)

    def root_pre_forward(self) -> None:
        self.training_state = TrainingState.FORWARD
        for state in self.all_states:  # reductions left open by set_is_last_backward(False)
            if state.unit is not None:
                state.unit.finish_reduce()

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if in_backward():
            return output
        grad = torch.is_grad_enabled()
        resharding = not grad or bool(self.reshard_after_forward)
        if self.unit is not None and not self.conditional and resharding:
            self.unit.reshard(post_forward=grad)
        if not grad:
            for child in self.conditional_children:
                child.unit.reshard()  # type: ignore[union-attr]
        if grad and self.unit is not None:
            self.backwards_owed += 1
        root = self.root
        assert root is not None
        if root.recording_order and self.unit is not None and not self.conditional:
            root.post_forward_order.append(self)
        if self.is_root and root.recording_order:
            root.recording_order = False
            root.derive_prefetch_order()
        self.training_state = TrainingState.IDLE
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        return self.hook_outputs(output) if grad else output

    def derive_prefetch_order(self) -> None:
        """Root only: map each unit to the one after it in forward and in backward."""
        fwd, post = self.forward_order, self.post_forward_order
        self.next_in_forward = {id(a): b for a, b in pairwise(fwd)}
        self.next_in_backward = {id(b): a for a, b in pairwise(post)}

    def hook_outputs(self, output: Any) -> Any:
        leaves = [output] if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self.pre_backward)
        return output

    def prefetch_targets(self, forward: bool) -> list[FSDPState]:
        if self.conditional:  # it does not run everywhere: it must not start collectives
            return []
        explicit = self.forward_prefetch if forward else self.backward_prefetch
        if explicit is not None:
            return [s for s in explicit if s.unit is not None]
        root = self.root
        if root is None or root.recording_order:
            return []
        following = root.next_in_forward if forward else root.next_in_backward
        target = following.get(id(self))
        return [] if target is None else [target]

    # --- backward --------------------------------------------------------------------------

    def pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return grad
        self.training_state = TrainingState.PRE_BACKWARD
        root = self.root
        assert root is not None
        if not root.callback_queued:
            root.callback_queued = True
            queue_end_of_backward(root.finish_backward)
        if self.unit is not None:
            with traced("plait.fsdp.pre_backward"):
                self.unit.wait_for_unshard()  # a conditional unit is still unsharded
                for target in self.prefetch_targets(forward=False):
                    target.unit.unshard(async_op=True)  # type: ignore[union-attr]
        return grad

    def post_backward(self) -> None:
        self.training_state = TrainingState.POST_BACKWARD
        if self.unit is None or self.backwards_owed == 0 or self.conditional:
            return  # a conditional unit reduces in finish_backward, on every rank
        self.backwards_owed -= 1
        with traced("plait.fsdp.post_backward"):
            self.reduce_or_stash()
            if self.unit.reshard_after_backward:
                self.unit.reshard()

    def reduce_or_stash(self) -> None:
        """Start this unit's gradient reduction, or keep accumulating with sync off."""
        assert self.unit is not None
        if not self.unit.requires_gradient_sync:
            self.unit.stash_grads()
            return
        root = self.root
        assert root is not None
        if root.reducing is not None:  # keep one reduction in flight at most
            root.reducing.finish_reduce()
        self.unit.reduce_grads()
        root.reducing = self.unit

    def finish_backward(self) -> None:
        """Root only: the end-of-backward callback (see the module docstring, step 5)."""
        with traced("plait.fsdp.finish_backward"):
            for state in reversed(self.all_states):
                if state.conditional and state.unit is not None:
                    state.backwards_owed = 0
                    state.reduce_or_stash()
                elif state.backwards_owed > 0:  # its inputs needed no gradient: reduce now
                    state.backwards_owed = 1
                    state.post_backward()
            for state in self.all_states:
                if state.unit is None:
                    continue
                if self.is_last_backward:
                    state.unit.finish_reduce()
                if state.unit.reshard_after_backward:
                    state.unit.reshard()
                state.training_state = TrainingState.IDLE
        if self.is_last_backward:
            self.reducing = None
        self.callback_queued = False
        self.training_state = TrainingState.IDLE
        spmd.check("end of a fully_shard backward")


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's tensor inputs; its backward is the unit's post-backward."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward()
        return (None, *grads)

    @staticmethod
    def wrap_inputs(
        state: FSDPState, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):  # common
            return (
                ((_PostBackward.apply(state, args[0])[0],), {}) if args[0].requires_grad else None
            )
        leaves, spec = tree_flatten((args, kwargs))
        positions = [
            i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        if not positions:
            return None
        wrapped = _PostBackward.apply(state, *(leaves[i] for i in positions))
        for i, tensor in zip(positions, wrapped, strict=True):
            leaves[i] = tensor
        new_args, new_kwargs = tree_unflatten(leaves, spec)
        return tuple(new_args), dict(new_kwargs)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (autograd-visible)."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def _link_conditional_units(
    module: nn.Module | None, enclosing: FSDPState, states: dict[int, FSDPState]
) -> None:
    """Give every conditional unit to the nearest enclosing unit, which gathers it."""
    assert module is not None
    for child in module.children():
        state = states.get(id(child), enclosing)
        new = all(state is not s for s in enclosing.conditional_children)
        if state.conditional and state is not enclosing and new:
            enclosing.conditional_children.append(state)
        _link_conditional_units(child, state, states)
