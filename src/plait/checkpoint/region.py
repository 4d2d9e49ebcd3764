"""One checkpointed module call: what its forward keeps, and how backward gets the rest back.

A :class:`Region` spans one call of a checkpointed module. While it is open (from the forward
pre-hook to the forward hook) it owns the innermost ``saved_tensors_hooks``: every tensor
autograd would save for backward is replaced by an empty :class:`_Holder`, and only the
module's inputs are really kept. The first time backward unpacks one of its holders, the
region re-runs the module's forward from the kept inputs under *replay* hooks that fill each
holder with the tensor recomputed at the same position, then hands the holders' tensors out
one by one (dropping each as it goes, so memory is freed as backward proceeds).

The recompute reproduces the forward: the same inputs (detached, with the same
``requires_grad``), the same RNG state on CPU and on the inputs' devices, the same autocast
state. It stops as soon as the last holder is filled (``early_stop``). Each holder is
filled once per backward pass (keyed by autograd's graph-task id), so ``retain_graph=True``
and a second backward simply recompute again.

Inputs are saved with ``torch._C._autograd._make_saved_tensor``, which applies the
saved-tensor hooks active *outside* the region: in nested checkpointing, a child's inputs are
themselves checkpointed by the parent rather than kept alive. They are also version-checked
like any saved tensor, so modifying an input in place before backward raises torch's usual
"modified by an inplace operation" error instead of recomputing from the wrong values.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from plait.hooks import backward_pass_id, refuse_compiled_autograd, traced

__all__ = ["CheckpointError", "RecomputeOptions", "Region", "Replay"]


class _HookedSave:
    """What ``torch._C._autograd._make_saved_tensor`` gives, for torch before 2.13 (which
    lacks it; GPU images often ship an older torch): the tensor packed by the saved-tensor
    hooks active now, and autograd's in-place check on unpack."""

    __slots__ = ("packed", "tensor", "unpack_hook", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        # None where no hooks are active (torch's stub says otherwise).
        hooks = cast(
            "tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None",
            torch._C._autograd._top_saved_tensors_default_hooks(False),
        )
        self.version = tensor._version
        # Under hooks only what they pack is kept (a parent checkpoint frees the tensor).
        self.tensor: torch.Tensor | None = tensor if hooks is None else None
        self.unpack_hook = hooks[1] if hooks is not None else None
        self.packed = hooks[0](tensor) if hooks is not None else None

    def unpack(self) -> torch.Tensor:
        if self.unpack_hook is not None:
            return self.unpack_hook(self.packed)
        assert self.tensor is not None
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: it is at version {self.tensor._version}; expected "
                f"version {self.version} instead (a checkpointed region's input)"
            )
        return self.tensor


_MAKE_SAVED = getattr(torch._C._autograd, "_make_saved_tensor", None)


def _save(tensor: torch.Tensor) -> Any:
    """``tensor`` saved as autograd saves a forward input (module docstring)."""
    return _MAKE_SAVED(tensor, is_output=False) if _MAKE_SAVED is not None else _HookedSave(tensor)


class CheckpointError(RuntimeError):
    """The recompute of a checkpointed module did not reproduce what its forward saved.

    Raised during backward when the re-run forward saves a different number of tensors, or
    tensors of a different shape, dtype or device, than the original forward did (usually
    data-dependent control flow, or state changed between forward and backward). A
    ``RuntimeError``, as torch's ``torch.utils.checkpoint.CheckpointError`` is; not a
    subclass of torch's, since plait imports nothing from torch's checkpoint module.
    """


_DEBUG_TIP = (
    "The forward of a checkpointed module must do the same thing when backward re-runs it: "
    "no control flow that depends on state changed between forward and backward. Pass "
    "debug=True to checkpoint() to name the op that saved each tensor, or "
    'determinism_check="none" to skip this check.'
)


@dataclass(frozen=True)
class RecomputeOptions:
    """How a region recomputes; see ``plait.checkpoint.checkpoint`` for each option."""

    preserve_rng_state: bool = True
    check_metadata: bool = True
    debug: bool = False
    early_stop: bool = True


