"""``fully_shard``: sharded data parallelism (FSDP / ZeRO-3) as a composable API.

``fully_shard(module)`` makes the parameters of ``module`` that no inner ``fully_shard``
call owns into one *unit*: between uses each rank holds only its ``Shard(0)`` chunk of
each parameter (as a DTensor parameter); the unit is all-gathered just before its forward
and its backward and freed after; its gradients are reduce-scattered so each rank keeps
the averaged gradient of its own chunk. The module stays the same object, keeps every
name, and becomes an instance of ``FSDPModule`` (torch's method names).

``fully_shard([a, b])`` makes one unit of several modules (tied weights belong in one
unit); a later ``fully_shard(parent)`` leaves it alone, as any inner unit.

Where plait differs from torch, on purpose: ``deepcopy`` of a sharded module raises
(deepcopy the model before sharding; the error is an ``AssertionError`` as torch's); a
parameter no rank used in a step keeps ``grad=None`` exactly as in one process.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.weak import WeakIdKeyDictionary

from plait.contract import contract, get_registry, with_mixin
from plait.fsdp.group import FSDPParamGroup, Groups
from plait.fsdp.param import FSDPParam, Location, ParamPolicy, resolve_shard_dim
from plait.fsdp.policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from plait.fsdp.state import FSDPState, fsdp_states_in
from plait.fsdp.state_dict import register_state_dict_hooks
from plait.fsdp.tp import combined_mesh
from plait.hooks import outside_graphs
from plait.mesh import (
    check_mesh_device,
    data_parallel_submesh,
    default_mesh,
    mesh_device,
    subgroup,
)

__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "fsdp_states_in",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the unshard."""

    def __init__(self, unit: FSDPParamGroup | None) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_for_unshard()
            self._unit = None


class FSDPArgumentError(ValueError, AssertionError):
    """A misuse torch reports with ``AssertionError``: plait's ``ValueError`` is both."""


