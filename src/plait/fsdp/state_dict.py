"""State dicts of ``fully_shard``-ed modules: sharded by default, full on request.

**Sharded** (the default, and what checkpoints should use). ``module.state_dict()``
returns, for every parameter a unit manages, a ``DTensor`` whose local tensor shares
storage with this rank's shard: saving it costs no copy and no communication, and
``torch.distributed.checkpoint`` (DCP) writes each rank's shard and reshards on load, to
any world size. DCP's ``get_state_dict`` / ``set_state_dict``
(``torch.distributed.checkpoint.state_dict``) work on plait modules unchanged, optimizer
state included, keyed by parameter FQN.

**Full** (for export, or a model that is not sharded). ``get_full_state_dict`` gathers
every parameter into a plain tensor, on rank 0 only by default. A full state dict (plain
tensors, the same on every rank) loads into a sharded model either through
``module.load_state_dict`` (the pre-hook below keeps this rank's rows of each tensor) or
through ``set_full_state_dict``, which can also broadcast it from rank 0.

``register_state_dict_hooks(state)``, called by ``fully_shard`` for each unit, makes the
module-level calls right whatever the unit's state:

* saving while the unit is unsharded (after a forward that kept it gathered) still gives
  the sharded DTensors, without resharding anything;
* loading reshards first (so the values land in the shards, which are the source of
  truth), converts plain full tensors to this rank's shard, and after
  ``load_state_dict(..., assign=True)`` copies the assigned values into the shards, so the
  parameter objects an optimizer holds stay valid.

Errors for missing or unexpected keys and for wrong shapes are ``load_state_dict``'s own,
and name the key (a DTensor parameter's ``shape`` is its global shape).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.nn.modules.module import _IncompatibleKeys

from plait.fsdp.group import ShardedState
from plait.fsdp.param import FSDPParam
from plait.fsdp.rows import shard_rows
from plait.fsdp.state import FSDPState, TrainingState
from plait.mesh import collective_device, mesh_device

__all__ = [
    "get_full_state_dict",
    "register_state_dict_hooks",
    "set_full_state_dict",
    "shard_full_tensor",
]

_REGISTERED: weakref.WeakSet[FSDPState] = weakref.WeakSet()


# --- slicing a full tensor into this rank's shard ------------------------------------------


def _local_piece(
    full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> torch.Tensor:
    """This rank's part of ``full`` under ``placements`` (torch.chunk layout, no copy)."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError("this rank is not part of the parameter's device mesh")
    piece = full
    # A ``_StridedShard`` (fully_shard over tensor parallelism, tp.py) splits what the later
    # mesh dims' shards leave on its dim: it is applied after every plain ``Shard``.
    order = sorted(range(len(placements)), key=lambda i: type(placements[i]) is _StridedShard)
    for mesh_dim in order:
        placement = placements[mesh_dim]
        if isinstance(placement, Replicate):
            continue
        if type(placement) not in (Shard, _StridedShard):
            raise NotImplementedError(
                f"loading a full tensor into a DTensor with placement {placement} is not "
                "supported (only Shard and Replicate)"
            )
        dim = placement.dim  # type: ignore[attr-defined]
        if piece.shape[dim] == 0:
            continue  # nothing to split
        _, start, length = shard_rows(piece.shape[dim], coordinate[mesh_dim], mesh.size(mesh_dim))
        piece = piece.narrow(dim, start, length)
    return piece


