"""Selective activation checkpointing: keep the outputs of chosen ops, recompute the rest.

Plain checkpointing recomputes the whole forward of a module in backward. A *policy* names
the ops that are expensive to recompute and cheap to keep (typically the matmuls): their
outputs are cached during the forward, and during the recompute those ops return the cached
outputs instead of running again. Everything else is recomputed as usual.

Both halves are ``TorchDispatchMode``s sharing one :class:`KeptOutputs` per checkpointed call:
the *recording* mode runs during the forward, the *replaying* mode during each recompute.
Entries are matched per op and in call order (the 3rd ``aten.mm`` of the recompute gets the
3rd ``aten.mm`` output of the forward), so ops that run a different number of times in the
two passes (``detach``, metadata queries) cannot shift them.

Only *functional, deterministic* ops can be kept (see :func:`keepable`):

* random ops (``dropout``, ``rand``...) are always recomputed: a kept random op would not
  draw from the generator during the recompute, so every random op after it would see a
  different RNG state than in the forward and produce different values;
* views and in-place ops are always recomputed: a view costs no memory to recompute, and an
  in-place op that were skipped would leave its input unmodified.

A kept output that the forward modified in place after the op returned (an ``empty_like``
that ``bernoulli_`` then fills, a matmul followed by ``mul_``) no longer holds what the op
returned. Replay notices from the tensors' version counters and recomputes that op instead,
which is correct because keepable ops are functional and deterministic (torch raises here).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Collection
from typing import Any, TypeAlias

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from plait.checkpoint.region import CheckpointError

__all__ = ["KeptOutputs", "Policy", "keep_predicate", "keepable"]

Op: TypeAlias = OpOverload[..., Any]
#: What ``checkpoint(policy=...)`` accepts: a predicate on ops, or the ops to keep.
Policy: TypeAlias = Callable[[Op], bool] | Collection[Op]


@functools.cache
def keepable(op: Op) -> bool:
    """Whether ``op``'s outputs may be cached and replayed: functional and not random."""
    schema = op._schema
    if torch.Tag.nondeterministic_seeded in op.tags or schema.is_mutable:
        return False
    return all(ret.alias_info is None for ret in schema.returns)


def _why_not_keepable(op: Op) -> str:
    if torch.Tag.nondeterministic_seeded in op.tags:
        return (
            "it is random: skipping it during the recompute would shift the random "
            "numbers of every random op after it"
        )
    if op._schema.is_mutable:
        return "it modifies its inputs in place, which a replayed output would not do"
    return "it returns a view, which costs no memory to recompute"


def keep_predicate(policy: Policy) -> Callable[[Op], bool]:
    """Normalise a policy (a predicate or a collection of ops) to a predicate.

    A collection must hold ``OpOverload``s (``torch.ops.aten.mm.default``, not
    ``torch.ops.aten.mm``) that are all keepable; a predicate is only ever asked about
    keepable ops, so it may answer ``True`` for everything.
    """
    if callable(policy):
        return policy
    if isinstance(policy, Collection):
        ops = frozenset(policy)
        for op in ops:
            _check_keepable(op)
        return ops.__contains__
    raise TypeError(
        "policy must be a callable (op) -> bool or a collection of ops, "
        f"got {type(policy).__name__}"
    )


def _check_keepable(op: object) -> None:
    if isinstance(op, OpOverloadPacket):
        raise ValueError(
            f"policy names the op packet {op}; name one overload of it instead, e.g. {op}.default"
        )
    if not isinstance(op, OpOverload):
        raise ValueError(
            "policy must hold torch.ops OpOverloads such as torch.ops.aten.mm.default, "
            f"got {op!r} of type {type(op).__name__}"
        )
    if not keepable(op):
        raise ValueError(f"policy cannot keep {op}: {_why_not_keepable(op)}.")


class _Kept:
    """The outputs of one kept op call, detached, with the versions they had when cached."""

    __slots__ = ("outputs", "versions")

    def __init__(self, outputs: Any) -> None:
        # Detached, so the cache holds no autograd graph (and makes no reference cycle).
        self.outputs = tree_map(_tracked_alias, outputs)
        self.versions = [t._version for t in _tensors(self.outputs)]

    def replay(self) -> Any:
        """Fresh aliases of the outputs, or ``None`` if they were modified since cached."""
        if [t._version for t in _tensors(self.outputs)] != self.versions:
            return None
        # Fresh aliases, like the plain tensors an op returns: autograd attaches its history
        # to what an op returns, and that must not be the cached tensor itself.
        return tree_map(_plain_alias, self.outputs)


def _tracked_alias(x: Any) -> Any:
    """A detached alias that shares ``x``'s version counter, so in-place changes show."""
    if not isinstance(x, torch.Tensor):
        return x
    # Inside a dispatch mode the ADInplaceOrView key is excluded, and a detach made without
    # it gets a version counter of its own; re-include it for this one op.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


def _plain_alias(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


class KeptOutputs:
    """The kept op outputs of one checkpointed call, per op in call order.

    An entry is ``None`` for a call of a keepable op that the policy chose to recompute, so
    that call indices line up between the forward and the recompute.
    """

    def __init__(self, keep: Callable[[Op], bool]) -> None:
        self.keep = keep
        self.entries: defaultdict[Op, list[_Kept | None]] = defaultdict(list)

    def recording(self) -> TorchDispatchMode:
        """The mode to run the forward under: it caches the outputs the policy keeps."""
        return _Recording(self)

    def replaying(self) -> TorchDispatchMode:
        """A mode for one recompute: kept ops return their cached outputs, in order."""
        return _Replaying(self)


class _Recording(TorchDispatchMode):
    def __init__(self, kept: KeptOutputs) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(
        self,
        func: Op,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if keepable(func):
            keep = bool(self.kept.keep(func)) and bool(_tensors(out))
            self.kept.entries[func].append(_Kept(out) if keep else None)
        return out


class _Replaying(TorchDispatchMode):
    def __init__(self, kept: KeptOutputs) -> None:
        super().__init__()
        self.kept = kept
        self.calls: defaultdict[Op, int] = defaultdict(int)

    def __torch_dispatch__(
        self,
        func: Op,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if keepable(func):
            index = self.calls[func]
            self.calls[func] += 1
            entries = self.kept.entries.get(func, [])
            if index < len(entries):
                entry = entries[index]
                replayed = entry.replay() if entry is not None else None
                if replayed is not None:
                    return replayed
                entries[index] = None  # modified in place since: recompute it, now and later
            elif self.kept.keep(func):
                raise CheckpointError(
                    f"plait.checkpoint: the recompute called {func} {index + 1} times, but the "
                    f"forward only {len(entries)} times, so there is no kept output to replay. "
                    "The checkpointed forward must run the same ops when it is re-run in "
                    "backward (no data-dependent control flow, no state changed in between)."
                )
        return func(*args, **(kwargs or {}))
