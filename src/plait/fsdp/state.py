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
   gradients and reshards. At most one unit's reduction is left in flight (see
   ``set_reduce_scatter_max_input_buffers``), so memory stays bounded.
5. ``finish_backward`` (R, once per backward): runs ``post_backward`` for the units this
   backward reached whose inputs needed no gradient (their step 4 never fired), waits for
   all reductions and reshards what no later backward still needs, in a fixed order so
   all ranks issue the same collectives.

A *forward pass* starts at the first unit whose forward begins while no pass is running:
normally the root, but after the root's forward has finished any unit may run (and
backward) on its own, as torch allows (a chunked loss calling the output head on chunks).

A unit made of several modules (``fully_shard([norm, head])``) unshards when the first of
them starts forward and finishes its forward when the last has run. If a pass ends with
some of them not run (the head skipped by a chunked loss), the pass finishes the unit
then; a module of the unit run alone afterwards leaves it unsharded until its backward.

Forwards that run *inside* backward (activation-checkpoint recomputation) only make sure
the unit is unsharded; they register nothing and reshard nothing.
"""

from __future__ import annotations

from enum import Enum, auto
from itertools import pairwise
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from plait import spmd
from plait.contract import APIState, get_registry
from plait.fsdp.cast import cast_floating, tensors_in
from plait.fsdp.group import FSDPParamGroup, ShardedState
from plait.fsdp.policies import MixedPrecisionPolicy
from plait.hooks import (
    CompiledAutogradError,
    in_backward,
    outside_graphs,
    queue_end_of_backward,
    traced,
)

_API_NAME = "fully_shard"  # the name ``contract`` registers the API under


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


def fsdp_state_of(module: nn.Module) -> FSDPState | None:
    """The ``fully_shard`` state of ``module`` itself, or ``None`` if it is not sharded."""
    registry = get_registry(module)
    item = None if registry is None else registry.get(_API_NAME)
    state = None if item is None else item.state
    return state if isinstance(state, FSDPState) else None


def fsdp_states_in(module: nn.Module) -> list[FSDPState]:
    """The ``fully_shard`` states in ``module``'s subtree, in pre-order (module first)."""
    states: list[FSDPState] = []
    seen: set[int] = set()  # modules of one list share a state
    for m in module.modules():
        state = fsdp_state_of(m)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            states.append(state)
    return states


