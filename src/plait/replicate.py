"""``replicate``: composable data parallelism (DDP), as a ``fully_shard`` unit whose shard
group is this rank alone.

Every rank holds the whole module. ``replicate(module)`` makes the parameters no inner
``fully_shard`` / ``replicate`` call owns into one unit of ``plait.fsdp`` (torch's
FSDP-based ``replicate`` is built the same way): the module becomes an ``FSDPModule``
(``ReplicateModule``), runs through the same hooks and root pass as a sharded unit, and its
gradients go through the same reduction: packed into buckets, all-reduced over the
data-parallel group (HSDP's replicate dimension, with nothing to shard) and written back
into ``param.grad``. What this file keeps is what only ``replicate`` does: its arguments,
the broadcast at apply time, ``device_id`` and the tensor-parallel checks.

Contract:

* Applied in place through ``@contract()``: names are unchanged, the module's class becomes
  a subclass of ``ReplicateModule``, itself an ``FSDPModule``: ``isinstance(m, FSDPModule)``
  selects replicated modules too, and every ``FSDPModule`` method works on them
  (``set_requires_gradient_sync``, ``set_gradient_divide_factor``, ``set_all_reduce_hook``,
  ``set_is_last_backward``, ``unshard`` / ``reshard``, ...), plus DDP's ``no_sync()``.
* At apply time rank 0's parameters and buffers are broadcast, so all replicas start equal;
  those still on the meta device are skipped (no data yet: a module built there is given
  storage and values after, alike on every rank, as with ``fully_shard``'s meta init).
* Parameters stay what they were: plain tensors (or the TP code's DTensors), compared and
  optimized as such, as with torch's DDP-based ``replicate``. **Unlike torch's FSDP-based
  replicate**, whose parameters become ``Replicate()`` DTensors. Without
  ``mp_policy.param_dtype`` forward and backward use the parameters themselves (no copy,
  no swap, no extra memory); with one, a cast copy is swapped in for forward and backward
  and the gradient lands in the original parameter's ``.grad``, as under ``fully_shard``.
  ``mp_policy``'s ``reduce_dtype``, ``output_dtype`` and ``cast_forward_inputs`` act as
  under ``fully_shard``; ``CPUOffloadPolicy`` keeps parameters (and gradients) on the CPU,
  copied to the compute device for forward and backward.
* Buckets hold parameters in reverse registration order (roughly the order backward
  produces their gradients), capped at ``bucket_cap_mb``; the first bucket is capped at
  1 MiB so that communication starts early. Each bucket's all-reduce is launched as soon as
  all its gradients have been accumulated (post-accumulate-grad hooks), strictly in order
  on every rank, which keeps the sequence of collectives identical across ranks whatever
  order the gradients arrive in; what is left is launched when the unit's backward is
  done, and everything is waited for at the end of backward. The division by the number
  of ranks is torch's FSDP's (an average inside the all-reduce for fp32 / bf16), so
  gradients match torch's FSDP-based ``replicate`` bit for bit.
* Parameters that got no gradient in a step contribute zeros; each bucket carries one
  count per parameter of how many ranks produced a gradient, so a parameter that no rank
  used keeps ``grad=None`` exactly as in a single-process run (the optimizer then skips
  it), while one used on some ranks gets the correct global average. Frozen parameters
  (``requires_grad=False``) and ``ignored_params`` are not communicated at all.
* ``set_requires_gradient_sync(False)`` (or ``with module.no_sync():``) skips all
  communication: gradients accumulate locally, and the next synced backward reduces the
  accumulated sum, one all-reduce per bucket. Without a cast copy the local gradients stay
  in ``param.grad`` meanwhile, where DDP leaves them (torch's FSDP-based replicate keeps
  them on its unsharded parameters, leaving ``param.grad`` untouched).
* ``reduce_dtype`` (e.g. ``torch.bfloat16``) is DDP-era spelling of
  ``mp_policy.reduce_dtype``: the dtype of the all-reduce; gradients are cast back to the
  parameter dtype when written back. Giving both with different values is a ``ValueError``.
* A backward that raised leaves no stale state: the next forward forgets that step (its
  gradients included, as ``reset_iter_state``), with no call needed.
* Tensor-parallel parameters (DTensors, e.g. after torch's ``parallelize_module`` over
  ``mesh["tp"]``) stay DTensors on their own mesh, so optimizers, ``clip_grad_norm_`` and
  state dicts see them as the TP code left them; ``replicate`` over ``mesh["dp"]``
  broadcasts and all-reduces their local tensors over the dp ranks only. A gradient whose
  placement differs from its parameter's (``Partial`` for a replicated parameter used on
  sequence-sharded activations) is first brought to the parameter's placements (a
  collective over the parameter's mesh, as torch's DDP + TP does in backward), so every
  gradient written back is laid out as its parameter. The parameter's mesh must share only
  this rank with the dp group, and dp peers must hold the same coordinate on it (slices of
  one parent mesh do): otherwise ``replicate`` raises ``ValueError``. Unlike torch's DDP +
  TP, which swaps DTensor parameters for plain ones around every forward, nothing is
  renamed or swapped.
* Buffers are broadcast once at apply time only (torch's DDP re-broadcasts them every
  forward; plait leaves that to the user, as running statistics rarely need it).
* Submodules already ``fully_shard``-ed (or ``replicate``-d) keep their parameters and
  buffers to that API: ``replicate`` neither broadcasts nor all-reduces them, as in both of
  torch's ``replicate`` versions. ``replicate`` of a module that is itself ``fully_shard``-ed
  raises ``RuntimeError``; so does its first forward if either API was applied inside it
  afterwards (the parameters would be reduced twice).
* torch's keywords are accepted, both versions': ``mesh`` (1-D), ``mp_policy``,
  ``offload_policy`` and ``ignored_params`` (the FSDP-based version); ``device_mesh`` (the
  DDP-based version's name for ``mesh``), ``ignored_modules``, ``device_id`` (``int`` or
  ``torch.device``, else ``RuntimeError`` as in torch: the module must be on it, and tensor
  inputs are moved to it before each forward, as DDP does); the DDP keywords the DDP-based
  version passes on: ``process_group`` (the data-parallel group, in place of a mesh),
  ``device_ids`` (``None`` or empty, as for a CPU module; ``[d]`` is ``device_id=d``) and
  ``output_device`` (``None`` or that same device), refused as DDP refuses them
  (``ValueError``: more than one device, or any for a CPU module); and three DDP switches that
  change nothing here because plait already behaves as their best setting:
  ``gradient_as_bucket_view`` (gradients are views of the reduced bucket when dtypes
  agree), ``find_unused_parameters`` (unused parameters are always detected, at no extra
  cost) and ``static_graph`` (nothing is cached about the graph). ``broadcast_buffers`` is
  accepted too and changes nothing, as in torch's composable ``replicate``, whose inner DDP
  covers the parameters only and so never syncs buffers (plait broadcasts them once, at
  apply time).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from plait.contract import contract, get_registry
from plait.fsdp.collectives import Groups
from plait.fsdp.fully_shard import attach_unit
from plait.fsdp.init import check_policies, param_locations, param_uid
from plait.fsdp.module import FSDPDeepcopyError, FSDPModule
from plait.fsdp.param import ParamPolicy
from plait.fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from plait.fsdp.replica import ReplicaGroup, ReplicaParam
from plait.fsdp.replica_state import ReplicateState
from plait.fsdp.settings import UnitSettings
from plait.mesh import (
    buffers_to_mesh_device,
    check_mesh_device,
    collective_device,
    default_mesh,
    mesh_device,
    module_device_type,
    one_dim_group,
)

__all__ = ["ReplicateModule", "ReplicateState", "replicate"]

_HSDP_HINT = "Use fully_shard with a 2-D mesh (HSDP) to combine replication and sharding."
_REDUCING_APIS = ("fully_shard", "replicate")


class ReplicateModule(FSDPModule):
    """The class a module gains under ``replicate``: an ``FSDPModule`` (``isinstance``
    checks and every method work), plus DDP's ``no_sync``."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next synced backward reduces."""
        previous = self._fsdp_state().settings.requires_gradient_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(previous)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise FSDPDeepcopyError(
            f"deepcopy of a replicate-d module ({type(self).__name__}) is not supported (as in "
            "torch's FSDP-based replicate): its hooks and state are tied to the process group. "
            "Deepcopy the model before calling replicate, or save and load a state_dict."
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local tensor, a plain tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _is_managed(module: nn.Module, apis: tuple[str, ...]) -> bool:
    registry = get_registry(module)
    return registry is not None and any(api in registry for api in apis)


def _validate(
    module: nn.Module,
    bucket_cap_mb: float,
    reduce_dtype: object,
    policies: tuple[object, object],
    switches: dict[str, object],
) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"replicate expects an nn.Module, got {type(module).__name__}")
    if _is_managed(module, ("fully_shard",)):
        raise RuntimeError(
            f"replicate cannot be applied to {type(module).__name__}: it is already managed by "
            f"fully_shard. {_HSDP_HINT}"
        )
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"replicate: {name} must be a bool, got {value!r}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(f"replicate: bucket_cap_mb must be a number, got {bucket_cap_mb!r}")
    if bucket_cap_mb <= 0:
        raise ValueError(f"replicate: bucket_cap_mb must be positive, got {bucket_cap_mb}")
    if reduce_dtype is not None and not (
        isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
    ):
        raise TypeError(
            f"replicate: reduce_dtype must be a floating torch.dtype or None, got {reduce_dtype!r}"
        )
    check_policies("replicate", *policies)