class FSDPUnsupportedError(ValueError, NotImplementedError):
    """A parameter plait cannot shard (torch: ``NotImplementedError``); a ``ValueError``
    too."""


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
        state: FSDPState = fully_shard.state(self)
        return state

    def _states(self, recurse: bool) -> list[FSDPState]:
        return fsdp_states_in(self) if recurse else [self._fsdp_state()]

    def _units(self, recurse: bool) -> list[FSDPParamGroup]:
        return [s.unit for s in self._states(recurse) if s.unit is not None]

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As ``nn.Module``'s, after taking in parameters replaced since ``fully_shard``.

        So an optimizer built after such a replacement gets the sharded parameters. Once
        the root has run its first forward (which takes them in too) this is free, since
        ``zero_grad`` calls it every step.
        """
        if self._fsdp_state().is_root is None:
            for state in fsdp_states_in(self):
                state.adopt_replacements()
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
        for unit in self._units(recurse):
            unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, recurse: bool = True
    ) -> None:
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free the parameters after forward (True) or keep them for backward (False)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                "set_reshard_after_forward: reshard_after_forward must be a bool, got "
                f"{reshard_after_forward!r} (an int group size is only for fully_shard itself)"
            )
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_requires_all_reduce(self, requires_all_reduce: bool, recurse: bool = True) -> None:
        """HSDP: False defers the cross-replica all-reduce (the reduce-scatter still runs)."""
        for unit in self._units(recurse):
            unit.requires_all_reduce = requires_all_reduce

    # --- gradient reduction of this module's own unit (torch: not recursive) ----------------

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's summed gradients by ``factor`` instead of averaging them.

        ``1.0`` keeps the plain sum (for loops that normalise the loss themselves, as
        torchtitan does). The division happens where torch's does, so results match it.
        """
        for unit in self._units(recurse=False):
            unit.gradient_divide_factor = factor

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
        for unit in self._units(recurse=False):
            unit.force_sum_reduction_for_comms = enable

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """Call ``hook(reduced)`` on this rank's reduced gradients at every reduction.

        ``reduced`` is the flat reduce-scatter output (1-D mesh) or the output of the
        cross-replica all-reduce (HSDP), before the final division; the hook may change
        it in place, e.g. all-reduce it over another group. ``stream`` (a device stream;
        not with HSDP, whose all-reduce has its own) runs the hook on that stream.
        """
        for unit in self._units(recurse=False):
            if stream is not None and unit.groups.replicate is not None:
                raise ValueError("stream cannot be set when using native HSDP")
            unit.all_reduce_hook = hook
            unit.all_reduce_hook_stream = stream

    def set_custom_all_gather(self, comm: Any) -> None:
        """Run this unit's all-gathers through ``comm`` (torch's ``AllGather`` protocol:
        ``allocate(size, *, dtype, device)`` and ``comm(output_tensor=, input_tensor=,
        group=, async_op=)``)."""
        for unit in self._units(recurse=False):
            unit.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Run this unit's reduce-scatters through ``comm`` (torch's ``ReduceScatter``
        protocol: ``allocate`` as for all-gather, and ``comm(output_tensor=, input_tensor=,
        group=, op=, async_op=)``)."""
        for unit in self._units(recurse=False):
            unit.reduce_scatter_comm = comm

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """As ``nn.Module._apply`` (``to_empty``, ``.to``, ...), keeping shards consistent.

        Each ``fully_shard`` module re-points its own unit; inner ones do theirs when the
        recursion reaches them.
        """
        out = super()._apply(fn, recurse)
        unit = self._fsdp_state().unit
        if unit is not None:
            for p in unit.params:
                p.reset_sharded()
            unit.lay_out()
        return out

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backward leaves its gradient reductions in flight (accumulation).

        They are completed at the next forward or backward, before the optimizer needs them.
        """
        self._fsdp_state().is_last_backward = is_last_backward

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
            state.reset_iter_state()
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
        state = self._fsdp_state()
        (state.root or state).post_optim_event = event

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: do not all-gather this unit in backward (its weights are not needed
        there, e.g. an embedding's); its gradients are still computed and reduced."""
        self._fsdp_state().unshard_in_backward = unshard_in_backward

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
            state.reduce_scatter_unused_params = reduce_scatter_unused_params

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
            state.max_input_buffers = max_input_buffers
        root = self._fsdp_state().root
        if root is not None:
            limits = (s.max_input_buffers for s in root.all_states)
            root.max_reductions_in_flight = max(limits, default=1)

    def set_separate_reduce_scatter_group(self, enable: bool = True, recurse: bool = True) -> None:
        """Accepted; no effect in plait.

        torch gives reduce-scatters their own NCCL communicator so that they overlap with
        all-gathers on the wire. plait issues both asynchronously on the unit's group and
        the backend orders them; a second communicator would be an optimisation for NCCL
        only, and gloo runs collectives of one group in order anyway.
        """
        _ = (enable, recurse)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted; no effect in plait.

        torch then allocates its staging buffers with the process group's allocator (NCCL
        zero-copy over NVLink SHARP). plait allocates them with the tensor's device
        allocator; a custom allocation belongs to ``set_custom_all_gather`` /
        ``set_custom_reduce_scatter`` (whose ``allocate`` plait calls).
        """
        _ = enable

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
        state = fully_shard.state(m) if isinstance(m, nn.Module) else None
        if state is None:
            raise ValueError(
                f"prefetch targets must be fully_shard-ed modules, got {type(m).__name__}: "
                "call fully_shard on it first"
            )
        states.append(state)
    return states


def _check_arguments(
    modules: list[nn.Module],
    mesh: object,
    reshard_after_forward: object,
    mp_policy: object,
    offload_policy: object,
) -> None:
    for module in modules:
        if "replicate" in (get_registry(module) or {}):  # submodules: left to replicate
            raise RuntimeError(
                f"fully_shard cannot be applied to {type(module).__name__}: it is already "
                "managed by replicate. Use fully_shard with a 2-D mesh (HSDP) to combine "
                "replication and sharding."
            )
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise FSDPArgumentError(
            "fully_shard: a 2-D mesh (HSDP) needs mesh_dim_names, e.g. init_device_mesh("
            '..., mesh_dim_names=("dp_replicate", "dp_shard")): dim 0 replicates, dim 1 shards'
        )
    if isinstance(mesh, DeviceMesh) and mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard: mesh must be 1-D (sharding) or 2-D (replicate, shard) for HSDP, got "
            f"a {mesh.ndim}-D mesh with dims {mesh.mesh_dim_names}: slice it, e.g. "
            'mesh["dp_shard"] or mesh["dp_replicate", "dp_shard"]'
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise TypeError(
            "fully_shard: reshard_after_forward must be True, False, None or an int (the "
            f"group size to reshard to after forward), got {reshard_after_forward!r}"
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"fully_shard: offload_policy must be an OffloadPolicy, got {offload_policy!r}"
        )


def _make_groups(mesh: DeviceMesh, reshard_after_forward: bool | int | None) -> Groups:
    """The shard / replicate / post-forward groups of ``mesh`` (shard = last dim)."""
    shard = mesh.get_group(mesh.ndim - 1)
    rank, world = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
    replicate = mesh.get_group(0) if mesh.ndim == 2 else None
    groups = Groups(shard, rank, world, replicate, mesh.size(0) if replicate is not None else 1)
    k = reshard_after_forward
    if isinstance(k, bool) or k is None or k in (1, world):
        return groups
    if k < 1 or world % k:
        raise ValueError(
            f"fully_shard: reshard_after_forward={k} must divide the shard group size {world} "
            "(the group size parameters are resharded to after forward); use a divisor, "
            "or True / False"
        )
    return Groups(
        shard, rank, world, replicate, groups.replicate_world, subgroup(shard, rank // k, k), k
    )


def _resolve_reshard(value: bool | int | None, world: int) -> bool | None:
    """The bool meaning of ``reshard_after_forward`` (an int other than 1 reshards)."""
    if value is None or isinstance(value, bool):
        return value
    return value != 1 or world == 1


def _collect_params(
    modules: list[nn.Module], ignored: set[nn.Parameter], mesh: DeviceMesh
) -> dict[nn.Parameter, list[Location]]:
    """This unit's parameters with every place they are referenced from, in order."""
    inner = [s for m in modules for s in fsdp_states_in(m)]
    owned_by_inner = {
        param: s
        for s in inner
        if s.unit is not None
        for p in s.unit.params
        for param in (p.sharded, p.original())
        if param is not None
    }
    # Parameters of submodules that replicate manages are replicate's (torch does the same).
    replicated = {
        id(p)
        for module in modules
        for sub in module.modules()
        if "replicate" in (get_registry(sub) or {})
        for p in sub.parameters()
    }
    found: dict[nn.Parameter, list[Location]] = {}
    for module in modules:
        for prefix, sub in module.named_modules(remove_duplicate=False):
            for name, param in sub._parameters.items():
                if param is None or param in ignored or id(param) in replicated:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                owner = owned_by_inner.get(param)
                if owner is not None:
                    if not any(sub is m for om in owner.modules for m in om.modules()):
                        raise ValueError(
                            f"fully_shard: parameter {fqn!r} is shared with another fully_shard "
                            f"unit ({owner.name}); a parameter can belong to one unit only. "
                            "Shard all its users as one unit: fully_shard([module_a, module_b])."
                        )
                    continue
                _check_shardable(fqn, param, mesh)
                locations = found.setdefault(param, [])
                if all(loc.module is not sub or loc.name != name for loc in locations):
                    locations.append(Location(sub, name, fqn))
    return found


