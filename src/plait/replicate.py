"""``replicate``: composable data parallelism (DDP).

Every rank holds the whole module. During backward, gradients are packed into buckets and
each bucket is all-reduced asynchronously as soon as all of its gradients are ready, so
communication overlaps the rest of backward; the end of backward waits for the buckets and
writes the averaged gradients back into ``param.grad``.

Contract:

* Applied in place through ``@contract()``: names are unchanged, the module's class becomes
  a subclass of ``ReplicateModule`` (so ``set_requires_gradient_sync`` / ``no_sync`` are
  methods of the module itself).
* At apply time rank 0's parameters and buffers are broadcast, so all replicas start equal.
* Buckets hold parameters in reverse registration order (roughly the order backward
  produces their gradients), capped at ``bucket_cap_mb``; the first bucket is capped at
  1 MiB so that communication starts early. Buckets are launched strictly in order on every
  rank, which keeps the sequence of collectives identical across ranks whatever order the
  gradients arrive in.
* Parameters that got no gradient in a step contribute zeros; each bucket carries one
  count per parameter of how many ranks produced a gradient, so a parameter that no rank
  used keeps ``grad=None`` exactly as in a single-process run (the optimizer then skips
  it), while one used on some ranks gets the correct global average. Frozen parameters
  (``requires_grad=False``) and ``ignored_params`` are not communicated at all.
* ``set_requires_gradient_sync(False)`` (or ``with module.no_sync():``) skips all
  communication: gradients accumulate locally, and the next synced backward reduces the
  accumulated sum, one all-reduce per bucket.
* ``reduce_dtype`` (e.g. ``torch.bfloat16``) is the dtype of the all-reduce; gradients are
  cast back to the parameter dtype when written back.
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
* torch's keywords are accepted: ``device_mesh`` (the DDP-based version's name for ``mesh``),
  ``ignored_modules``, ``device_id`` (``int`` or ``torch.device``, else ``RuntimeError`` as in
  torch: the module must be on it, and tensor inputs are moved to it before each forward, as
  DDP does), and three DDP switches that change nothing here because plait already behaves
  as their best setting: ``gradient_as_bucket_view`` (gradients are always views of the
  reduced bucket when dtypes agree), ``find_unused_parameters`` (unused parameters are always
  detected, at no extra cost) and ``static_graph`` (nothing is cached about the graph).
  ``broadcast_buffers`` is accepted too and changes nothing, as in torch's composable
  ``replicate``, whose inner DDP covers the parameters only and so never syncs buffers
  (plait broadcasts them once, at apply time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from plait import spmd
from plait.contract import APIState, contract, get_registry, with_mixin
from plait.hooks import in_backward, outside_graphs, queue_end_of_backward, traced
from plait.mesh import (
    check_mesh_device,
    default_mesh,
    local_in_layout,
    make_dtensor,
    one_dim_group,
)

__all__ = ["ReplicateModule", "replicate"]

_FIRST_BUCKET_BYTES = 1024 * 1024
_HSDP_HINT = "Use fully_shard with a 2-D mesh (HSDP) to combine replication and sharding."


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local tensor, a plain tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _local_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``grad`` laid out as ``param``'s local tensor."""
    if isinstance(param, DTensor):
        return local_in_layout(grad, param.device_mesh, tuple(param.placements))
    return _local(grad)


def _like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part of a gradient) as a gradient of ``param``: wrapped as a
    DTensor with ``param``'s mesh, placements, shape and stride when ``param`` is one."""
    if not isinstance(param, DTensor):
        return local
    return make_dtensor(local, param._spec)  # every step: the spec is the parameter's


class _Bucket:
    """Parameters whose gradients travel in one all-reduce, and that all-reduce's state."""

    def __init__(self, params: list[nn.Parameter], reduce_dtype: torch.dtype) -> None:
        self.params = params
        self.reduce_dtype = reduce_dtype
        self.offsets: list[int] = []
        self.shapes = [_local(p).shape for p in params]  # what this rank holds of each
        numel = 0
        for shape in self.shapes:
            self.offsets.append(numel)
            numel += shape.numel()
        self.numel = numel
        self.ready = 0
        self.flat: torch.Tensor | None = None
        self.work: dist.Work | None = None
        self.owner = "a replicate bucket"  # for divergence reports (plait.spmd)
        self.all_used = False  # this rank had a gradient for every parameter (last launch)

    def launch(self, group: dist.ProcessGroup, world: int) -> None:
        """Pack the gradients (zeros where missing) plus usage counts and start the reduce."""
        # Layout: [grad_0 | grad_1 | ... | count_0, count_1, ...]
        flat = torch.empty(
            self.numel + len(self.params), dtype=self.reduce_dtype, device=self.params[0].device
        )
        used = []
        for p, offset, shape in zip(self.params, self.offsets, self.shapes, strict=True):
            piece = flat[offset : offset + shape.numel()]
            if p.grad is None:
                piece.zero_()
            else:
                piece.copy_(_local_grad(p, p.grad).reshape(-1))
            used.append(p.grad is not None)
        # Every rank that used a parameter adds one; reading the counts back costs a device
        # sync, so it is skipped when this rank used them all (then every count is > 0).
        self.all_used = all(used)
        if self.all_used:
            flat[self.numel :].fill_(1)
        else:
            flat[self.numel :].copy_(torch.tensor(used, dtype=self.reduce_dtype))
        # Pre-divide (as torch's DDP does) so low-precision reductions do not overflow.
        flat[: self.numel].div_(world)
        self.flat = flat
        spmd.record("all_reduce", flat, group, self.owner)
        self.work = dist.all_reduce(flat, group=group, async_op=True)

    def finish(self) -> None:
        """Wait for the reduce and write averaged gradients back into ``param.grad``."""
        assert self.flat is not None and self.work is not None
        spmd.wait(self.work, "all_reduce", self.owner)
        flat = self.flat
        counts = [1] * len(self.params) if self.all_used else flat[self.numel :].tolist()
        for p, offset, shape, count in zip(
            self.params, self.offsets, self.shapes, counts, strict=True
        ):
            if count == 0:
                continue  # no rank used this parameter: keep grad None, as one process would
            # The gradient becomes a view of the reduced bucket (no copy) when dtypes agree.
            grad = flat[offset : offset + shape.numel()].view(shape).to(p.dtype)
            p.grad = _like_param(p, grad)
        self.flat = None
        self.work = None
        self.ready = 0