def _with_reduce_dtype(
    mp_policy: MixedPrecisionPolicy, reduce_dtype: torch.dtype | None
) -> MixedPrecisionPolicy:
    """``mp_policy`` with the DDP-era ``reduce_dtype`` keyword folded in."""
    if reduce_dtype is None or mp_policy.reduce_dtype == reduce_dtype:
        return mp_policy
    if mp_policy.reduce_dtype is not None:
        raise ValueError(
            f"replicate: reduce_dtype={reduce_dtype} disagrees with mp_policy.reduce_dtype="
            f"{mp_policy.reduce_dtype}: give one of them (reduce_dtype= is the older spelling "
            "of mp_policy=MixedPrecisionPolicy(reduce_dtype=...))"
        )
    return dataclasses.replace(mp_policy, reduce_dtype=reduce_dtype)


def _resolve_device_id(
    device_id: object, module: nn.Module, mesh: DeviceMesh
) -> torch.device | None:
    """torch's ``device_id``: the device ``module`` runs on (an ``int`` is an index on the
    mesh's device type); ``None`` when not given."""
    if device_id is None:
        return None
    if isinstance(device_id, bool) or not isinstance(device_id, (int, torch.device)):
        # RuntimeError, the type torch raises here, so code written for torch catches it.
        raise RuntimeError(
            "replicate: Expected device_id to be int or torch.device, but got "
            f"{type(device_id).__name__} ({device_id!r})"
        )
    if isinstance(device_id, int):
        device_id = torch.device(mesh.device_type, device_id)
    device = device_id
    for name, param in module.named_parameters():
        same_index = device.type == "cpu" or device.index in (None, param.device.index)
        if param.device.type != "meta" and (param.device.type != device.type or not same_index):
            raise ValueError(
                f"replicate: device_id is {device} but parameter {name!r} of "
                f"{type(module).__name__} is on {param.device}: move the module first "
                f"(module.to({str(device)!r}))"
            )
    return device