def _data_parallel_mesh(
    modules: list[nn.Module], mesh: DeviceMesh | None, dims: DataParallelMeshDims
) -> DeviceMesh:
    """The mesh ``fully_shard`` runs over when given ``dp_mesh_dims``; parameters that are
    DTensors on the whole ``mesh`` are taken in as their model-parallel form."""
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(f"fully_shard: dp_mesh_dims must be a DataParallelMeshDims, got {dims!r}")
    if mesh is None:
        raise ValueError(
            "fully_shard: dp_mesh_dims names dims of mesh=, but no mesh was given: pass the "
            "full device mesh"
        )
    dp_names = dims.replicate_names + dims.shard_names
    dp_mesh = data_parallel_submesh(mesh, dims.replicate_names, dims.shard_names, "fully_shard")
    for m in modules:
        _localize_full_mesh_params(m, mesh, dp_names)
    return dp_mesh


def _localize_full_mesh_params(
    module: nn.Module, mesh: DeviceMesh, dp_names: tuple[str, ...]
) -> None:
    """Replace DTensor parameters on the whole ``mesh`` (torch 2.13's full-mesh form) by
    what plait shards: replicated on every dim, their local tensor; placed on the other
    (tensor-parallel) dims, a DTensor on the sub-mesh of those dims. One new parameter per
    original, so tied parameters stay tied.

    Other DTensors (inner units' shards, parameters already on a tp sub-mesh) are left as
    they are: inner units keep theirs, and ``_check_shardable`` checks the rest.
    """
    names = mesh.mesh_dim_names or ()
    model_dims = [i for i, n in enumerate(names) if n not in dp_names]
    local: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            data: object = param.data if param is not None else None
            if not isinstance(data, DTensor) or data.device_mesh != mesh:
                continue
            placements = data.placements
            if any(
                not isinstance(placements[i], Replicate)
                for i, n in enumerate(names)
                if n in dp_names
            ):
                continue  # sharded on a data-parallel dim: not a parameter to shard again
            assert param is not None
            if id(param) not in local:
                value: torch.Tensor = data.to_local()
                if not all(isinstance(placements[i], Replicate) for i in model_dims):
                    value = DTensor.from_local(
                        value,
                        mesh[tuple(names[i] for i in model_dims)],
                        [placements[i] for i in model_dims],
                        run_check=False,
                        shape=data.shape,
                        stride=data.stride(),
                    )
                local[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
            sub._parameters[name] = local[id(param)]


def _check_shardable(fqn: str, param: torch.Tensor, mesh: DeviceMesh) -> None:
    if param.numel() == 0:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} has no elements; pass it in ignored_params"
        )
    if param.dim() == 0:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is 0-dim and cannot be sharded on dim 0: "
            "store it with shape (1,), or pass it in ignored_params"
        )
    if isinstance(param, DTensor):
        check_tp_param(fqn, param, mesh)
    if not param.is_contiguous():
        raise FSDPUnsupportedError(
            f"fully_shard: parameter {fqn!r} is not contiguous (strides {param.stride()}): "
            "make it contiguous before fully_shard (param.data = param.data.contiguous())"
        )