class FSDPState(APIState):
    def __init__(self) -> None:
        self.modules: list[nn.Module] = []  # the modules of the call (usually one)
        self.unit: FSDPParamGroup | None = None
        self.param_uids: dict[str, int] = {}  # fqn -> identity of the original parameter
        self.reshard_after_forward: bool | None = None
        self.unshard_in_backward = True
        self.reduce_scatter_unused_params = False
        self.mp_policy = MixedPrecisionPolicy()
        # conditional=True: the unit may not run on every rank in a step. Its collectives
        # then run at fixed points instead: all-gather when its parent unit unshards,
        # reduce-scatter (zeros where it did not run) at the end of backward.
        self.conditional = False
        self.conditional_children: list[FSDPState] = []
        self.is_root: bool | None = None
        self.root: FSDPState | None = None
        self.training_state = TrainingState.IDLE
        self.modules_to_run: set[int] = set()  # several modules: those yet to run this pass
        self.backwards_owed = 0  # forwards with grad whose post_backward has not run yet
        self.forward_prefetch: list[FSDPState] | None = None  # explicit, else implicit order
        self.backward_prefetch: list[FSDPState] | None = None
        # root only
        self.all_states: list[FSDPState] = []
        self.forward_root: FSDPState | None = None  # the unit whose forward began the pass
        self.forward_order: list[FSDPState] = []  # pre-forward order of units with params
        self.post_forward_order: list[FSDPState] = []  # its reverse is the backward order
        # Implicit prefetch targets, derived from the two orders once they are recorded.
        self.next_in_forward: dict[int, FSDPState] = {}
        self.next_in_backward: dict[int, FSDPState] = {}
        self.recording_order = False
        self.callback_queued = False
        self.is_last_backward = True
        self.post_optim_event: Any = None  # waited on once, at the next forward pass
        self.max_input_buffers = 1  # set_reduce_scatter_max_input_buffers
        self.max_reductions_in_flight = 1  # root: the largest of its units'
        self.reducing: list[FSDPParamGroup] = []  # units whose reduction is in flight
        # What autograd calls: kept out of compiled graphs, as the forward hooks are (under
        # compiled autograd dynamo would trace them; see ``hooks.outside_graphs``).
        self.pre_backward_hook = outside_graphs(self.pre_backward, backward=True)
        self.post_backward_hook = outside_graphs(self.post_backward, backward=True)

    @property
    def module(self) -> nn.Module | None:
        """The first module of the call (the only one, unless a list was sharded)."""
        return self.modules[0] if self.modules else None

    @property
    def name(self) -> str:
        return ", ".join(type(m).__name__ for m in self.modules) or "<unsharded>"

    # --- lazy initialisation ------------------------------------------------------------

    def lazy_init(self, states_in_tree: list[FSDPState]) -> None:
        """Become the root of every ``fully_shard`` state in this module's subtree."""
        if len(self.modules) > 1:
            raise RuntimeError(
                f"fully_shard: the unit of several modules ({self.name}) ran forward before "
                "any unit containing them: a root must be one module. Call fully_shard on "
                "their parent too and run forward through it."
            )
        for state in states_in_tree[1:]:
            if state.is_root is not None:
                raise RuntimeError(
                    f"fully_shard: the unit on {state.name} already ran its own forward (it "
                    f"became a root) before its parent {self.name} did. Run forward through "
                    "the top-level module only, or call fully_shard on it last and never "
                    "call the submodule on its own before it."
                )
        _check_no_shared_params(states_in_tree)
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
                state.unit.mp_policy = state.mp_policy  # for all-gather extension hooks
                state.check_params_materialised()
                unit_names = [names.get(id(m), "") or "<root>" for m in state.modules]
                state.unit.owner = f"fully_shard unit {', '.join(unit_names)!r}"
        for state in states_in_tree:
            state.conditional_children = []
        by_module = {id(m): s for s in states_in_tree for m in s.modules}
        _link_conditional_units(self.module, self, by_module)
        self.max_reductions_in_flight = max(s.max_input_buffers for s in states_in_tree)
        self.recording_order = True

    def check_params_materialised(self) -> None:
        assert self.unit is not None
        if any(p.padded.is_meta for p in self.unit.params):
            self.adopt_materialised_replacements()
        meta = [p.fqn for p in self.unit.params if p.padded.is_meta]
        if meta:
            raise RuntimeError(
                f"fully_shard: parameters of {self.name} are still on the meta device at the "
                f"first forward: {meta}. Call module.to_empty(device=...) and initialise them "
                "(e.g. reset_parameters()) after fully_shard and before the first forward."
            )
        self.adopt_replacements()

    def adopt_materialised_replacements(self) -> None:
        """Meta init: take in real full tensors the user assigned in place of parameters
        that are still on the meta device (e.g. a root parameter computed from its
        children's weights after their ``to_empty``), of which each rank keeps its own
        shard, and real shards in the unit's layout (a loader that assigns DTensors)."""
        assert self.unit is not None
        changed = False
        for p in self.unit.params:
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
            self.unit.lay_out()

    def adopt_replacements(self) -> None:
        """Take in parameters the user replaced on the modules while the unit is sharded."""
        unit = self.unit
        if unit is not None and unit.sharded_state is ShardedState.SHARDED and not unit.busy:
            relaid = [p.adopt_replacement() for p in unit.params]
            if any(relaid):
                unit.lay_out()

    # --- forward ---------------------------------------------------------------------------

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if in_backward():  # recomputation under activation checkpointing
            if self.unit is not None:
                self.unit.wait_for_unshard()
            return self.cast_inputs(args, kwargs)
        if self.is_root is None:
            self.lazy_init(fsdp_states_in(module))
        root = self.root
        assert root is not None
        # The first module of the unit to run in this pass does the per-pass work; the
        # others of a several-module unit only cast their inputs.
        first = self.training_state is not TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        if first and len(self.modules) > 1:
            self.modules_to_run = {id(m) for m in self.modules}
        if first and (self.is_root or root.forward_root is None):
            root.begin_pass(self)
        grad = torch.is_grad_enabled()
        if self.unit is not None:
            with traced("plait.fsdp.pre_forward"):
                if first:
                    if root.recording_order and not self.conditional:
                        root.forward_order.append(self)
                    self.unit.prepare_post_forward(grad and bool(self.reshard_after_forward))
                self.unit.wait_for_unshard()
                if first:
                    for target in self.prefetch_targets(forward=True):
                        target.unit.unshard(async_op=True)  # type: ignore[union-attr]
            if first and grad:
                self.backwards_owed += 1
        if first:
            for child in self.conditional_children:  # every rank gathers them, run or not
                child.unit.unshard(async_op=True)  # type: ignore[union-attr]
        cast = self.cast_inputs(args, kwargs)
        if cast is not None:
            args, kwargs = cast
        wrapped = _PostBackward.wrap_inputs(self, args, kwargs) if grad and first else None
        return wrapped or cast

    def begin_pass(self, starter: FSDPState) -> None:
        """Root only: a forward pass starts at ``starter`` (the root, or a unit alone)."""
        self.forward_root = starter
        if starter is self:  # drop what an abandoned pass of a unit alone left behind
            for state in self.all_states:
                if state is not self and state.training_state is TrainingState.FORWARD:
                    state.training_state = TrainingState.IDLE
                    state.modules_to_run.clear()
        event, self.post_optim_event = self.post_optim_event, None
        if event is not None:  # the optimizer step's work must finish before we gather
            event.wait()
        for state in self.all_states:  # reductions left open by set_is_last_backward(False)
            if state.unit is not None:
                state.unit.finish_reduce()

    def cast_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """``mp_policy``'s cast of the floating-point inputs, or ``None`` when there is none."""
        dtype = self.mp_policy.param_dtype
        if dtype is None or not self.mp_policy.cast_forward_inputs:
            return None
        cast: tuple[tuple[Any, ...], dict[str, Any]] = _cast_floats((args, kwargs), dtype)
        return cast

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if in_backward():
            return self.cast_output(output)
        grad = torch.is_grad_enabled()
        if len(self.modules) > 1:
            # Run again, or others of the unit are still to run: it stays unsharded.
            ran_last = id(module) in self.modules_to_run and len(self.modules_to_run) == 1
            self.modules_to_run.discard(id(module))
            if not ran_last:
                output = self.cast_output(output)
                return self.hook_outputs(output) if grad else output
        self.complete_forward(grad)
        root = self.root
        assert root is not None
        if root.forward_root is self:
            output = root.end_pass(output, grad)
        output = self.cast_output(output)
        return self.hook_outputs(output) if grad else output

    def complete_forward(self, grad: bool) -> None:
        """The unit's forward is over for this pass: reshard (if asked) and go idle."""
        resharding = not grad or bool(self.reshard_after_forward)
        if self.unit is not None and not self.conditional and resharding:
            self.unit.reshard(post_forward=grad)
        if not grad:
            for child in self.conditional_children:
                child.unit.reshard()  # type: ignore[union-attr]
        root = self.root
        assert root is not None
        if root.recording_order and self.unit is not None and not self.conditional:
            root.post_forward_order.append(self)
        self.training_state = TrainingState.IDLE
        self.modules_to_run.clear()

    def end_pass(self, output: Any, grad: bool) -> Any:
        """Root only: the pass is over. Units of several modules some of which did not run
        finish their forward now; their backward starts with the pass output's gradient."""
        for state in reversed(self.all_states):
            if state.modules_to_run and state is not self.forward_root:
                state.complete_forward(grad)
                output = state.cast_output(output)
                if grad:
                    output = state.hook_outputs(output)
        self.forward_root = None
        if self.recording_order:  # the first pass recorded the order units run in
            self.recording_order = False
            self.derive_prefetch_order()
        return output

    def cast_output(self, output: Any) -> Any:
        dtype = self.mp_policy.output_dtype
        return output if dtype is None else _cast_floats(output, dtype)

    def derive_prefetch_order(self) -> None:
        """Root only: map each unit to the one after it in forward and in backward."""
        fwd, post = self.forward_order, self.post_forward_order
        self.next_in_forward = {id(a): b for a, b in pairwise(fwd)}
        self.next_in_backward = {id(b): a for a, b in pairwise(post)}

    def hook_outputs(self, output: Any) -> Any:
        # torch's containers (dataclasses included), not just pytree nodes: a unit whose
        # output hides in a dataclass must still unshard before its backward.
        leaves = [output] if isinstance(output, torch.Tensor) else tensors_in(output)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self.pre_backward_hook)
        return output

    def prefetch_targets(self, forward: bool) -> list[FSDPState]:
        if self.conditional:  # it does not run everywhere: it must not start collectives
            return []
        explicit = self.forward_prefetch if forward else self.backward_prefetch
        if explicit is not None:
            targets = explicit
        else:
            root = self.root
            if root is None or root.recording_order:
                return []
            if forward and root.forward_root is not root:  # a unit alone runs nothing after
                return []
            target = (root.next_in_forward if forward else root.next_in_backward).get(id(self))
            targets = [] if target is None else [target]
        if forward:
            return [s for s in targets if s.unit is not None]
        return [s for s in targets if s.unit is not None and s.unshard_in_backward]

    # --- backward --------------------------------------------------------------------------

    def pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return grad
        self.queue_finish()  # first: it refuses compiled autograd before any change
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unit is not None and self.unshard_in_backward:
            with traced("plait.fsdp.pre_backward"):
                self.unit.wait_for_unshard()  # a conditional unit is still unsharded
                for target in self.prefetch_targets(forward=False):
                    target.unit.unshard(async_op=True)  # type: ignore[union-attr]
        return grad

    def queue_finish(self) -> None:
        """Make sure the root's end-of-backward callback runs after this backward."""
        root = self.root
        assert root is not None
        if not root.callback_queued:
            try:
                queue_end_of_backward(root.finish_backward, "fully_shard")
            except CompiledAutogradError:  # refused: forget the step's forward, reshard
                root.reset_iter_state()
                raise
            root.callback_queued = True

    def post_backward(self) -> None:
        self.queue_finish()  # a module of a unit run alone registered no pre_backward
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
        if self.reduce_scatter_unused_params:
            _zero_missing_grads(self.unit)
        root = self.root
        assert root is not None
        while len(root.reducing) >= root.max_reductions_in_flight:  # bounded memory
            root.reducing.pop(0).finish_reduce()
        self.unit.reduce_grads()
        root.reducing.append(self.unit)

    def finish_backward(self) -> None:
        """Root only: the end-of-backward callback (see the module docstring, step 5).

        Units this backward did not reach (``IDLE``) are left alone: their forward's
        backward may still come (a chunked loss runs the head's backward per chunk before
        the model's).
        """
        reached = (TrainingState.FORWARD, TrainingState.PRE_BACKWARD)
        with traced("plait.fsdp.finish_backward"):
            for state in reversed(self.all_states):
                if state.conditional and state.unit is not None:
                    state.backwards_owed = 0
                    state.reduce_or_stash()
                elif state.training_state in reached and state.backwards_owed > 0:
                    state.backwards_owed = 1  # its inputs needed no gradient: reduce now
                    state.post_backward()
            for state in self.all_states:
                state.training_state = TrainingState.IDLE
                state.modules_to_run.clear()
                if state.unit is None:
                    continue
                if self.is_last_backward:
                    state.unit.finish_reduce()
                if state.unit.reshard_after_backward and state.backwards_owed == 0:
                    state.unit.reshard()
        if self.is_last_backward:
            self.reducing = []
        self.forward_root = None
        self.callback_queued = False
        spmd.check("end of a fully_shard backward")

    def reset_iter_state(self) -> None:
        """Root only: recover after an exception in forward or backward (see
        ``FSDPModule.reset_iter_state``). In-flight gradient reductions are dropped."""
        for state in self.all_states:
            state.training_state = TrainingState.IDLE
            state.modules_to_run.clear()
            state.backwards_owed = 0
            if state.unit is not None:
                state.unit.discard_inflight()
        self.reducing = []
        self.forward_root = None
        self.callback_queued = False


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's tensor inputs; its backward is the unit's post-backward."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward_hook()
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
    """``tree`` with every floating-point tensor cast to ``dtype`` (autograd-visible),
    through the containers torch's cast reaches (dataclasses included: see ``cast``)."""
    return cast_floating(tree, dtype)


def _zero_missing_grads(unit: FSDPParamGroup) -> None:
    """``set_reduce_scatter_unused_params``: a trainable parameter this rank did not use
    contributes zeros, so every rank reduces it and it ends with a zero gradient."""
    for p in unit.params:
        unsharded = p.unsharded
        missing = unsharded is not None and unsharded.grad is None and p.accumulated is None
        if p.sharded.requires_grad and missing:
            p.zero_unsharded_grad()


def _check_no_shared_params(states: list[FSDPState]) -> None:
    """A parameter given to two ``fully_shard`` calls would be two independent shards."""
    owner: dict[int, tuple[FSDPState, str]] = {}
    for state in states:
        for fqn, uid in state.param_uids.items():
            if uid in owner and owner[uid][0] is not state:
                other, other_fqn = owner[uid]
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} of {state.name} is shared with parameter "
                    f"{other_fqn!r}, already managed by another fully_shard unit "
                    f"({other.name}). Shard tied parameters in one unit: "
                    "fully_shard([module_a, module_b])."
                )
            owner[uid] = (state, fqn)


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