def _from_device_ids(
    device_ids: Sequence[int | torch.device] | None,
    output_device: int | torch.device | None,
    device_id: int | torch.device | None,
    module: nn.Module,
) -> int | torch.device | None:
    """DDP's ``device_ids`` / ``output_device`` as ``device_id``, refused where DDP refuses
    them (torch's sentences first: code written for torch matches on them)."""
    ids = list(device_ids) if device_ids is not None else []
    if len(ids) > 1:
        raise ValueError(
            "device_ids can only be None or contain a single element. replicate runs one "
            f"device per process: pass the one device this rank uses, got {ids}"
        )
    devices = {p.device for p in module.parameters() if p.device.type != "meta"}
    if (ids or output_device is not None) and (
        not ids or len(devices) > 1 or any(d.type == "cpu" for d in devices)
    ):
        raise ValueError(
            "device_ids and output_device arguments only work with single-device GPU "
            f"modules, but got device_ids {device_ids}, output_device {output_device}, and "
            f"module parameters {devices} ({type(module).__name__}): for a CPU module pass "
            "device_ids=None and output_device=None"
        )
    if output_device is not None and output_device != ids[0]:
        raise ValueError(
            f"replicate: output_device {output_device} differs from device_ids {ids}: outputs "
            "stay on the module's device; pass output_device=None"
        )
    if ids and device_id is not None and device_id != ids[0]:
        raise ValueError(
            f"replicate: device_id={device_id} and device_ids={ids} disagree: give one of them"
        )
    return ids[0] if ids else device_id