class _Meta(NamedTuple):
    """What the determinism check compares: cheap to take, and enough to catch most bugs."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, x: torch.Tensor) -> _Meta:
        return cls(tuple(x.shape), x.dtype, x.device)

    def __str__(self) -> str:
        return f"shape={self.shape}, dtype={self.dtype}, device={self.device}"


class _Holder:
    """Stands in for one saved tensor; filled by each recompute, keyed by backward pass."""

    __slots__ = ("__weakref__", "recomputed")

    def __init__(self) -> None:
        self.recomputed: dict[int, torch.Tensor] = {}


class _StopRecompute(Exception):
    """Aborts a recompute once every holder is filled.

    An ``Exception`` (not a ``BaseException``) so that modules it unwinds through run their
    ``always_call`` forward hooks, which close any regions opened inside the recompute.
    """

    def __init__(self, replay: Replay) -> None:
        super().__init__("plait.checkpoint internal: recompute finished early")
        self.replay = replay


class _OpLabels(TorchFunctionMode):
    """debug=True: remembers which torch function is running, to name what it saves."""

    def __init__(self) -> None:
        super().__init__()
        self.current = "<not inside a torch function>"

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        outer = self.current
        self.current = getattr(func, "__name__", repr(func))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = outer


_fresh_ids = itertools.count(start=-2, step=-1)


def _backward_id() -> int:
    """Autograd's id for the running backward pass; a fresh id when unpacked outside one."""
    graph_task = backward_pass_id()
    return graph_task if graph_task is not None else next(_fresh_ids)


class _SavedLeaf:
    """One tensor input: saved through the outer hooks, whether it required grad, and
    whether it was a view (``fully_shard`` passes its inputs on as views of themselves)."""

    __slots__ = ("is_view", "requires_grad", "saved")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.saved = _save(tensor)
        self.requires_grad = tensor.requires_grad
        self.is_view = tensor._base is not None

    def restore(self) -> torch.Tensor:
        # A leaf of a new graph: the recompute must not reach into the caller's graph.
        leaf = self.saved.unpack().detach().requires_grad_(self.requires_grad)
        if not self.is_view:
            return leaf
        # A view stays a view: compiled code guards on it, and the recompute must run the
        # graph the forward ran to save the same tensors. Made with grad on (backward runs
        # without): a view made under no_grad would have no autograd edge to its base.
        with torch.enable_grad():
            return leaf.view_as(leaf)