def check_tp_param(fqn: str, param: DTensor, dp_mesh: DeviceMesh) -> None:
    """Refuse, naming ``fqn`` and the fix, a DTensor parameter ``fully_shard`` over
    ``dp_mesh`` cannot shard: one on a mesh that overlaps ``dp_mesh`` or is not a sibling
    sub-mesh of it, or with a placement other than ``Shard`` / ``Replicate``."""
    tp_mesh = param.device_mesh
    dp_names = set(dp_mesh.mesh_dim_names or ())
    tp_names = set(tp_mesh.mesh_dim_names or ())
    separate = bool(tp_names) and not dp_names & tp_names
    if separate:
        try:  # what the sharded parameters will live on: torch checks the two are orthogonal
            combined_mesh(dp_mesh, tp_mesh)
        except (RuntimeError, AssertionError):
            separate = False
    if not separate:
        raise FSDPUnsupportedError(
            f"fully_shard: parameter {fqn!r} is a DTensor on mesh {tp_mesh}, which is not a "
            f"separate dimension of the same device mesh as fully_shard's mesh {dp_mesh}. "
            'Tensor-parallelize over one sub-mesh (e.g. mesh["tp"]) and fully_shard over '
            'the data-parallel dims of the same mesh (e.g. mesh["dp_shard"])'
        )
    for placement in param.placements:
        if type(placement) not in (Shard, Replicate):
            raise FSDPUnsupportedError(
                f"fully_shard: parameter {fqn!r} has placement {placement} on its "
                f"tensor-parallel mesh; only Shard(dim) and Replicate() can be sharded "
                "further: redistribute it first"
            )


