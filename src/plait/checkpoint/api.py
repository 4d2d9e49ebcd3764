"""Composable activation checkpointing: ``checkpoint(module)`` trades compute for memory.

``checkpoint(module)`` changes nothing about the module's structure or names; it registers a
forward pre-hook and a forward hook. Between them, every tensor autograd would save for
backward inside the module is replaced by a small handle and only the module's inputs are
kept. When backward first needs one of those tensors, the module's forward is re-run from
the kept inputs to recompute them (see ``plait.checkpoint.region``). This is torch's
*non-reentrant* checkpoint: the autograd graph keeps its full shape, so hooks, nested
checkpoints, ``torch.autograd.grad`` and ``retain_graph=True`` work as without it.

Two extensions of torch's API:

* ``policy=``: selective checkpointing. The outputs of the ops the policy names (say the
  matmuls) are kept from the forward and replayed, everything else is recomputed
  (``plait.checkpoint.selective``).
* ``offload=True``: nothing is recomputed; saved tensors are parked in host memory between
  forward and backward instead (``plait.checkpoint.offload``).

``checkpoint.state(module).enable_hook = False`` turns checkpointing off for later forwards
(the module then behaves exactly as if never checkpointed) and ``True`` turns it back on.
Forwards run without grad mode (``torch.no_grad()``, inference mode) are never checkpointed:
the hooks return at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import torch
from torch import nn

from plait.checkpoint.offload import offload_hooks
from plait.checkpoint.region import CheckpointError, RecomputeOptions, Region, Replay
from plait.checkpoint.selective import KeptOutputs, Op, Policy, keep_predicate
from plait.contract import APIState, contract
from plait.hooks import outside_graphs

__all__ = ["CheckpointError", "ContextFn", "Policy", "checkpoint"]

#: What ``checkpoint(context_fn=...)`` accepts: returns ``(forward_ctx, recompute_ctx)``.
ContextFn: TypeAlias = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]
_DETERMINISM_CHECKS = ("default", "none")


@dataclass(frozen=True)
class _Options:
    recompute: RecomputeOptions
    context_fn: ContextFn | None
    keep: Callable[[Op], bool] | None
    offload: bool


class _Closable(Protocol):
    def close(self) -> None: ...


class _CheckpointState(APIState):
    """What ``checkpoint`` attaches to a module; ``enable_hook`` is the public switch."""

    def __init__(self) -> None:
        self.enable_hook = True
        self.options: _Options | None = None
        # Calls between pre-hook and hook, innermost last (None: that call is not checkpointed).
        self.open_calls: list[_Closable | None] = []
        # Set while backward re-runs the module: its own hooks then only mark the forward's end.
        self.replaying: Replay | None = None


def _parse_options(
    preserve_rng_state: bool,
    context_fn: ContextFn | None,
    determinism_check: str,
    debug: bool,
    early_stop: bool,
    policy: Policy | None,
    offload: bool,
    extra: dict[str, Any],
) -> _Options:
    if extra.pop("use_reentrant", False):
        raise NotImplementedError(
            # torch's whole refusal first, word for word: code written for torch (and
            # torch's own tests) match on it. plait's explanation follows.
            "use_reentrant=True is not supported in composable checkpoint. "
            "Please use torch.utils.checkpoint.checkpoint instead. "
            "plait.checkpoint is non-reentrant only: drop the argument to use the (default) "
            "non-reentrant checkpoint."
        )
    if extra:
        # torch's sentence first (code written for torch matches on it), then plait's list.
        raise ValueError(
            f"Unexpected keyword arguments: {', '.join(extra)}. checkpoint() takes "
            "preserve_rng_state, context_fn, determinism_check, debug, early_stop, policy, "
            "offload (and use_reentrant=False)"
        )
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check must be one of {_DETERMINISM_CHECKS}, got {determinism_check!r}"
        )
    if offload and policy is not None:
        raise ValueError(
            "offload=True keeps every saved tensor (on CPU) and recomputes nothing, so a "
            "selective recompute policy has nothing to choose; pass one or the other"
        )
    if context_fn is not None and not callable(context_fn):
        raise TypeError(f"context_fn must be a callable, got {type(context_fn).__name__}")
    return _Options(
        recompute=RecomputeOptions(
            preserve_rng_state=preserve_rng_state,
            check_metadata=determinism_check == "default",
            debug=debug,
            early_stop=early_stop,
        ),
        context_fn=context_fn,
        keep=None if policy is None else keep_predicate(policy),
        offload=offload,
    )


@contract(_CheckpointState)
def checkpoint(
    module: nn.Module,
    /,
    *,
    preserve_rng_state: bool = True,
    context_fn: ContextFn | None = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    policy: Policy | None = None,
    offload: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """Checkpoint ``module`` in place: keep its inputs, recompute its activations in backward.

    Args:
        module: the module whose activations are not kept (a block of a model, or the model).
        preserve_rng_state: replay the RNG state of CPU and of the inputs' devices in the
            recompute, so random ops (dropout) draw the same numbers as in the forward.
        context_fn: returns ``(forward_ctx, recompute_ctx)``, two context managers entered
            around the forward and around each recompute of each call.
        determinism_check: ``"default"`` compares the shape, dtype and device of every
            recomputed tensor with the original and raises :class:`CheckpointError` on a
            difference; ``"none"`` skips the check.
        debug: name the torch function that saved each tensor in :class:`CheckpointError`.
        early_stop: stop the recompute as soon as every needed tensor is recomputed.
        policy: selective checkpointing: ops (``{torch.ops.aten.mm.default}``) or a predicate
            ``(op) -> bool`` whose outputs are kept from the forward instead of recomputed.
            Random, in-place and view ops are always recomputed.
        offload: instead of recomputing, park saved tensors on CPU until backward.

    ``use_reentrant=True`` raises ``NotImplementedError``; other keyword arguments raise
    ``ValueError``. Returns ``module``. ``checkpoint.state(module).enable_hook = False``
    disables checkpointing of later calls.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint expects one nn.Module, got {type(module).__name__}")
    state = checkpoint.state(module)
    state.options = _parse_options(
        preserve_rng_state,
        context_fn,
        determinism_check,
        debug,
        early_stop,
        policy,
        offload,
        kwargs,
    )
    # Prepended, so the pre-hook sees the caller's own arguments and the recompute, which
    # calls the module again, replays every other hook exactly as the forward ran them.
    before, after = _registered_hooks()
    module.register_forward_pre_hook(before, prepend=True, with_kwargs=True)
    # always_call: an exception in forward still closes the region (no hooks left behind).
    module.register_forward_hook(after, prepend=True, always_call=True)
    return module