class _SavedInputs:
    """The call's ``(args, kwargs)``: tensors (at any depth) saved, other values kept as is."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        leaves, self._spec = tree_flatten((args, kwargs))
        self._leaves = [_SavedLeaf(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        self.devices = {x.device for x in leaves if isinstance(x, torch.Tensor)}

    def restore(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves = [x.restore() if isinstance(x, _SavedLeaf) else x for x in self._leaves]
        args, kwargs = tree_unflatten(leaves, self._spec)
        return args, kwargs


def _rng_module(device: torch.device) -> Any:
    """The device module with per-device RNG state (``torch.cuda``...), or ``None``."""
    if device.type in ("cpu", "meta"):
        return None
    module = torch.get_device_module(device)
    return module if hasattr(module, "get_rng_state") else None


class _RngState:
    """The CPU generator's state and that of every device the inputs live on."""

    def __init__(self, devices: set[torch.device]) -> None:
        self._cpu = torch.get_rng_state()
        # (device, its device module, the state) for each device with a generator of its own.
        self._devices = [
            (d, module, module.get_rng_state(d))
            for d in devices
            if (module := _rng_module(d)) is not None
        ]

    def _apply(self) -> None:
        torch.set_rng_state(self._cpu)
        for device, module, state in self._devices:
            module.set_rng_state(state, device)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run with this state, then put back whatever state the generators had before."""
        current = _RngState({device for device, _, _ in self._devices})
        self._apply()
        try:
            yield
        finally:
            current._apply()


@dataclass(frozen=True)
class _AutocastState:
    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def capture(cls, devices: set[torch.device]) -> list[_AutocastState]:
        types = {"cpu"} | {d.type for d in devices}
        return [
            cls(
                device_type=t,
                enabled=torch.is_autocast_enabled(t),
                dtype=torch.get_autocast_dtype(t),
                cache_enabled=torch.is_autocast_cache_enabled(),
            )
            for t in sorted(types)
            if torch.amp.is_autocast_available(t)
        ]

    def replayed(self) -> AbstractContextManager[Any]:
        # Explicit even when disabled: backward may run inside the caller's autocast.
        return torch.autocast(
            self.device_type,
            dtype=self.dtype,
            enabled=self.enabled,
            cache_enabled=self.cache_enabled,
        )


Rerun = Callable[["Replay", tuple[Any, ...], dict[str, Any]], None]


class Region:
    """One checkpointed call: ``Region(...).open(forward_contexts)`` before the module's
    forward, ``close()`` after.

    ``rerun(replay, args, kwargs)`` must call the module again (with this API's own hooks
    off, everything else as in the forward) and call ``replay.finish()`` when the forward
    ends. ``recompute_contexts()`` gives the contexts of each recompute.
    """

    def __init__(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: RecomputeOptions,
        rerun: Rerun,
        recompute_contexts: Callable[[], list[AbstractContextManager[Any]]],
    ) -> None:
        self.name = name
        self.options = options
        self._rerun = rerun
        self._recompute_contexts = recompute_contexts
        # Taken before the forward runs: that is the state the recompute must start from.
        self._inputs = _SavedInputs(args, kwargs)
        self._rng = _RngState(self._inputs.devices) if options.preserve_rng_state else None
        self._autocast = _AutocastState.capture(self._inputs.devices)
        self.holders: list[weakref.ref[_Holder]] = []
        self.metas: list[_Meta] = []
        self.labels: list[str] = []
        self._labeler = _OpLabels() if options.debug else None
        self._recomputed_for: set[int] = set()
        self._stack: ExitStack | None = None
        self.forward_done = False

    def open(self, forward_contexts: list[AbstractContextManager[Any]]) -> Region:
        """Start the forward: enter this region's hooks, then ``forward_contexts``."""
        with ExitStack() as stack:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self.unpack))
            if self._labeler is not None:
                stack.enter_context(self._labeler)
            for ctx in forward_contexts:
                stack.enter_context(ctx)
            self._stack = stack.pop_all()  # entered them all: keep them open
        return self

    def close(self) -> None:
        """End the forward: leave the hooks and contexts that ``open`` entered."""
        self.forward_done = True
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    # -- forward -------------------------------------------------------------------------

    def _pack(self, x: torch.Tensor) -> _Holder:
        holder = _Holder()
        self.holders.append(weakref.ref(holder))
        if self.options.check_metadata:
            self.metas.append(_Meta.of(x))
        if self._labeler is not None:
            self.labels.append(self._labeler.current)
        # Autograd keeps the holder and this region's ``unpack`` as long as the graph lives.
        return holder

    # -- backward ------------------------------------------------------------------------

    def unpack(self, holder: _Holder) -> torch.Tensor:
        backward_id = _backward_id()
        if backward_id not in self._recomputed_for:
            self._recompute(backward_id)
        tensor = holder.recomputed.pop(backward_id, None)
        if tensor is None:
            raise CheckpointError(
                f"plait.checkpoint: a tensor saved by the checkpointed {self.name} was unpacked "
                "twice in one backward pass, or was never recomputed. Each saved tensor can be "
                "unpacked once per backward (read ctx.saved_tensors only once)."
            )
        return tensor

    def _recompute(self, backward_id: int) -> None:
        # Compiled autograd replays this hook inside a captured graph, where recomputation
        # does not reproduce the saved tensors: say so instead of a misleading mismatch.
        refuse_compiled_autograd("checkpoint")
        args, kwargs = self._inputs.restore()
        replay = Replay(self, backward_id)
        with ExitStack() as stack:
            stack.enter_context(traced(f"checkpoint.recompute:{self.name}"))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(replay.pack, _identity))
            stack.enter_context(torch.enable_grad())
            if self._rng is not None:
                stack.enter_context(self._rng.replayed())
            for autocast in self._autocast:
                stack.enter_context(autocast.replayed())
            if replay.labeler is not None:
                stack.enter_context(replay.labeler)
            for ctx in self._recompute_contexts():
                stack.enter_context(ctx)
            try:
                self._rerun(replay, args, kwargs)
            except _StopRecompute as stop:
                if stop.replay is not replay:
                    raise
            except RuntimeError as error:
                if _LEAF_IN_PLACE not in str(error):
                    raise
                raise self._modified_input(error) from error
        self._recomputed_for.add(backward_id)
        replay.check_complete()

    # -- error messages ------------------------------------------------------------------

    def _modified_input(self, error: RuntimeError) -> RuntimeError:
        """The error for a recompute that modified one of its inputs in place.

        The recompute runs on the saved inputs as leaves of a new graph, where autograd
        refuses an in-place change; the forward ran without that change (or with it on the
        caller's tensor), so the recompute could not have reproduced it. A
        :class:`CheckpointError` under the determinism check (as torch's check fails on what
        the change shifts), a plain ``RuntimeError`` without it."""
        message = (
            f"plait.checkpoint: recomputing {self.name} modified one of its inputs in place "
            f"({error.args[0].splitlines()[0]}). A checkpointed module's forward runs again in "
            "backward from the inputs it was called with, so it must not modify them in place "
            "(e.g. x.relu_(), nn.ReLU(inplace=True) as its first layer): use the out-of-place "
            "op, or clone the input first."
        )
        return CheckpointError(message) if self.options.check_metadata else RuntimeError(message)

    def describe(self, index: int, label: str | None) -> str:
        if self._labeler is None:
            return f"tensor #{index}"
        saved_by = self.labels[index] if index < len(self.labels) else "<nothing>"
        return f"tensor #{index} (saved by {saved_by!r} in the forward, by {label!r} on recompute)"


