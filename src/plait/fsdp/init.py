"""What ``fully_shard`` does before a unit exists: check its arguments, resolve the mesh
into process groups, find the unit's parameters (refusing those it cannot shard, naming
them and the fix) and shard them.

Every check runs before any parameter is sharded: a refused call changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from plait.contract import get_registry
from plait.fsdp.collectives import Groups
from plait.fsdp.group import FSDPParamGroup
from plait.fsdp.mesh_groups import MeshGroups
from plait.fsdp.param import FSDPParam, Location, ParamPolicy, param_uid
from plait.fsdp.placement import resolve_placement
from plait.fsdp.policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from plait.fsdp.settings import UnitSettings
from plait.fsdp.state import fsdp_states_in
from plait.fsdp.tp import combined_mesh
from plait.mesh import data_parallel_submesh, mesh_device, subgroup

__all__ = [
    "FSDPArgumentError",
    "FSDPUnsupportedError",
    "_get_managed_modules",
    "_get_managed_states",
    "check_arguments",
    "check_policies",
    "check_tp_param",
    "collect_params",
    "data_parallel_mesh",
    "make_groups",
    "param_locations",
    "param_uid",
    "shard_params",
]


class FSDPArgumentError(ValueError, AssertionError):
    """A misuse torch reports with ``AssertionError``: plait's ``ValueError`` is both."""


class FSDPUnsupportedError(ValueError, NotImplementedError):
    """A parameter plait cannot shard (torch: ``NotImplementedError``); a ``ValueError``
    too."""


def check_arguments(
    modules: list[nn.Module],
    mesh: object,
    reshard_after_forward: object,
    mp_policy: object,
    offload_policy: object,
) -> None:
    """Refuse arguments of the wrong type or shape, and modules ``replicate`` manages."""
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
            # torch's sentence first (code written for torch matches on it), then plait's.
            "Please init the 2D mesh for HSDP with mesh_dim_names specified. "
            "fully_shard: a 2-D mesh (HSDP) needs mesh_dim_names, e.g. init_device_mesh("
            '..., mesh_dim_names=("dp_replicate", "dp_shard")): dim 0 replicates, dim 1 shards'
        )
    if isinstance(mesh, DeviceMesh) and mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}. "
            f"fully_shard: mesh must be 1-D (sharding) or 2-D (replicate, shard) for HSDP, got "
            f"a {mesh.ndim}-D mesh with dims {mesh.mesh_dim_names}: slice it, e.g. "
            'mesh["dp_shard"] or mesh["dp_replicate", "dp_shard"]'
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise TypeError(
            "fully_shard: reshard_after_forward must be True, False, None or an int (the "
            f"group size to reshard to after forward), got {reshard_after_forward!r}"
        )
    check_policies("fully_shard", mp_policy, offload_policy)


def check_policies(api: str, mp_policy: object, offload_policy: object) -> None:
    """TypeError unless the policies are plait's (or subclasses); ``api`` names the caller."""
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"{api}: mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"{api}: offload_policy must be an OffloadPolicy, got {offload_policy!r}")


def data_parallel_mesh(
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


def make_groups(mesh: DeviceMesh, reshard_after_forward: bool | int | None) -> Groups:
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


def collect_params(
    modules: list[nn.Module], ignored: set[nn.Parameter], mesh: DeviceMesh | None
) -> dict[nn.Parameter, list[Location]]:
    """This unit's parameters with every place they are referenced from, in order.

    ``mesh``: what DTensor parameters are checked against; ``None`` when
    ``shard_placement_fn`` picks each one's mesh (``shard_params`` checks them then)."""
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

    def keep(sub: nn.Module, fqn: str, param: nn.Parameter) -> bool:
        if param in ignored or id(param) in replicated:
            return False
        owner = owned_by_inner.get(param)
        if owner is not None:
            if not any(sub is m for om in owner.modules for m in om.modules()):
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} is shared with another fully_shard "
                    f"unit ({owner.name}); a parameter can belong to one unit only. "
                    "Shard all its users as one unit: fully_shard([module_a, module_b])."
                )
            return False
        _check_shardable(fqn, param, mesh)
        return True

    return param_locations(modules, keep)


def _get_managed_modules(
    root_modules: tuple[nn.Module, ...], ignored_params: set[nn.Parameter] | None = None
) -> list[nn.Module]:
    """The modules a ``fully_shard(root_modules)`` call would manage, each once, children
    before their parent (torch's private helper of the same name and contract).

    The walk stops at a module ``replicate`` manages and at a nested ``fully_shard`` unit
    (one not among ``root_modules``): they manage their own subtrees. A module whose
    direct parameters are all in ``ignored_params`` is left out. Code written against
    torch's helper counts plait's units through this one.
    """
    roots = {id(m) for m in root_modules}
    seen: set[int] = set()
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        applied = set(get_registry(module) or ())  # the composable APIs on this module
        if "replicate" in applied or (id(module) not in roots and "fully_shard" in applied):
            return
        seen.add(id(module))
        for child in module.children():
            if id(child) not in seen:
                visit(child)
        found.append(module)

    for root in root_modules:
        visit(root)
    if not ignored_params:
        return found

    def all_ignored(module: nn.Module) -> bool:
        own = list(module.parameters(recurse=False))
        return bool(own) and all(p in ignored_params for p in own)

    return [m for m in found if not all_ignored(m)]