@contract(FSDPState)
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, shared
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen, shared
    ignored_params: Iterable[nn.Parameter] | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    conditional: bool = False,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters over ``mesh``; see the module docstring.

    ``shard_placement_fn(param)`` chooses each parameter's shard dim: ``Shard(d)`` (``d``
    may be negative) or ``None`` for ``Shard(0)``. Unlike torch, any dim may be uneven.

    ``dp_mesh_dims`` (torch 2.13's full-mesh form): ``mesh`` is the whole mesh and
    ``dp_mesh_dims`` names its data-parallel dims; plait shards over those dims (a
    ``replicate`` dim makes it HSDP). Its other dims must have size 1 for now, and
    parameters may be plain tensors or DTensors replicated on every dim of ``mesh``
    (taken as their local tensor). Unlike torch, sharded parameters are DTensors on the
    data-parallel sub-mesh, not on the whole mesh.

    ``conditional=True`` (plait only) is for a module that may not run on every rank in a
    step (a mixture-of-experts expert, a modality tower): its all-gather runs on every
    rank when its enclosing unit unshards, and its reduce-scatter at the end of backward
    (zeros from ranks where it did not run), so the ranks' collectives always match. It
    stays unsharded from its parent's forward to the end of backward.
    """
    modules = [module] if isinstance(module, nn.Module) else list(module)
    if dp_mesh_dims is not None:
        mesh = _data_parallel_mesh(modules, mesh, dp_mesh_dims)
    _check_arguments(modules, mesh, reshard_after_forward, mp_policy, offload_policy)
    mesh = mesh if mesh is not None else default_mesh(modules[0], "fully_shard")
    if not isinstance(offload_policy, CPUOffloadPolicy):  # offloaded shards live on the CPU
        for m in modules:
            check_mesh_device(mesh, m, "fully_shard")
    groups = _make_groups(mesh, reshard_after_forward)
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    policy = ParamPolicy(
        mp_policy.param_dtype,
        mp_policy.reduce_dtype,
        mesh_device(mesh),
        offload,
        offload and offload_policy.pin_memory,  # type: ignore[attr-defined]
    )
    found = _collect_params(modules, set(ignored_params or ()), mesh)
    # Every placement is checked before any parameter is sharded: a refusal changes nothing.
    dims = [
        resolve_shard_dim(shard_placement_fn(p), p, locs[0].fqn) if shard_placement_fn else 0
        for p, locs in found.items()
    ]
    params = [
        FSDPParam(p, locs, mesh, groups.rank, groups.world, policy, dim)
        for (p, locs), dim in zip(found.items(), dims, strict=True)
    ]

    state: FSDPState = fully_shard.state(modules[0])
    state.modules = modules
    state.param_uids = {locs[0].fqn: _param_uid(p) for p, locs in found.items()}
    state.reshard_after_forward = _resolve_reshard(reshard_after_forward, groups.world)
    state.mp_policy = mp_policy
    state.conditional = bool(conditional)
    state.unit = FSDPParamGroup(params, groups) if params else None
    register_state_dict_hooks(state)
    # Kept out of compiled graphs: they swap parameters and issue collectives.
    pre_forward = outside_graphs(state.pre_forward)
    post_forward = outside_graphs(state.post_forward)
    for m in modules:
        m.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
        m.register_forward_hook(post_forward)
        with_mixin(m, FSDPModule, "FSDP")
    return module


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` unshard and reshard like ``forward`` does.

    A no-op on a module that is not ``fully_shard``-ed (as torch), so one code path
    serves sharded and unsharded runs.
    """
    state: FSDPState | None = fully_shard.state(module)
    if state is None:
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}"
        )
    method: Callable[..., Any] = getattr(module, method_name)
    pre_forward = outside_graphs(state.pre_forward)  # as the forward hooks: never traced
    post_forward = outside_graphs(state.post_forward)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        replaced = pre_forward(module, args, kwargs)
        if replaced is not None:
            args, kwargs = replaced
        return post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Accepted for torch's API; no effect in plait (each must be an ``FSDPModule``).

    torch shares the CUDA streams of several roots (pipeline stages of one rank) to avoid
    memory fragmentation between streams. plait creates no streams: every unit
    communicates on the current stream, so roots share it already.
    """
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"share_comm_ctx expects fully_shard-ed modules, got {type(m).__name__}: "
                "call fully_shard on it first"
            )


# The identity of each parameter given to fully_shard, kept in a number so that a tie
# between two units is found even after both replaced the original parameter (ids of
# dead objects are reused; these numbers are not).
_PARAM_UIDS = WeakIdKeyDictionary()  # keyed by identity: tensors' == is elementwise
_NEXT_UID = itertools.count()


def _param_uid(param: nn.Parameter) -> int:
    uid: int | None = _PARAM_UIDS.get(param)
    if uid is None:
        uid = _PARAM_UIDS[param] = next(_NEXT_UID)
    return uid