def shard_full_tensor(full: torch.Tensor, like: DTensor) -> DTensor:
    """``full`` (the global value, the same on every rank) as a DTensor laid out as ``like``.

    No communication: each rank keeps its own rows. The local tensor is moved to the
    device of ``like``'s local tensor but keeps ``full``'s dtype (loading casts).
    """
    if full.shape != like.shape:
        raise ValueError(f"shape {tuple(full.shape)} does not match {tuple(like.shape)}")
    local_device = like.to_local().device
    piece = _local_piece(full.detach(), like.device_mesh, tuple(like.placements))
    return DTensor.from_local(
        piece.to(local_device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def _full_value(value: DTensor) -> torch.Tensor:
    """Gather a DTensor (a collective over its mesh) into a plain tensor."""
    local = value.to_local()
    if local.device.type != value.device_mesh.device_type:  # e.g. offloaded to CPU on a GPU
        value = DTensor.from_local(
            local.to(mesh_device(value.device_mesh)),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return value.full_tensor()


# --- hooks installed per unit ----------------------------------------------------------------


def register_state_dict_hooks(state: FSDPState) -> None:
    """Install the save and load hooks of ``state``'s unit (see the module docstring).

    Idempotent; a state without parameters needs none. Each module that holds one of the
    unit's parameters gets a ``state_dict`` post-hook and ``load_state_dict`` pre- and
    post-hooks that handle exactly its own parameters, under whatever prefix the call
    gives it.
    """
    unit = state.unit
    if unit is None or state in _REGISTERED:
        return
    _REGISTERED.add(state)
    owned: dict[int, tuple[nn.Module, list[tuple[str, FSDPParam]]]] = {}
    for p in unit.params:
        for loc in p.locations:
            owned.setdefault(id(loc.module), (loc.module, []))[1].append((loc.name, p))
    for module, entries in owned.values():
        _register_on(module, state, entries)


def _register_on(module: nn.Module, state: FSDPState, entries: list[tuple[str, FSDPParam]]) -> None:
    def save_sharded(
        module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        unit = state.unit
        if unit is None or unit.sharded_state is not ShardedState.UNSHARDED:
            return  # sharded: the module already holds (and saved) the sharded parameters
        for name, p in entries:
            key = prefix + name
            held = module._parameters.get(name)
            if key not in state_dict or held is p.sharded or isinstance(held, DTensor):
                continue
            state_dict[key] = p.sharded if state_dict[key] is held else p.sharded.detach()

    def load_pre(
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        _make_sharded(state, prefix)
        for name, p in entries:
            key = prefix + name
            value = state_dict.get(key)
            if (
                isinstance(value, torch.Tensor)
                and not isinstance(value, DTensor)
                and value.shape == p.global_shape  # else load_state_dict reports it
            ):
                state_dict[key] = shard_full_tensor(value, _sharded(p))

    def load_post(module: nn.Module, incompatible_keys: Any) -> None:
        materialised = False
        for name, p in entries:
            held: torch.Tensor | None = module._parameters.get(name)
            if held is p.sharded or not isinstance(held, DTensor):
                continue
            if p.padded.is_meta:  # meta init: the loaded parameter becomes the shard
                _adopt_loaded(p, held)
                materialised = True
                continue
            # load_state_dict(assign=True) put a new parameter on the module: keep the
            # unit's own (an optimizer may hold it) and take the new values into it.
            sharded = _sharded(p)
            with torch.no_grad():
                value = held.redistribute(sharded.device_mesh, sharded.placements)
                sharded.to_local().copy_(value.to_local())
            p.sharded.requires_grad_(held.requires_grad)
            p.set_on_modules(p.sharded)

        if materialised and state.unit is not None:
            state.unit.lay_out()

    module.register_state_dict_post_hook(save_sharded)
    module.register_load_state_dict_pre_hook(load_pre)
    module.register_load_state_dict_post_hook(load_post)


def _adopt_loaded(p: FSDPParam, held: DTensor) -> None:
    """``load_state_dict(assign=True)`` into a unit still on the meta device (torch's
    rank-0-broadcast recipe): the loaded DTensor, in the unit's layout, is the new sharded
    parameter (no optimizer can hold the meta one yet)."""
    sharded = _sharded(p)
    new: torch.Tensor = held
    if held.device_mesh != sharded.device_mesh or held.placements != sharded.placements:
        value = held.redistribute(sharded.device_mesh, sharded.placements)
        new = nn.Parameter(value, requires_grad=held.requires_grad)
    p.set_on_modules(new)  # type: ignore[arg-type]
    p.reset_sharded()


def _sharded(p: FSDPParam) -> DTensor:
    value: torch.Tensor = p.sharded
    assert isinstance(value, DTensor)
    return value


def _make_sharded(state: FSDPState, prefix: str) -> None:
    """Reshard ``state``'s unit fully before a load (the shards are what gets loaded into;
    gathered copies, including a block kept after forward, would go stale)."""
    unit = state.unit
    if unit is None:
        return
    if unit.sharded_state is not ShardedState.SHARDED or unit.busy:
        if state.training_state is not TrainingState.IDLE:
            where = prefix.rstrip(".") or type(state.module).__name__
            raise RuntimeError(
                f"load_state_dict: the fully_shard unit {where!r} is in the middle of its "
                f"{state.training_state.name.lower()}; load state dicts between steps"
            )
        unit.reshard()
    unit.adopt_replacements()


# --- full state dicts ---------------------------------------------------------------------------


def get_full_state_dict(
    module: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, Any]:
    """The unsharded state dict of ``module``: plain tensors, loadable into an unsharded copy.

    A collective: every rank of the module's meshes must call it. Each DTensor entry is
    gathered in turn (one all-gather per tensor, then freed on ranks that drop it), so
    peak extra memory is one full tensor. With ``rank0_only`` global rank 0 gets every
    entry and other ranks an empty dict; with ``cpu_offload`` the values are moved to CPU.
    Non-tensor entries (extra state) and plain tensors (buffers, ignored parameters) are
    returned as the module holds them.
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    full: dict[str, Any] = {}
    with torch.no_grad():
        for key, value in module.state_dict().items():
            if isinstance(value, DTensor):
                value = _full_value(value)
            if not keep:
                continue
            if cpu_offload and isinstance(value, torch.Tensor):
                value = value.cpu()
            full[key] = value
    return full


def set_full_state_dict(
    module: nn.Module,
    full_state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    broadcast_from_rank0: bool = False,
    group: dist.ProcessGroup | None = None,
) -> _IncompatibleKeys:
    """Load a full state dict (plain tensors) into a sharded ``module``; returns the key report.

    Without ``broadcast_from_rank0`` every rank passes the same full state dict and keeps
    its own rows of each tensor (no communication). With it, only rank 0 of ``group``
    (default: the world) needs the values (others may pass ``{}``): rank 0 checks the keys
    and shapes, then broadcasts each tensor in turn, so a bad state dict raises the same
    error on every rank instead of leaving them waiting. Every rank of ``group`` must hold
    a module of the same structure. Errors name the key, as ``load_state_dict``'s do.
    """
    template = module.state_dict()
    if broadcast_from_rank0:
        full_state_dict = _broadcast_full(template, full_state_dict, strict, group)
    converted: dict[str, Any] = {}
    for key, value in full_state_dict.items():
        like = template.get(key)
        if (
            isinstance(like, DTensor)
            and isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor)
            and value.shape == like.shape
        ):
            value = shard_full_tensor(value, like)
        converted[key] = value
    return module.load_state_dict(converted, strict=strict)


def _broadcast_full(
    template: Mapping[str, Any],
    full: Mapping[str, Any],
    strict: bool,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """Rank 0's ``full`` entries for the keys of ``template``, received on every rank."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    # [error message or None, tensor keys to receive, non-tensor entries (extra state)]
    plan: list[Any] = [None, [], {}]
    if dist.get_rank() == src:
        plan = _broadcast_plan(template, full, strict)
    dist.broadcast_object_list(plan, src=src, group=group)
    error, keys, received = plan
    if error is not None:
        raise RuntimeError(error)
    device = collective_device(group)
    for key in keys:
        like = template[key]
        if dist.get_rank() == src:
            buffer = full[key].detach().to(device=device, dtype=like.dtype).contiguous()
        else:
            buffer = torch.empty(like.shape, dtype=like.dtype, device=device)
        dist.broadcast(buffer, src=src, group=group)
        received[key] = buffer
    return dict(received)


def _broadcast_plan(
    template: Mapping[str, Any], full: Mapping[str, Any], strict: bool
) -> list[Any]:
    missing = [k for k in template if k not in full]
    unexpected = [k for k in full if k not in template]
    wrong = [
        f"size mismatch for {k}: the state dict has shape {tuple(full[k].shape)}, the model "
        f"{tuple(template[k].shape)}"
        for k in template
        if k in full
        and isinstance(template[k], torch.Tensor)
        and (not isinstance(full[k], torch.Tensor) or full[k].shape != template[k].shape)
    ]
    problems = wrong
    if strict and missing:
        problems = [f"Missing key(s) in state_dict: {missing}", *problems]
    if strict and unexpected:
        problems = [f"Unexpected key(s) in state_dict: {unexpected}", *problems]
    error = (
        "set_full_state_dict(broadcast_from_rank0=True): rank 0's state dict does not fit the "
        "model:\n\t" + "\n\t".join(problems)
        if problems
        else None
    )
    present = [k for k in template if k in full]
    tensors = [k for k in present if isinstance(template[k], torch.Tensor)]
    others = {k: full[k] for k in present if not isinstance(template[k], torch.Tensor)}
    return [error, tensors, others]
