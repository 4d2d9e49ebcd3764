"""The per-unit state of ``fully_shard`` and the four hooks that drive a unit through a step.

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
5. ``RootPass.finish_backward`` (R, once per backward): runs ``post_backward`` for the
   units this backward reached whose inputs needed no gradient (their step 4 never
   fired), waits for all reductions and reshards what no later backward still needs, in
   a fixed order so all ranks issue the same collectives.

A *forward pass* starts at the first unit whose forward begins while no pass is running:
normally the root, but after the root's forward has finished any unit may run (and
backward) on its own, as torch allows (a chunked loss calling the output head on chunks).
What spans the pass lives in the root's ``root.RootPass``.

A unit made of several modules (``fully_shard([norm, head])``) unshards when the first of
them starts forward and finishes its forward when the last has run. If a pass ends with
some of them not run (the head skipped by a chunked loss), the pass finishes the unit
then; a module of the unit run alone afterwards leaves it unsharded until its backward.

Forwards that run *inside* backward (activation-checkpoint recomputation) only make sure
the unit is unsharded; they register nothing and reshard nothing.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

import torch
from torch import nn

from plait.contract import APIState, get_registry
from plait.fsdp.backward_hooks import PostBackward as _PostBackward  # tests patch it here
from plait.fsdp.backward_hooks import register_on_outputs
from plait.fsdp.cast import cast_floating
from plait.fsdp.group import FSDPParamGroup
from plait.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy
from plait.fsdp.root import RootPass
from plait.fsdp.settings import UnitSettings
from plait.hooks import in_backward, outside_graphs, traced

_API_NAMES = ("fully_shard", "replicate")  # contract's names of the APIs that make units


class TrainingState(Enum):
    """Where a unit is in the current step.

    A unit goes ``IDLE -> FORWARD`` in ``pre_forward`` and back to ``IDLE`` when its
    forward completes (``post_forward``, or ``RootPass.end`` for modules that did not
    run), then ``PRE_BACKWARD`` in ``pre_backward`` and ``POST_BACKWARD`` in
    ``post_backward``. The root's pass puts units back to ``IDLE``: every unit at the end
    of backward (``RootPass.finish_backward``) and on recovery (``RootPass.reset``), a
    forward left open when a new pass begins at the root (``RootPass.begin``).
    """

    IDLE = auto()
    """Not in a forward: before the first one, after its forward completed, or after the
    end of backward. ``post_forward`` (or the root's end of the pass) returns here."""
    FORWARD = auto()
    """``pre_forward`` ran and the unit's forward has not completed: the first of its
    modules started, the last has not finished (several-module units)."""
    PRE_BACKWARD = auto()
    """``pre_backward`` ran: the first gradient of the unit's outputs arrived, and the
    unit is unsharded (unless ``unshard_in_backward`` is off) for its backward."""
    POST_BACKWARD = auto()
    """``post_backward`` ran: the gradients of the unit's inputs are computed and its own
    are being reduced (or stashed, with gradient sync off); a conditional unit's wait for
    the end of backward."""


def fsdp_state_of(module: nn.Module) -> FSDPState | None:
    """The unit state (``fully_shard`` or ``replicate``) of ``module`` itself, or ``None``."""
    registry: dict[str, Any] = get_registry(module) or {}
    states = (registry[api].state for api in _API_NAMES if api in registry)
    return next((s for s in states if isinstance(s, FSDPState)), None)


def fsdp_states_in(module: nn.Module) -> list[FSDPState]:
    """The unit states in ``module``'s subtree, in pre-order (module first)."""
    states: list[FSDPState] = []
    seen: set[int] = set()  # modules of one list share a state
    for m in module.modules():
        state = fsdp_state_of(m)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            states.append(state)
    return states


class FSDPState(APIState):
    """The state of one ``fully_shard`` call (one *unit*) and its hooks.

    Holds what is per unit: its modules, its parameter group (``unit``, ``None`` when the
    call found no parameters of its own), its :class:`UnitSettings`, its place in the
    tree (``is_root``: ``None`` until the root's lazy initialisation; ``root``) and its
    :class:`TrainingState`. The root also holds the bookkeeping of the whole pass
    (``root_pass``). ``fully_shard`` registers ``pre_forward`` / ``post_forward`` on the
    modules; ``pre_backward`` / ``post_backward`` are reached through autograd.
    """

    def __init__(self) -> None:
        # ``contract`` creates the state before ``fully_shard`` runs; ``fully_shard`` fills
        # in the modules, parameter group and settings.
        self.modules: list[nn.Module] = []  # the modules of the call (usually one)
        self.unit: FSDPParamGroup | None = None
        self.settings = UnitSettings(MixedPrecisionPolicy(), OffloadPolicy(), None)
        self.param_uids: dict[str, int] = {}  # fqn -> identity of the original parameter
        self.conditional_children: list[FSDPState] = []  # gathered when this unit unshards
        self.is_root: bool | None = None
        self.root: FSDPState | None = None
        self.root_pass: RootPass[FSDPState] | None = None  # the root's (see RootPass)
        self.training_state = TrainingState.IDLE
        self.modules_to_run: set[int] = set()  # several modules: those yet to run this pass
        self.backwards_owed = 0  # forwards with grad whose post_backward has not run yet
        self.forward_prefetch: list[FSDPState] | None = None  # explicit, else implicit order
        self.backward_prefetch: list[FSDPState] | None = None
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

    # Views into the settings and the root's pass, for the pipeline's gradient sync
    # (``pipeline/grad_sync.py`` saves and restores ``reshard_after_forward``) and tests.

    @property
    def reshard_after_forward(self) -> bool | None:
        """The unit's setting (``None``: not given, and not yet resolved by lazy init)."""
        return self.settings.reshard_after_forward

    @reshard_after_forward.setter
    def reshard_after_forward(self, value: bool | None) -> None:
        self.settings.reshard_after_forward = value

    @property
    def all_states(self) -> list[FSDPState]:
        """The root's: every state under it, pre-order, itself first (others: empty)."""
        return self.root_pass.states if self.root_pass is not None else []

    @property
    def reducing(self) -> list[FSDPParamGroup]:
        """The root's: the units whose gradient reduction is in flight (others: empty)."""
        return self.root_pass.reducing if self.root_pass is not None else []

    def _root_pass(self) -> RootPass[FSDPState]:
        root = self.root
        assert root is not None and root.root_pass is not None, "used before lazy init"
        return root.root_pass

    # --- lazy initialisation (the root, at its first forward) -----------------------------

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
        if self.root_pass is None:  # else a setter made it before the first forward: keep it
            self.root_pass = RootPass()
        root_pass = self.root_pass
        root_pass.states = states_in_tree
        assert self.module is not None
        names = {id(m): name for name, m in self.module.named_modules()}
        for state in states_in_tree:
            state.root = self
            if state is not self:
                state.is_root = False
                state.root_pass = None  # only the root keeps one
            if state.settings.reshard_after_forward is None:  # resolved here, once
                state.settings.reshard_after_forward = state is not self
            if state.unit is not None:
                state.check_params_materialised(names.get(id(state.modules[0]), ""))
                unit_names = [names.get(id(m), "") or "<root>" for m in state.modules]
                state.unit.owner = f"{state.settings.api_name} unit {', '.join(unit_names)!r}"
        for state in states_in_tree:
            state.conditional_children = []
        by_module = {id(m): s for s in states_in_tree for m in s.modules}
        _link_conditional_units(self.module, self, by_module)
        limits = (s.settings.max_input_buffers for s in states_in_tree)
        root_pass.max_reductions_in_flight = max(limits)
        root_pass.recording_order = True

    def check_params_materialised(self, prefix: str = "") -> None:
        """Lazy init: take in the parameters replaced since ``fully_shard`` and refuse
        any still on the meta device, named by their FQN from the root (``prefix``: the
        unit's module's)."""
        assert self.unit is not None
        if any(p.padded.is_meta for p in self.unit.params):
            self.unit.adopt_materialised()
        meta = [f"{prefix}.{p.fqn}".lstrip(".") for p in self.unit.params if p.padded.is_meta]
        if meta:  # torch's sentence first (code written for torch matches on it), then plait's
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {meta}\n"
                f"fully_shard: parameters of {self.name} are still on the meta device at the "
                f"first forward: {meta}. Call module.to_empty(device=...) and initialise them "
                "(e.g. reset_parameters()) after fully_shard and before the first forward."
            )
        self.unit.adopt_replacements()

    # --- forward ---------------------------------------------------------------------------

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Forward pre-hook of each module of the unit (and of ``register_fsdp_forward_method``
        methods): returns the inputs to use, or ``None`` to keep them.

        Runs lazy initialisation at the very first forward (this module's state becomes
        the root). When the first module of the unit starts in this pass: enters
        ``FORWARD``, begins the pass if none is running, waits for (or issues) the
        all-gather, prefetches the next unit, all-gathers its conditional children, and
        wraps the grad-requiring inputs in ``_PostBackward`` (with grad enabled). Every
        module casts its inputs by ``mp_policy``. Inside backward (recomputation) it only
        makes sure the unit is unsharded and casts.
        """
        if in_backward():  # recomputation under activation checkpointing
            if self.unit is not None:
                self.unit.wait_for_unshard()
            return self.cast_inputs(args, kwargs)
        if self.is_root is None:
            self.lazy_init(fsdp_states_in(module))
        root_pass = self._root_pass()
        # The first module of the unit to run in this pass does the per-pass work; the
        # others of a several-module unit only cast their inputs.
        first = self.training_state is not TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        if first and len(self.modules) > 1:
            self.modules_to_run = {id(m) for m in self.modules}
        if first and (self.is_root or root_pass.forward_root is None):
            root_pass.begin(self)
        grad = torch.is_grad_enabled()
        if self.unit is not None:
            with traced("plait.fsdp.pre_forward", self.unit.owner):
                if first:
                    if not self.settings.conditional:
                        root_pass.record_forward(self)
                    keep_block = grad and self.settings.reshard_after_forward is True
                    self.unit.prepare_post_forward(keep_block)
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
        wrapped = (
            _PostBackward.wrap_inputs(self.post_backward_hook, args, kwargs)
            if grad and first
            else None
        )
        return wrapped or cast

    def cast_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """``mp_policy``'s cast of the floating-point inputs, or ``None`` when there is none."""
        policy = self.settings.mp_policy
        if policy.param_dtype is None or not policy.cast_forward_inputs:
            return None
        cast: tuple[tuple[Any, ...], dict[str, Any]] = cast_floating(
            (args, kwargs), policy.param_dtype
        )
        return cast

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        """Forward hook of each module of the unit: returns the output to use.

        When the unit's forward completes (its last module ran): reshards if
        ``reshard_after_forward`` or under ``no_grad`` and goes back to ``IDLE``; the unit
        that began the pass also ends it (``RootPass.end``). The output is cast by
        ``mp_policy`` and, with grad enabled, its tensors get ``pre_backward`` as a hook.
        Inside backward (recomputation) it only casts.
        """
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
        root_pass = self._root_pass()
        if root_pass.forward_root is self:
            output = root_pass.end(output, grad)
        output = self.cast_output(output)
        return self.hook_outputs(output) if grad else output

    def complete_forward(self, grad: bool) -> None:
        """The unit's forward is over for this pass: reshard (if asked) and go idle."""
        conditional = self.settings.conditional
        resharding = not grad or self.settings.reshard_after_forward is True
        if self.unit is not None and not conditional and resharding:
            self.unit.reshard(post_forward=grad)
        if not grad:
            for child in self.conditional_children:
                child.unit.reshard()  # type: ignore[union-attr]
        if self.unit is not None and not conditional:
            self._root_pass().record_post_forward(self)
        self.training_state = TrainingState.IDLE
        self.modules_to_run.clear()

    def cast_output(self, output: Any) -> Any:
        dtype = self.settings.mp_policy.output_dtype
        return output if dtype is None else cast_floating(output, dtype)

    def hook_outputs(self, output: Any) -> Any:
        return register_on_outputs(output, self.pre_backward_hook)

    def prefetch_targets(self, forward: bool) -> list[FSDPState]:
        """The units to all-gather right after this one: the explicit list
        (``set_modules_to_*_prefetch``) or the next unit in the recorded order."""
        if self.settings.conditional:  # it does not run everywhere: no collectives of its own
            return []
        explicit = self.forward_prefetch if forward else self.backward_prefetch
        if explicit is not None:
            targets = explicit
        else:
            if self.root is None:
                return []
            target = self._root_pass().next_unit(self, forward)
            targets = [] if target is None else [target]
        if forward:
            return [s for s in targets if s.unit is not None]
        return [s for s in targets if s.unit is not None and s.settings.unshard_in_backward]

    # --- backward --------------------------------------------------------------------------

    def pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        """Hook on the unit's output tensors: runs at the first gradient that reaches one
        of them in backward (later ones pass through), before the unit's own backward.

        Queues the root's end-of-backward callback, enters ``PRE_BACKWARD``, and (unless
        ``unshard_in_backward`` is off) waits for the unit's all-gather and prefetches the
        next unit in backward order. Returns ``grad`` unchanged.
        """
        if self.training_state is TrainingState.PRE_BACKWARD:
            return grad
        self._root_pass().queue_finish()  # first: it refuses compiled autograd
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unit is not None and self.settings.unshard_in_backward:
            with traced("plait.fsdp.pre_backward", self.unit.owner):
                self.unit.wait_for_unshard()  # a conditional unit is still unsharded
                for target in self.prefetch_targets(forward=False):
                    target.unit.unshard(async_op=True)  # type: ignore[union-attr]
        return grad

    def post_backward(self) -> None:
        """Runs when the gradients of the unit's inputs are computed (``_PostBackward``),
        or from the root's end-of-backward callback for a unit whose inputs needed none.

        Enters ``POST_BACKWARD``; for each forward with grad still owed a backward, starts
        the gradient reduction (or stashes, with gradient sync off) and reshards if
        ``reshard_after_backward``. Conditional units reduce at the end of backward only.
        """
        self._root_pass().queue_finish()  # a unit's module run alone had no pre_backward
        self.training_state = TrainingState.POST_BACKWARD
        if self.unit is None or self.backwards_owed == 0 or self.settings.conditional:
            return  # a conditional unit reduces in finish_backward, on every rank
        self.backwards_owed -= 1
        with traced("plait.fsdp.post_backward", self.unit.owner):
            self.reduce_or_stash()
            if self.settings.reshard_after_backward:
                self.unit.reshard()

    def reduce_or_stash(self) -> None:
        """Start this unit's gradient reduction, or keep accumulating with sync off."""
        assert self.unit is not None
        if not self.settings.requires_gradient_sync:
            self.unit.stash_grads()
            return
        if self.settings.reduce_scatter_unused_params:
            self.unit.reduction.zero_missing()
        self._root_pass().reduce(self.unit)

    # --- what the root's pass asks of each unit (root.PassMember) ---------------------------

    def abandon_forward(self) -> None:
        """A new pass begins at the root: a forward of this unit left open ends."""
        if self.training_state is TrainingState.FORWARD:
            self.training_state = TrainingState.IDLE
            self.modules_to_run.clear()

    def finish_reductions(self) -> None:
        if self.unit is not None:
            self.unit.finish_reduce()

    def finish_unrun_forward(self, output: Any, grad: bool) -> Any:
        """The pass ends with modules of this unit not run: its forward completes now."""
        if not self.modules_to_run:
            return output
        self.complete_forward(grad)
        output = self.cast_output(output)
        return self.hook_outputs(output) if grad else output

    def catch_up_backward(self) -> None:
        """End of backward, first: reduce what this backward owes but never reduced."""
        if self.settings.conditional and self.unit is not None:
            self.backwards_owed = 0
            self.reduce_or_stash()
        elif self.training_state in _REACHED and self.backwards_owed > 0:
            self.backwards_owed = 1  # its inputs needed no gradient: reduce now
            self.post_backward()

    def end_backward(self, finish_reductions: bool) -> None:
        """End of backward, then: back to ``IDLE``; wait for the reductions (unless the
        root leaves them in flight) and reshard unless a later backward still needs it.
        Units this backward did not reach (``IDLE``) keep their owed backwards: their
        forward's backward may still come (a chunked loss runs the head's backward per
        chunk before the model's)."""
        self.training_state = TrainingState.IDLE
        self.modules_to_run.clear()
        if self.unit is None:
            return
        if finish_reductions:
            self.unit.finish_reduce()
        if self.settings.reshard_after_backward and self.backwards_owed == 0:
            self.unit.reshard()

    def forget_step(self) -> None:
        """Recovery after an exception: drop this step's work, in-flight reductions too."""
        self.training_state = TrainingState.IDLE
        self.modules_to_run.clear()
        self.backwards_owed = 0
        if self.unit is not None:
            self.unit.discard_inflight()


# States in which a unit was reached by the current backward, or ran forward for it.
_REACHED = (TrainingState.FORWARD, TrainingState.PRE_BACKWARD)


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
        if state.settings.conditional and state is not enclosing and new:
            enclosing.conditional_children.append(state)
        _link_conditional_units(child, state, states)