def _get_managed_states(
    modules: list[nn.Module], ignored_params: set[nn.Parameter] | None = None
) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """The parameters and buffers registered directly on ``modules`` (from
    :func:`_get_managed_modules`), each once, ignored parameters left out; a 0-dim
    parameter is refused as ``fully_shard`` refuses it (torch's private helper)."""
    ignored = ignored_params or set()
    params: dict[int, nn.Parameter] = {}
    buffers: dict[int, torch.Tensor] = {}
    for module in modules:
        for name, param in module.named_parameters(recurse=False):
            if param in ignored or id(param) in params:
                continue
            if param.dim() == 0:
                _check_shardable(name, param, None)  # raises, torch's sentence included
            params[id(param)] = param
        for buffer in module.buffers(recurse=False):
            buffers.setdefault(id(buffer), buffer)
    return list(params.values()), list(buffers.values())


def param_locations(
    modules: list[nn.Module], keep: Callable[[nn.Module, str, nn.Parameter], bool]
) -> dict[nn.Parameter, list[Location]]:
    """Every parameter of ``modules`` that ``keep`` accepts, with every place the module
    trees refer to it from, in registration order.

    ``keep(submodule, fqn, param)`` is asked once per reference (a shared parameter is
    asked again from each place it is registered); it may raise to refuse the call. Both
    ``fully_shard`` and ``replicate`` find their unit's parameters through this one walk,
    so a shared or tied parameter is one entry with several locations under either API.
    """
    found: dict[nn.Parameter, list[Location]] = {}
    for module in modules:
        for prefix, sub in module.named_modules(remove_duplicate=False):
            for name, param in sub._parameters.items():
                if param is None:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                if not keep(sub, fqn, param):
                    continue
                locations = found.setdefault(param, [])
                # A module registered under two names is walked twice: one location each.
                if all(loc.module is not sub or loc.name != name for loc in locations):
                    locations.append(Location(sub, name, fqn))
    return found


def _check_shardable(fqn: str, param: torch.Tensor, mesh: DeviceMesh | None) -> None:
    if param.numel() == 0:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} has no elements; pass it in ignored_params"
        )
    if param.dim() == 0:
        raise ValueError(
            "fully_shard doesn't support scalar parameters. "
            f"Change {fqn} to a 1D tensor with numel equal to 1. "
            f"fully_shard: parameter {fqn!r} is 0-dim and cannot be sharded on dim 0: "
            "store it with shape (1,), or pass it in ignored_params"
        )
    if isinstance(param, DTensor) and mesh is not None:
        check_tp_param(fqn, param, mesh)
    if not param.is_contiguous():
        raise FSDPUnsupportedError(
            "FSDP does not support non-contiguous parameters yet: "
            f"param.shape={param.shape} param.stride()={param.stride()}. "
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


def shard_params(
    found: dict[nn.Parameter, list[Location]],
    mesh: DeviceMesh,
    groups: Groups,
    settings: UnitSettings,
    shard_placement_fn: Callable[[nn.Parameter], object] | None,
    reshard_after_forward: bool | int | None = None,
) -> FSDPParamGroup | None:
    """The unit: its parameters sharded on the dims (and meshes) ``shard_placement_fn``
    picks (``placement.py``), one parameter group per mesh; ``None`` without parameters."""
    # Every placement is checked before any parameter is sharded: a refusal changes nothing.
    placed: dict[DeviceMesh, list[tuple[nn.Parameter, int]]] = {}
    for p, locs in found.items():
        dim, p_mesh = 0, mesh
        if shard_placement_fn is not None:
            dim, p_mesh = resolve_placement(shard_placement_fn(p), p, locs[0].fqn, mesh)
            if isinstance(p, DTensor):
                check_tp_param(locs[0].fqn, p, p_mesh)
        placed.setdefault(p_mesh, []).append((p, dim))
    if not placed:
        return None
    meshes = sorted(placed, key=lambda m: m != mesh)  # the unit's own mesh first
    # Every group's process groups (and their checks) before any parameter is sharded.
    of_mesh = [groups if m == mesh else make_groups(m, reshard_after_forward) for m in meshes]
    units = []
    for p_mesh, p_groups in zip(meshes, of_mesh, strict=True):
        offload = settings.offload_policy
        policy = ParamPolicy(
            settings.mp_policy.param_dtype,
            settings.mp_policy.reduce_dtype,
            mesh_device(p_mesh),
            isinstance(offload, CPUOffloadPolicy),
            isinstance(offload, CPUOffloadPolicy) and offload.pin_memory,
        )
        params = [
            FSDPParam(p, found[p], p_mesh, p_groups.rank, p_groups.world, policy, dim)
            for p, dim in placed[p_mesh]
        ]
        units.append(FSDPParamGroup(params, p_groups, settings))
    return units[0] if len(units) == 1 else MeshGroups(units, meshes)