# autograd's refusal (torch/csrc/autograd) of an in-place op on a leaf that requires grad,
# or on a view of one: what a recompute's restored inputs are.
_LEAF_IN_PLACE = "leaf Variable that requires grad is being used in an in-place operation"


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class Replay:
    """One recompute of a region: matches the tensors it saves to the region's holders."""

    def __init__(self, region: Region, backward_id: int) -> None:
        self.region = region
        self.backward_id = backward_id
        self.count = 0
        self.ended = False
        self.labeler = _OpLabels() if region.options.debug else None

    def finish(self) -> None:
        """The module's forward returned: what is saved after this is not the region's."""
        self.ended = True

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        # Detached, so that the recomputed graph holds no reference cycle through it.
        x = x.detach()
        if self.ended:
            return x
        region, index = self.region, self.count
        self.count += 1
        label = self.labeler.current if self.labeler is not None else None
        if index >= len(region.holders):
            # A backward inside the forward (autograd.grad in forward) recomputes a region
            # that is still growing: what it saves past the current end is not needed.
            if region.options.check_metadata and region.forward_done:
                raise CheckpointError(
                    f"plait.checkpoint: recomputing {region.name} saved more tensors than its "
                    f"forward did ({len(region.holders)}); the extra one is "
                    f"{region.describe(index, label)}.\n{_DEBUG_TIP}"
                )
            return x
        holder = region.holders[index]()
        if holder is not None:  # None: freed by an earlier partial backward, not needed
            if region.options.check_metadata and _Meta.of(x) != region.metas[index]:
                raise CheckpointError(
                    f"plait.checkpoint: recomputing {region.name} saved a different "
                    f"{region.describe(index, label)} than its forward did.\n"
                    f"  forward:   {region.metas[index]}\n"
                    f"  recompute: {_Meta.of(x)}\n{_DEBUG_TIP}"
                )
            holder.recomputed[self.backward_id] = x
        if region.options.early_stop and self.count == len(region.holders):
            raise _StopRecompute(self)
        return x

    def check_complete(self) -> None:
        region = self.region
        if self.count < len(region.holders) and region.options.check_metadata:
            raise CheckpointError(
                f"plait.checkpoint: recomputing {region.name} saved fewer tensors than its "
                f"forward did: {self.count} instead of {len(region.holders)}.\n{_DEBUG_TIP}"
            )