class ReplicateState(APIState):
    """Per-``replicate`` state: the group, the buckets and where the current backward is."""

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self.world = 1
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[nn.Parameter, _Bucket] = {}
        self.requires_gradient_sync = True
        self.next_bucket = 0  # buckets before this one have been launched in this backward
        self.in_backward = False  # the end-of-backward callback is queued
        # ids of the submodules managed by fully_shard or replicate at apply time (their
        # parameters are not bucketed); the first forward checks none appeared since.
        self.managed_at_apply: set[int] = set()
        self.checked_ownership = False

    def on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.requires_gradient_sync:
            return
        if not self.in_backward:
            queue_end_of_backward(self.finish_backward, "replicate")
            self.in_backward = True
        self.bucket_of[param].ready += 1  # type: ignore[index]
        self.launch_ready_buckets(force=False)

    def launch_ready_buckets(self, force: bool) -> None:
        """Launch buckets in order while they are complete (all of them when ``force``)."""
        assert self.group is not None
        while self.next_bucket < len(self.buckets):
            bucket = self.buckets[self.next_bucket]
            if not force and bucket.ready < len(bucket.params):
                return
            bucket.launch(self.group, self.world)
            self.next_bucket += 1

    def finish_backward(self) -> None:
        with traced("plait.replicate.finish_backward"):
            self.launch_ready_buckets(force=True)  # parameters that got no gradient this step
            for bucket in self.buckets:
                bucket.finish()
        self.reset()
        spmd.check("end of a replicate backward")

    def reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready = 0
            bucket.flat = bucket.work = None
        self.next_bucket = 0
        self.in_backward = False


class ReplicateModule(nn.Module):
    """Mixin the module's class gains under ``replicate`` (``isinstance`` checks work)."""

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Turn gradient all-reduce on or off (off: gradients accumulate locally).

        With ``recurse``, also every ``replicate``-d submodule.
        """
        modules = self.modules() if recurse else [self]
        for module in modules:
            state = replicate.state(module)
            if state is not None:
                state.requires_gradient_sync = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next synced backward reduces."""
        previous = replicate.state(self).requires_gradient_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(previous)


def _is_managed(module: nn.Module, apis: tuple[str, ...]) -> bool:
    registry = get_registry(module)
    return registry is not None and any(api in registry for api in apis)


_REDUCING_APIS = ("fully_shard", "replicate")


