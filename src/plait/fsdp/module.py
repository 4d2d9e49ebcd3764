"""``FSDPModule``: the class a module gains under ``fully_shard``, with torch's methods.

Each method acts on the module's own unit (its ``FSDPState`` and parameter group) or, with
``recurse``, on every unit in its subtree; settings go to the units' ``UnitSettings``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from plait.fsdp.group import FSDPParamGroup
from plait.fsdp.param import swappable
from plait.fsdp.root import RootPass
from plait.fsdp.state import FSDPState, fsdp_state_of, fsdp_states_in

__all__ = ["FSDPDeepcopyError", "FSDPModule", "UnshardHandle"]


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the unshard."""

    def __init__(self, unit: FSDPParamGroup | None) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_for_unshard()
            self._unit = None


class FSDPDeepcopyError(RuntimeError, AssertionError):
    """``deepcopy`` of a sharded module. An ``AssertionError`` too, which torch raises and
    code written for torch catches."""


class FSDPModule(nn.Module):
    """Mixin the module's class gains under ``fully_shard`` (``isinstance`` works)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Constructing a sharded module's class builds the original, unsharded class.

        Containers build new instances of their own class: ``seq[0:2]`` calls
        ``type(seq)(...)``, which must give a plain ``nn.Sequential`` of the (still
        sharded) children, as in torch. Without arguments (unpickling) nothing changes.
        """
        if not args and not kwargs:
            return super().__new__(cls)
        original = cls.__mro__[cls.__mro__.index(FSDPModule) + 1]
        module = original.__new__(original, *args, **kwargs)
        module.__init__(*args, **kwargs)  # not an instance of cls: Python will not init it
        return module

    def _fsdp_state(self) -> FSDPState:
        state = fsdp_state_of(self)
        if state is None:
            raise RuntimeError(
                f"{type(self).__name__} is an FSDPModule without fully_shard state: create "
                "sharded modules with fully_shard, not by instantiating the class"
            )
        return state

    def _states(self, recurse: bool) -> list[FSDPState]:
        return fsdp_states_in(self) if recurse else [self._fsdp_state()]

    def _units(self, recurse: bool) -> list[FSDPParamGroup]:
        return [s.unit for s in self._states(recurse) if s.unit is not None]

    def _own_root_pass(self) -> RootPass[FSDPState] | None:
        """Where a root-level setter of this module writes: the pass of this unit if it is
        the root, or may still become it (before the first forward: created now, kept by
        lazy init if it does). ``None`` for a unit that is not the root, whose value torch
        would share with its root but plait has always ignored (only the root's is read).
        """
        state = self._fsdp_state()
        if state.is_root is False:
            return None
        if state.root_pass is None:
            state.root_pass = RootPass()
        return state.root_pass

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As ``nn.Module``'s, after taking in parameters replaced since ``fully_shard``.

        So an optimizer built after such a replacement gets the sharded parameters. Once
        the root has run its first forward (which takes them in too) this is free, since
        ``zero_grad`` calls it every step.
        """
        if self._fsdp_state().is_root is None:
            for state in fsdp_states_in(self):
                if state.unit is not None:
                    state.unit.adopt_replacements()
        return super().named_parameters(*args, **kwargs)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters; with ``async_op`` return a handle to wait on."""
        unit = self._fsdp_state().unit
        if unit is not None:
            unit.unshard(async_op=async_op)
        return UnshardHandle(unit) if async_op else None

    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds the sharded ones again."""
        unit = self._fsdp_state().unit
        if unit is not None:
            unit.reshard()

    # ``recurse`` may be given by position in every setter (torch's
    # ``set_reshard_after_forward(True, False)``) or by keyword.

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, recurse: bool = True
    ) -> None:
        """Off: gradients accumulate unsharded and unreduced until it is turned back on."""
        for state in self._states(recurse):
            state.settings.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, recurse: bool = True
    ) -> None:
        for state in self._states(recurse):
            state.settings.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free the parameters after forward (True) or keep them for backward (False)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                "set_reshard_after_forward: reshard_after_forward must be a bool, got "
                f"{reshard_after_forward!r} (an int group size is only for fully_shard itself)"
            )
        for state in self._states(recurse):
            state.settings.reshard_after_forward = reshard_after_forward

    def set_requires_all_reduce(self, requires_all_reduce: bool, recurse: bool = True) -> None:
        """HSDP: False defers the cross-replica all-reduce (the reduce-scatter still runs)."""
        for state in self._states(recurse):
            state.settings.requires_all_reduce = requires_all_reduce

    # --- gradient reduction of this module's own unit (torch: not recursive) ----------------

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's summed gradients by ``factor`` instead of averaging them.

        ``1.0`` keeps the plain sum (for loops that normalise the loss themselves, as
        torchtitan does). The division happens where torch's does, so results match it.
        """
        self._fsdp_state().settings.gradient_divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of :meth:`set_gradient_divide_factor` (as in torch)."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
            DeprecationWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """True: the collectives only ever sum; the division runs as separate kernels."""
        self._fsdp_state().settings.force_sum_reduction_for_comms = enable

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """Call ``hook(reduced)`` on this rank's reduced gradients at every reduction.

        ``reduced`` is the flat reduce-scatter output (1-D mesh) or the output of the
        cross-replica all-reduce (HSDP), before the final division; the hook may change
        it in place, e.g. all-reduce it over another group. ``stream`` (a device stream;
        not with HSDP, whose all-reduce has its own) runs the hook on that stream.
        """
        state = self._fsdp_state()
        if state.unit is None:
            return
        if stream is not None and state.unit.groups.replicate is not None:
            raise ValueError("stream cannot be set when using native HSDP")
        state.settings.all_reduce_hook = hook
        state.settings.all_reduce_hook_stream = stream

    def set_custom_all_gather(self, comm: Any) -> None:
        """Run this unit's all-gathers through ``comm`` (torch's ``AllGather`` protocol:
        ``allocate(size, *, dtype, device)`` and ``comm(output_tensor=, input_tensor=,
        group=, async_op=)``)."""
        self._fsdp_state().settings.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Run this unit's reduce-scatters through ``comm`` (torch's ``ReduceScatter``
        protocol: ``allocate`` as for all-gather, and ``comm(output_tensor=, input_tensor=,
        group=, op=, async_op=)``)."""
        self._fsdp_state().settings.reduce_scatter_comm = comm

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """As ``nn.Module._apply`` (``to_empty``, ``.to``, ...), keeping shards consistent.

        Each ``fully_shard`` module re-points its own unit; inner ones do theirs when the
        recursion reaches them.
        """
        unit = self._fsdp_state().unit
        with swappable([p.sharded for p in unit.params] if unit is not None else []):
            out = super()._apply(fn, recurse)
        if unit is not None:
            for p in unit.params:
                p.reset_sharded()
            unit.lay_out()
        return out

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backward leaves its gradient reductions in flight (accumulation).

        They are completed at the next forward or backward, before the optimizer needs them.
        """
        root_pass = self._own_root_pass()
        if root_pass is not None:
            root_pass.is_last_backward = is_last_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these units (asynchronously) right after this one, in forward."""
        self._fsdp_state().forward_prefetch = _prefetch_states(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these units (asynchronously) right after this one, in backward."""
        self._fsdp_state().backward_prefetch = _prefetch_states(modules)

    # --- iteration state and communication knobs (torch 2.13's list) ----------------------

    def reset_iter_state(self) -> None:
        """Recover after an exception aborted a forward or backward (call on the root).

        Waits for the collectives already issued, reshards every unit and clears the
        per-step state, so the next step runs normally. The failed step's gradients still
        in flight or accumulated without sync are dropped: restart an accumulation.
        """
        state = self._fsdp_state()
        if state.is_root is False:
            raise RuntimeError(
                f"reset_iter_state must be called on the root fully_shard module, not on "
                f"{type(self).__name__} (a unit inside it)"
            )
        if state.is_root:
            assert state.root_pass is not None  # lazy init gives the root its pass
            state.root_pass.reset()
        else:  # never ran forward: nothing of a step to forget, but make sure it is sharded
            for unit in self._units(recurse=True):
                unit.discard_inflight()

    def set_post_optim_event(self, event: Any) -> None:
        """Make the next forward's first all-gather wait for ``event`` (then forget it).

        torch uses it so that its all-gather streams wait for the optimizer step only,
        not for whatever else the current stream ran after it. plait issues all-gathers
        on the current stream, after the optimizer step, so the order already holds; the
        event is still waited on (``event.wait()``: the current stream waits for it), once,
        at the root's next forward. Call it with a new event every step.
        """
        root = self._fsdp_state().root
        root_pass = root.root_pass if root is not None else self._own_root_pass()
        assert root_pass is not None
        root_pass.post_optim_event = event

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: do not all-gather this unit in backward (its weights are not needed
        there, e.g. an embedding's); its gradients are still computed and reduced."""
        self._fsdp_state().settings.unshard_in_backward = unshard_in_backward

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, recurse: bool = True
    ) -> None:
        """True: a trainable parameter that got no gradient on this rank contributes zeros,
        and one no rank used ends with a zero gradient instead of ``None``.

        torch needs this for conditional control flow, where ranks would otherwise issue
        different reduce-scatters; plait's reductions always include every trainable
        parameter (with a count of the ranks that used it), so the collectives match
        either way and this only changes the ``None`` into zeros, as in torch.
        """
        for state in self._states(recurse):
            state.settings.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, recurse: bool = True
    ) -> None:
        """How many units' gradient reductions may be in flight at once (default 1).

        More lets backward run ahead of slow reduce-scatters, at the cost of keeping
        their input buffers alive. The root uses the largest value among its units.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                "set_reduce_scatter_max_input_buffers: max_input_buffers must be an int, got "
                f"{type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(
                "set_reduce_scatter_max_input_buffers: max_input_buffers must be >= 1, got "
                f"{max_input_buffers}"
            )
        for state in self._states(recurse):
            state.settings.max_input_buffers = max_input_buffers
        root = self._fsdp_state().root
        if root is not None and root.root_pass is not None:
            limits = (s.settings.max_input_buffers for s in root.root_pass.states)
            root.root_pass.max_reductions_in_flight = max(limits, default=1)

    def set_separate_reduce_scatter_group(self, enable: bool = True, recurse: bool = True) -> None:
        """Accepted; no effect in plait.

        torch gives reduce-scatters their own NCCL communicator so that they overlap with
        all-gathers on the wire. plait issues both asynchronously on the unit's group and
        the backend orders them; a second communicator would be an optimisation for NCCL
        only, and gloo runs collectives of one group in order anyway.
        """
        _ = (enable, recurse)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted; no effect in plait, but refused as torch refuses it beside custom comms.

        torch then allocates its staging buffers with the process group's allocator (NCCL
        zero-copy over NVLink SHARP). plait allocates them with the tensor's device
        allocator; a custom allocation belongs to ``set_custom_all_gather`` /
        ``set_custom_reduce_scatter`` (whose ``allocate`` plait calls). With either of
        those set on this module it raises ``AssertionError``, as torch does (whichever
        ``enable``): the custom comm decides its own buffers.
        """
        _ = enable
        settings = self._fsdp_state().settings
        for kind, comm in (
            ("all gather", settings.all_gather_comm),
            ("reduce scatter", settings.reduce_scatter_comm),
        ):
            if comm is not None:
                raise AssertionError(
                    "cannot call set_allocate_memory_from_process_group() when "
                    f"{kind} comm is custom: {type(comm).__name__} (set with "
                    f"set_custom_{kind.replace(' ', '_')}, which allocates its own buffers)"
                )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted (``backend="NCCL"`` only, as torch); no effect in plait.

        torch then allocates all-gather buffers in NCCL symmetric memory, a CUDA-only
        transport optimisation that does not change results.
        """
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm: only backend='NCCL' exists, got {backend!r}")

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise FSDPDeepcopyError(
            f"deepcopy of a fully_shard-ed module ({type(self).__name__}) is not supported: its "
            "parameters are shards tied to communication state. Deepcopy the model before "
            "calling fully_shard, or save and load a state_dict."
        )


def _prefetch_states(modules: list[FSDPModule]) -> list[FSDPState]:
    states = []
    for m in modules:
        state = fsdp_state_of(m) if isinstance(m, nn.Module) else None
        if state is None:
            raise ValueError(
                f"prefetch targets must be fully_shard-ed modules, got {type(m).__name__}: "
                "call fully_shard on it first"
            )
        states.append(state)
    return states