def _mesh_of_group(group: object, mesh: DeviceMesh | None, module: nn.Module) -> DeviceMesh:
    """A 1-D mesh over DDP's ``process_group`` (on the module's device type)."""
    if mesh is not None:
        raise ValueError(
            "replicate: pass the data-parallel group as one of process_group= and "
            "mesh= / device_mesh=, not both"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "replicate: process_group must be a torch.distributed.ProcessGroup, got "
            f"{type(group).__name__}"
        )
    device_type = module_device_type(module)
    if device_type == "meta":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return DeviceMesh.from_group(group, device_type)


def _broadcast_from_rank0(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Make every rank's ``tensors`` equal to rank 0's, one broadcast per dtype and device."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in (t for t in tensors if not t.is_meta):  # meta: nothing to send yet
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    device = collective_device(group)  # offloaded parameters are on the CPU, NCCL is not
    with torch.no_grad():
        for same_kind in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in same_kind]).to(device)
            dist.broadcast(flat, group=group, group_src=0)
            for t, piece in zip(same_kind, flat.split([t.numel() for t in same_kind]), strict=True):
                t.copy_(piece.view_as(t))


def _check_tensor_parallel(
    named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup, module: nn.Module
) -> None:
    """Refuse DTensors whose mesh the dp group cannot be layered over.

    Averaging local tensors over the dp group is right only when each dp peer holds the same
    part of the tensor: the tensor's mesh must share no rank with the dp group but this one
    (as ``mesh["tp"]`` and ``mesh["dp"]`` of one parent mesh), and every dp peer must sit at
    the same coordinate of its own copy of that mesh. Checked on all dp ranks together (one
    ``all_gather_object``), so a layout wrong on one rank fails everywhere instead of hanging.
    """
    first_on: dict[DeviceMesh, str] = {}  # each DTensor mesh -> the first tensor on it
    for name, t in named:
        if isinstance(t, DTensor):
            first_on.setdefault(t.device_mesh, name)
    if not first_on:
        return
    dp_ranks = set(dist.get_process_group_ranks(group))
    rank = dist.get_rank()
    problem = ""
    for tp_mesh, name in first_on.items():
        shared = sorted(dp_ranks & set(tp_mesh.mesh.flatten().tolist()))
        if shared != [rank]:
            problem = (
                f"{name!r} of {type(module).__name__} is a DTensor on a mesh of ranks "
                f"{sorted(tp_mesh.mesh.flatten().tolist())}, which shares ranks {shared} with "
                f"the replicate group {sorted(dp_ranks)} (rank {rank}): replicate "
                "all-reduces over the dp ranks only, so the two must be different dims of "
                'one parent mesh, e.g. parallelize_module(model, mesh["tp"], ...) then '
                'replicate(model, device_mesh=mesh["dp"])'
            )
            break
    mine = (problem, [tp_mesh.get_coordinate() for tp_mesh in first_on])
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for peer_problem, _ in everyone:
        if peer_problem:
            raise ValueError(f"replicate: {peer_problem}")
    if any(coords != mine[1] for _, coords in everyone):
        names = list(first_on.values())
        raise ValueError(
            f"replicate: the dp ranks {sorted(dp_ranks)} hold different parts of DTensors "
            f"such as {names[0]!r} of {type(module).__name__} (coordinates on their meshes: "
            f"{[coords for _, coords in everyone]}): build both meshes as dims of one "
            'init_device_mesh(...) and pass mesh["dp"] to replicate'
        )