def _managed_submodules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules of ``module`` (not itself) that ``fully_shard`` or ``replicate`` was
    applied to: their parameters and buffers are theirs to reduce and sync."""
    return [
        (name, sub)
        for name, sub in module.named_modules()
        if sub is not module and _is_managed(sub, _REDUCING_APIS)
    ]


def _validate(
    module: nn.Module, bucket_cap_mb: float, reduce_dtype: object, switches: dict[str, object]
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


def _broadcast_from_rank0(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Make every rank's ``tensors`` equal to rank 0's, one broadcast per dtype and device."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same_kind in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in same_kind])
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


def _make_buckets(
    params: list[nn.Parameter], cap_bytes: int, reduce_dtype: torch.dtype | None
) -> list[_Bucket]:
    """Pack ``params`` in order into buckets of one dtype and device, at most ``cap_bytes``."""
    buckets: list[_Bucket] = []
    current: list[nn.Parameter] = []
    current_bytes = 0
    limit = min(cap_bytes, _FIRST_BUCKET_BYTES)
    for p in params:
        dtype = reduce_dtype or p.dtype
        nbytes = _local(p).numel() * dtype.itemsize
        same_kind = bool(current) and (reduce_dtype or current[0].dtype, current[0].device) == (
            dtype,
            p.device,
        )
        if current and (not same_kind or current_bytes + nbytes > limit):
            buckets.append(_Bucket(current, reduce_dtype or current[0].dtype))
            current, current_bytes, limit = [], 0, cap_bytes
        current.append(p)
        current_bytes += nbytes
    if current:
        buckets.append(_Bucket(current, reduce_dtype or current[0].dtype))
    return buckets


@contract(ReplicateState)
def replicate(
    module: nn.Module,
    ignored_modules: Iterable[nn.Module] | None = None,
    *,
    mesh: DeviceMesh | None = None,
    device_mesh: DeviceMesh | None = None,
    device_id: int | torch.device | None = None,
    bucket_cap_mb: float = 25,
    reduce_dtype: torch.dtype | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
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
        device_mesh: torch's DDP-based ``replicate`` name for ``mesh`` (give one of them).
        device_id: the device the module is on; non-CPU tensor inputs are moved to it.
        bucket_cap_mb: the size cap of one all-reduce bucket, in MiB.
        reduce_dtype: the dtype of the all-reduce (default: the parameters' dtype).
        ignored_params: parameters neither broadcast nor reduced.
        gradient_as_bucket_view, find_unused_parameters, static_graph, broadcast_buffers:
            torch's DDP switches, accepted (bools) and without effect: see the module
            docstring.
    """
    _validate(
        module,
        bucket_cap_mb,
        reduce_dtype,
        {
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            "broadcast_buffers": broadcast_buffers,
        },
    )
    if mesh is not None and device_mesh is not None and mesh is not device_mesh:
        raise ValueError("replicate: pass the mesh as mesh= or device_mesh=, not both")
    state: ReplicateState = replicate.state(module)
    mesh = mesh if mesh is not None else device_mesh
    mesh = mesh if mesh is not None else default_mesh(module, "replicate")
    group = one_dim_group(mesh, "replicate")
    check_mesh_device(mesh, module, "replicate")
    device = _resolve_device_id(device_id, module, mesh)
    state.group = group
    state.world = dist.get_world_size(group)

    ignored = set(ignored_params or ())
    for ignored_module in ignored_modules or ():
        ignored.update(ignored_module.parameters())
    managed = [sub for _, sub in _managed_submodules(module)]
    state.managed_at_apply = {id(sub) for sub in managed}
    ignored.update(p for sub in managed for p in sub.parameters())
    managed_buffers = {id(b) for sub in managed for b in sub.buffers()}
    synced = [(n, p) for n, p in module.named_parameters() if p not in ignored] + [
        (n, b) for n, b in module.named_buffers() if id(b) not in managed_buffers
    ]
    _check_tensor_parallel(synced, group, module)
    _broadcast_from_rank0([_local(t).detach() for _, t in synced], group)
    trainable = [p for p in module.parameters() if p.requires_grad and p not in ignored]
    state.buckets = _make_buckets(trainable[::-1], int(bucket_cap_mb * 2**20), reduce_dtype)
    names = {p: n for n, p in module.named_parameters()}
    for i, bucket in enumerate(state.buckets):
        first = names.get(bucket.params[0], "?")
        bucket.owner = f"replicate bucket {i} ({first!r}...) of {type(module).__name__}"
    # Kept out of compiled graphs, as every plait hook (compiled autograd would trace it).
    on_grad_ready = outside_graphs(state.on_grad_ready, backward=True)
    for bucket in state.buckets:
        for p in bucket.params:
            state.bucket_of[p] = bucket
            p.register_post_accumulate_grad_hook(on_grad_ready)

    def reset_after_aborted_backward(*_: Any) -> None:
        # A backward that raised never ran its end-of-backward callback; start clean.
        # (Forwards run *inside* backward, e.g. checkpoint recomputation, must not reset.)
        if state.in_backward and not in_backward():
            state.reset()
        if not state.checked_ownership:
            _refuse_managed_after_replicate(module, state)
            state.checked_ownership = True

    module.register_forward_pre_hook(outside_graphs(reset_after_aborted_backward))
    if device is not None and device.type != "cpu":

        def move_inputs(
            _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return tree_map_only(torch.Tensor, lambda t: t.to(device), (args, kwargs))

        module.register_forward_pre_hook(move_inputs, with_kwargs=True)
    with_mixin(module, ReplicateModule, "Replicate")
    return module


def _refuse_managed_after_replicate(module: nn.Module, state: ReplicateState) -> None:
    """Raise if ``fully_shard`` / ``replicate`` was applied to a submodule after ``replicate``
    bucketed its parameters (they would be reduced twice)."""
    for name, sub in _managed_submodules(module):
        if id(sub) not in state.managed_at_apply:
            api = next(a for a in _REDUCING_APIS if _is_managed(sub, (a,)))
            raise RuntimeError(
                f"{api} was applied to {name!r} inside the replicate-d "
                f"{type(module).__name__} after replicate, which had already bucketed its "
                f"parameters. Apply {api} to the submodules first, then replicate to the "
                f"parent (replicate leaves their parameters to them)."
            )
