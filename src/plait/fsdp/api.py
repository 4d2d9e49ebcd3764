"""``fully_shard``: sharded data parallelism (FSDP / ZeRO-3) as a composable API.

``fully_shard(module)`` makes the parameters of ``module`` that no inner ``fully_shard``
call owns into one *unit*: between uses each rank holds only its ``Shard(0)`` chunk of
each parameter (as a DTensor parameter); the unit is all-gathered just before its forward
and its backward and freed after; its gradients are reduce-scattered so each rank keeps
the averaged gradient of its own chunk. The module stays the same object, keeps every
name, and becomes an instance of ``FSDPModule`` (torch's method names).

Where plait differs from torch, on purpose: ``deepcopy`` of a sharded module raises
(deepcopy the model before sharding); a parameter no rank used in a step keeps
``grad=None`` exactly as in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.contract import contract, refuse_if_managed, with_mixin
from plait.fsdp.group import FSDPParamGroup, Groups
from plait.fsdp.param import FSDPParam, Location, ParamPolicy
from plait.fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from plait.fsdp.state import FSDPState
from plait.fsdp.state_dict import register_state_dict_hooks
from plait.mesh import check_mesh_device, default_mesh, mesh_device, subgroup

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the unshard."""

    def __init__(self, unit: FSDPParamGroup | None) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_for_unshard()
            self._unit = None


def fsdp_states_in(module: nn.Module) -> list[FSDPState]:
    """The ``fully_shard`` states in ``module``'s subtree, in pre-order (module first)."""
    states: list[FSDPState] = []
    seen: set[int] = set()  # modules of one list share a state
    for m in module.modules():
        state = fully_shard.state(m)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            states.append(state)
    return states


class FSDPModule(nn.Module):
    """Mixin the module's class gains under ``fully_shard`` (``isinstance`` works)."""

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

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Off: gradients accumulate unsharded and unreduced until it is turned back on."""
        for unit in self._units(recurse):
            unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False defers the cross-replica all-reduce (the reduce-scatter still runs)."""
        for unit in self._units(recurse):
            unit.requires_all_reduce = requires_all_reduce

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

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise RuntimeError(
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
        refuse_if_managed(
            module,
            "fully_shard",
            "replicate",
            "Use fully_shard with a 2-D mesh (HSDP) to combine replication and sharding.",
        )
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
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
    modules: list[nn.Module], ignored: set[nn.Parameter]
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
    found: dict[nn.Parameter, list[Location]] = {}
    for module in modules:
        for prefix, sub in module.named_modules(remove_duplicate=False):
            for name, param in sub._parameters.items():
                if param is None or param in ignored:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                owner = owned_by_inner.get(param)
                if owner is not None:
                    assert owner.module is not None
                    if not any(sub is m for m in owner.module.modules()):
                        raise ValueError(
                            f"fully_shard: parameter {fqn!r} is shared with another fully_shard "
                            f"unit ({type(owner.module).__name__}); a parameter can belong to one "
                            "unit only. Put both users of the parameter inside the same unit."
                        )
                    continue
                _check_shardable(fqn, param)
                locations = found.setdefault(param, [])
                if all(loc.module is not sub or loc.name != name for loc in locations):
                    locations.append(Location(sub, name, fqn))
    return found


def _check_shardable(fqn: str, param: torch.Tensor) -> None:
    if param.numel() == 0:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} has no elements; pass it in ignored_params"
        )
    if param.dim() == 0:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is 0-dim and cannot be sharded on dim 0: "
            "store it with shape (1,), or pass it in ignored_params"
        )
    if not param.is_contiguous():
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is not contiguous (strides {param.stride()}): "
            "make it contiguous before fully_shard (param.data = param.data.contiguous())"
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
    conditional: bool = False,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters over ``mesh``; see the module docstring.

    ``conditional=True`` (plait only) is for a module that may not run on every rank in a
    step (a mixture-of-experts expert, a modality tower): its all-gather runs on every
    rank when its enclosing unit unshards, and its reduce-scatter at the end of backward
    (zeros from ranks where it did not run), so the ranks' collectives always match. It
    stays unsharded from its parent's forward to the end of backward.
    """
    modules = [module] if isinstance(module, nn.Module) else list(module)
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
    found = _collect_params(modules, set(ignored_params or ()))
    params = [
        FSDPParam(p, locs, mesh, groups.rank, groups.world, policy) for p, locs in found.items()
    ]

    state: FSDPState = fully_shard.state(modules[0])
    state.module = modules[0]
    state.reshard_after_forward = _resolve_reshard(reshard_after_forward, groups.world)
    state.mp_policy = mp_policy
    state.conditional = bool(conditional)
    state.unit = FSDPParamGroup(params, groups) if params else None
    register_state_dict_hooks(state)
    for m in modules:
        m.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
        m.register_forward_hook(state.post_forward)
        with_mixin(m, FSDPModule, "FSDP")
    return module


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` unshard and reshard like ``forward`` does."""
    state = fully_shard.state(module)
    if state is None:
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} is not fully_shard-ed; "
            "call fully_shard on it first"
        )
    method: Callable[..., Any] = getattr(module, method_name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        replaced = state.pre_forward(module, args, kwargs)
        if replaced is not None:
            args, kwargs = replaced
        return state.post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)