@contract(ReplicateState)
def replicate(
    module: nn.Module,
    ignored_modules: Iterable[nn.Module] | None = None,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, shared
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen, shared
    ignored_params: Iterable[nn.Parameter] | None = None,
    device_mesh: DeviceMesh | None = None,
    device_id: int | torch.device | None = None,
    process_group: dist.ProcessGroup | None = None,
    device_ids: Sequence[int | torch.device] | None = None,
    output_device: int | torch.device | None = None,
    bucket_cap_mb: float = 25,
    reduce_dtype: torch.dtype | None = None,
    gradient_as_bucket_view: bool = True,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    broadcast_buffers: bool = True,
) -> nn.Module:
    """Replicate ``module`` over the data-parallel group; see the module docstring.

    Args:
        module: the module to replicate in place (not one that is itself ``fully_shard``-ed;
            ``fully_shard``-ed submodules are left to ``fully_shard``).
        ignored_modules: modules whose parameters are neither broadcast nor reduced.
        mesh: a 1-D mesh (or one named dimension of a larger one); default: the world.
        mp_policy: as ``fully_shard``'s: ``param_dtype`` (forward and backward on a cast
            copy), ``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``.
        offload_policy: ``CPUOffloadPolicy`` keeps parameters and gradients on the CPU.
        ignored_params: parameters neither broadcast nor reduced.
        device_mesh: torch's DDP-based ``replicate`` name for ``mesh`` (give one of them).
        device_id: the device the module is on; non-CPU tensor inputs are moved to it.
        process_group: DDP's name for the data-parallel group (instead of a mesh).
        device_ids, output_device: DDP's spelling of ``device_id``: ``None`` for a CPU
            module, else the one device the module is on.
        bucket_cap_mb: the size cap of one all-reduce bucket, in MiB.
        reduce_dtype: ``mp_policy.reduce_dtype``'s older spelling (the all-reduce's dtype).
        gradient_as_bucket_view, find_unused_parameters, static_graph, broadcast_buffers:
            torch's DDP switches, accepted (bools) and without effect: see the module
            docstring.
    """
    _validate(
        module,
        bucket_cap_mb,
        reduce_dtype,
        (mp_policy, offload_policy),
        {
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            "broadcast_buffers": broadcast_buffers,
        },
    )
    mp_policy = _with_reduce_dtype(mp_policy, reduce_dtype)
    device_id = _from_device_ids(device_ids, output_device, device_id, module)
    if mesh is not None and device_mesh is not None and mesh is not device_mesh:
        raise ValueError("replicate: pass the mesh as mesh= or device_mesh=, not both")
    mesh = mesh if mesh is not None else device_mesh
    if process_group is not None:
        mesh = _mesh_of_group(process_group, mesh, module)
    mesh = mesh if mesh is not None else default_mesh(module, "replicate")
    group = one_dim_group(mesh, "replicate")
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    if not offload:
        check_mesh_device(mesh, module, "replicate")
    else:  # offloaded parameters live on the CPU; buffers go where forward runs
        buffers_to_mesh_device(mesh, [module])
    device = _resolve_device_id(device_id, module, mesh)

    ignored = {id(p) for p in ignored_params or ()}
    for ignored_module in ignored_modules or ():
        ignored.update(id(p) for p in ignored_module.parameters())
    managed = [
        sub for sub in module.modules() if sub is not module and _is_managed(sub, _REDUCING_APIS)
    ]
    ignored.update(id(p) for sub in managed for p in sub.parameters())
    managed_buffers = {id(b) for sub in managed for b in sub.buffers()}
    found = param_locations([module], lambda _sub, _fqn, param: id(param) not in ignored)
    synced = [(locs[0].fqn, p) for p, locs in found.items()] + [
        (n, b) for n, b in module.named_buffers() if id(b) not in managed_buffers
    ]
    _check_tensor_parallel(synced, group, module)
    if offload and any(isinstance(p, DTensor) for p in found):
        raise ValueError(
            "replicate: CPUOffloadPolicy is not supported with tensor-parallel (DTensor) "
            "parameters; offload plain parameters only, or drop the policy"
        )
    _broadcast_from_rank0([_local(t).detach() for _, t in synced], group)

    settings = UnitSettings(
        mp_policy,
        offload_policy,
        reshard_after_forward=False,  # nothing to free: the parameters are whole
        api_name="replicate",
        bucket_cap_bytes=int(bucket_cap_mb * 2**20),
    )
    policy = ParamPolicy(
        mp_policy.param_dtype,
        mp_policy.reduce_dtype,
        device or mesh_device(mesh),
        offload,
        isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory,
    )
    state: ReplicateState = replicate.state(module)
    state.modules = [module]
    state.settings = settings
    state.param_uids = {locs[0].fqn: param_uid(p) for p, locs in found.items()}
    state.managed_at_apply = {id(sub) for sub in managed}
    params = [ReplicaParam(p, locs, policy) for p, locs in found.items()]
    groups = Groups(None, 0, 1, group, dist.get_world_size(group))
    state.unit = ReplicaGroup(params, groups, settings, state.grad_arrived) if params else None
    attach_unit(state, ReplicateModule, "Replicate")
    if device is not None and device.type != "cpu":

        def move_inputs(
            _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return tree_map_only(torch.Tensor, lambda t: t.to(device), (args, kwargs))

        # Before the unit's own hook: its input casts and backward hooks see moved inputs.
        module.register_forward_pre_hook(move_inputs, prepend=True, with_kwargs=True)
    return module
