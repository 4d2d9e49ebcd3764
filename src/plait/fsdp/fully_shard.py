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

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from plait.contract import contract, with_mixin
from plait.fsdp.init import (
    check_arguments,
    collect_params,
    data_parallel_mesh,
    make_groups,
    param_uid,
    shard_params,
)
from plait.fsdp.module import FSDPModule
from plait.fsdp.placement import ShardPlacement
from plait.fsdp.policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from plait.fsdp.settings import UnitSettings, resolve_reshard_after_forward
from plait.fsdp.state import FSDPState, fsdp_state_of
from plait.fsdp.state_dict import register_state_dict_hooks
from plait.hooks import outside_graphs
from plait.mesh import buffers_to_mesh_device, check_mesh_device, default_mesh

__all__ = ["attach_unit", "fully_shard", "register_fsdp_forward_method", "share_comm_ctx"]


@contract(FSDPState)
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, shared
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen, shared
    ignored_params: Iterable[nn.Parameter] | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | ShardPlacement | object | None]
    | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    conditional: bool = False,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters over ``mesh``; see the module docstring.

    ``shard_placement_fn(param)`` chooses each parameter's shard dim: ``Shard(d)`` (``d``
    may be negative) or ``None`` for ``Shard(0)``. Unlike torch, any dim may be uneven.
    Returning ``ShardPlacement(placement, mesh)`` (or torch's ``ShardPlacementResult``)
    puts the parameter on another mesh: the unit then holds one parameter group per mesh
    (one all-gather and one reduce-scatter each; ``plait.fsdp.placement``), e.g. experts
    on ``mesh["efsdp"]`` beside their ``ep`` sharding and the rest on ``mesh["dp"]``.

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
        mesh = data_parallel_mesh(modules, mesh, dp_mesh_dims)
    check_arguments(modules, mesh, reshard_after_forward, mp_policy, offload_policy)
    mesh = mesh if mesh is not None else default_mesh(modules[0], "fully_shard")
    if not isinstance(offload_policy, CPUOffloadPolicy):
        for m in modules:
            check_mesh_device(mesh, m, "fully_shard")
    else:  # offloaded shards live on the CPU; buffers go where forward runs
        buffers_to_mesh_device(mesh, modules)
    groups = make_groups(mesh, reshard_after_forward)
    settings = UnitSettings(
        mp_policy,
        offload_policy,
        resolve_reshard_after_forward(reshard_after_forward, groups.world),
        conditional=bool(conditional),
    )
    found = collect_params(
        modules, set(ignored_params or ()), mesh if shard_placement_fn is None else None
    )
    unit = shard_params(found, mesh, groups, settings, shard_placement_fn, reshard_after_forward)

    state: FSDPState = fully_shard.state(modules[0])
    state.modules = modules
    state.settings = settings
    state.param_uids = {locs[0].fqn: param_uid(p) for p, locs in found.items()}
    state.unit = unit
    register_state_dict_hooks(state)
    attach_unit(state, FSDPModule, "FSDP")
    return module


def attach_unit(state: FSDPState, mixin: type[FSDPModule], prefix: str) -> None:
    """Drive ``state``'s modules by its forward hooks and give them the class ``mixin``
    (the last step of ``fully_shard`` and ``replicate``)."""
    # Kept out of compiled graphs: they swap parameters and issue collectives.
    pre_forward = outside_graphs(state.pre_forward)
    post_forward = outside_graphs(state.post_forward)
    for m in state.modules:
        m.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
        m.register_forward_hook(post_forward)
        with_mixin(m, mixin, prefix)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` unshard and reshard like ``forward`` does.

    A no-op on a module that is not ``fully_shard``-ed or ``replicate``-d (as torch), so
    one code path serves sharded and unsharded runs.
    """
    state = fsdp_state_of(module)
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
