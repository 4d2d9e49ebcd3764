"""torch's module-wrapper form of activation checkpointing, on plait's checkpoint.

``checkpoint_wrapper(block)`` returns a :class:`CheckpointWrapper`, an ``nn.Module`` holding
``block`` as its child ``_checkpoint_wrapped_module`` whose calls are checkpointed. It is the
spelling of ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (used by
torchtitan and most FSDP training scripts), built on the composable
:func:`plait.checkpoint.checkpoint`: the wrapper applies it to the wrapped block, so what
``checkpoint`` does (non-reentrant recompute, ``context_fn``, ``preserve_rng_state``...) is
what the wrapper does.

The wrapper adds one level to the module tree but hides it from names: ``named_parameters``
and ``state_dict`` drop the ``_checkpoint_wrapped_module.`` part, and ``load_state_dict``
puts it back, so checkpoints move freely between wrapped and unwrapped models. Attributes and
indexing the wrapper lacks are looked up on the wrapped block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from enum import Enum, auto
from typing import Any

from torch import nn

from plait.checkpoint.api import checkpoint

__all__ = [
    "CheckpointImpl",
    "CheckpointWrapper",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
]

_WRAPPED = "_checkpoint_wrapped_module"
_WRAPPED_PREFIX = _WRAPPED + "."


class CheckpointImpl(Enum):
    """Which checkpoint implementation a wrapper uses; plait has only ``NO_REENTRANT``."""

    REENTRANT = auto()
    NO_REENTRANT = auto()


def _rename_prefix(state_dict: dict[str, Any], old: str, new: str) -> None:
    """Rename, in place and keeping their order, the keys of ``state_dict`` under ``old``."""
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[new + key[len(old) :]] = state_dict.pop(key)


class CheckpointWrapper(nn.Module):
    """Holds ``module`` as ``_checkpoint_wrapped_module`` and checkpoints each call of it.

    Use :func:`checkpoint_wrapper` to make one. ``checkpoint_fn=None`` applies plait's
    composable :func:`~plait.checkpoint.checkpoint` to ``module`` with
    ``checkpoint_fn_kwargs`` (so ``module`` itself is checkpointed from then on, wrapped or
    not); a given ``checkpoint_fn`` is instead called as
    ``checkpoint_fn(module, *args, **checkpoint_fn_kwargs, **kwargs)`` by each forward, as
    torch's wrapper does.

    Raises ``NotImplementedError`` for ``CheckpointImpl.REENTRANT``: plait's checkpoint is
    non-reentrant only.
    """

    _checkpoint_wrapped_module: nn.Module

    def __init__(
        self,
        mod: nn.Module,
        checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
        checkpoint_fn: Callable[..., Any] | None = None,
        **checkpoint_fn_kwargs: Any,
    ) -> None:
        if not isinstance(mod, nn.Module):
            raise TypeError(f"checkpoint_wrapper expects an nn.Module, got {type(mod).__name__}")
        if checkpoint_impl is not CheckpointImpl.NO_REENTRANT:
            raise NotImplementedError(
                f"checkpoint_wrapper: checkpoint_impl={checkpoint_impl} is not supported; plait's "
                "checkpoint is non-reentrant only. Pass CheckpointImpl.NO_REENTRANT (the default)."
            )
        super().__init__()
        self._checkpoint_wrapped_module = mod
        self.checkpoint_impl = checkpoint_impl
        # None: the wrapped module checkpoints itself (plait's composable checkpoint).
        self.checkpoint_fn: Callable[..., Any] | None = None
        if checkpoint_fn is None:
            checkpoint(mod, **checkpoint_fn_kwargs)
        else:
            self.checkpoint_fn = functools.partial(checkpoint_fn, **checkpoint_fn_kwargs)
        # Hide the extra level from state dicts: saved without it, loaded by adding it back.
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module, checkpointed."""
        if self.checkpoint_fn is None:
            return self._checkpoint_wrapped_module(*args, **kwargs)
        return self.checkpoint_fn(self._checkpoint_wrapped_module, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks come from the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == _WRAPPED:  # not set yet (in __init__ or while unpickling)
                raise
            return getattr(self._checkpoint_wrapped_module, name)

    def __getitem__(self, key: Any) -> Any:
        """Index the wrapped module (an ``nn.Sequential``, ``nn.ModuleList``...)."""
        # Any: nn.Module has no __getitem__; the wrapped module's class may (or raises).
        wrapped: Any = self._checkpoint_wrapped_module
        return wrapped[key]

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters`` without the ``_checkpoint_wrapped_module.`` parts,
        so parameter names are those of the unwrapped model."""
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield name.replace(_WRAPPED_PREFIX, ""), param


def _strip_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    _rename_prefix(state_dict, prefix + _WRAPPED_PREFIX, prefix)


def _add_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    _rename_prefix(state_dict, prefix, prefix + _WRAPPED_PREFIX)


def checkpoint_wrapper(
    module: nn.Module,
    checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
    checkpoint_fn: Callable[..., Any] | None = None,
    **checkpoint_fn_kwargs: Any,
) -> nn.Module:
    """Wrap ``module`` so that every call of it is activation-checkpointed.

    Args:
        module: the block to checkpoint.
        checkpoint_impl: must be ``CheckpointImpl.NO_REENTRANT`` (``REENTRANT`` raises
            ``NotImplementedError``).
        checkpoint_fn: a functional checkpoint ``fn(module, *args, **kwargs)`` to call
            instead of plait's; ``None`` uses :func:`plait.checkpoint.checkpoint`.
        **checkpoint_fn_kwargs: keyword arguments of the checkpoint: for plait's,
            ``preserve_rng_state``, ``context_fn`` (e.g. torch's
            ``create_selective_checkpoint_contexts(policy)``), ``determinism_check``,
            ``debug``, ``early_stop``, ``policy``, ``offload``.

    Returns the :class:`CheckpointWrapper`; to use it, put it where ``module`` was.
    """
    return CheckpointWrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)


#: ``auto_wrap_policy(module, recurse, nonwrapped_numel) -> bool``, as in torch's FSDP1.
AutoWrapPolicy = Callable[[nn.Module, bool, int], bool]


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module] = checkpoint_wrapper,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: AutoWrapPolicy | None = None,
) -> None:
    """Replace, in place, each submodule of ``model`` chosen by ``check_fn`` with
    ``checkpoint_wrapper_fn(submodule)``. ``model`` itself is never wrapped.

    Children are visited before their parents, so a chosen module inside a chosen module
    is wrapped too. ``auto_wrap_policy``, if given, decides instead of ``check_fn``: it is
    asked ``(module, recurse=True, nonwrapped_numel)`` whether to look inside a module, and
    ``(module, recurse=False, nonwrapped_numel)`` whether to wrap it, where
    ``nonwrapped_numel`` counts the module's parameter elements not already wrapped below.
    Only callables are accepted (torch's FSDP1 policy objects are not).
    """
    if auto_wrap_policy is not None and not callable(auto_wrap_policy):
        raise TypeError(
            "apply_activation_checkpointing: auto_wrap_policy must be a callable "
            f"(module, recurse, nonwrapped_numel) -> bool, got {type(auto_wrap_policy).__name__}"
        )

    def by_check_fn(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or check_fn(module)

    _wrap_below(model, auto_wrap_policy or by_check_fn, checkpoint_wrapper_fn, is_root=True)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _wrap_below(
    module: nn.Module,
    policy: AutoWrapPolicy,
    wrap: Callable[[nn.Module], nn.Module],
    is_root: bool,
) -> tuple[nn.Module, int]:
    """Wrap what ``policy`` chooses in ``module``'s subtree; returns the module to put in
    its place and how many parameter elements ended up wrapped."""
    numel = _numel(module)
    if not policy(module, True, numel):
        return module, 0
    wrapped = 0
    for name, child in list(module.named_children()):
        new_child, child_wrapped = _wrap_below(child, policy, wrap, is_root=False)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped += child_wrapped
    if not is_root and policy(module, False, numel - wrapped):
        return wrap(module), numel
    return module, wrapped