@functools.cache
def _registered_hooks() -> tuple[Callable[..., None], Callable[..., None]]:
    """The pre-hook and hook as registered: both run eagerly, outside compiled graphs
    (they enter saved-tensor hooks), and the pre-hook first notes whether the forward it
    precedes runs under ``torch.compile`` (then so must its recompute)."""
    before = outside_graphs(_before_forward)

    def note_compiled(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Dynamo's frame callback is set: the module's forward will run compiled code. A
        # builtin, called inline: a Python frame here would be one more for dynamo to trace.
        callback = torch._C._dynamo.eval_frame.get_eval_frame_callback()
        before(module, args, kwargs, compiled=callback is not None and callback is not False)

    # Non-recursive: dynamo skips this frame (a graph break where it is inlined) but leaves
    # its frame callback set for the frame to read.
    noted: Callable[..., None] = torch.compiler.disable(note_compiled, recursive=False)
    return noted, outside_graphs(_after_forward)


def _before_forward(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], compiled: bool = False
) -> None:
    state = checkpoint.state(module)
    active = state.enable_hook and state.replaying is None and torch.is_grad_enabled()
    # Pushed first, so the forward hook (which runs even if this one raises) pops it.
    state.open_calls.append(None)
    if active and state.options is not None:
        state.open_calls[-1] = _open(module, state, state.options, args, kwargs, compiled)


def _after_forward(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    state = checkpoint.state(module)
    if state.replaying is not None:
        state.replaying.finish()
    call = state.open_calls.pop() if state.open_calls else None
    if call is not None:
        call.close()


def _open(
    module: nn.Module,
    state: _CheckpointState,
    options: _Options,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    compiled: bool,
) -> _Closable:
    """Start checkpointing one call: a recompute region, or offloading hooks.

    ``compiled``: the forward runs under ``torch.compile``, so the recompute replays the
    same compiled code (see ``_replaying_compiled_code``); otherwise it runs eagerly even
    if the module's code was compiled elsewhere (another instance of its class).
    """
    forward_ctx, recompute_ctx = options.context_fn() if options.context_fn else (None, None)
    if options.offload:
        with ExitStack() as stack:
            stack.enter_context(offload_hooks(module))
            if forward_ctx is not None:
                stack.enter_context(forward_ctx)
            return stack.pop_all()
    kept = KeptOutputs(options.keep) if options.keep is not None else None
    forward_contexts = [forward_ctx] if forward_ctx is not None else []
    if kept is not None:
        forward_contexts.append(kept.recording())

    def recompute_contexts() -> list[AbstractContextManager[Any]]:
        # The user's recompute context is entered by every recompute (as in torch).
        contexts = [recompute_ctx] if recompute_ctx is not None else []
        if kept is not None:
            contexts.append(kept.replaying())
        return contexts

    def rerun(replay: Replay, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        outer, state.replaying = state.replaying, replay
        try:
            (_replaying_compiled_code() if compiled else _call)(module, *args, **kwargs)
        finally:
            state.replaying = outer

    region = Region(
        type(module).__name__, args, kwargs, options.recompute, rerun, recompute_contexts
    )
    return region.open(forward_contexts)


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


@functools.cache
def _replaying_compiled_code() -> Callable[..., Any]:
    """``_call``, running every frame the forward ran compiled through the same compiled
    code (dynamo's run-only mode: cached graphs are used, nothing new is compiled).

    The recompute must save exactly the tensors the forward saved, and a compiled graph
    saves other tensors (its partitioner's choice) than the eager code it replaces. A
    backward runs outside ``torch.compile``'s context, where the module would run eagerly.
    """
    run_only: Callable[..., Any] = torch._dynamo.run(_call)
    return run_only
