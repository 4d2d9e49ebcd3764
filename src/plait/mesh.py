"""Device meshes for plait's APIs: defaults and validation, and the small DTensor helpers
the packages share (building a DTensor from a known spec, a gradient's local part).

Meshes are always passed explicitly; when an API is given none it builds a 1-D mesh over
the whole world on the module's device type. Named dimensions follow torchtitan's
vocabulary; :mod:`plait.layout` holds the names.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement
from torch.utils._python_dispatch import _disable_current_modes

from plait.layout import DP


def module_device_type(module: nn.Module) -> str:
    """The device type of ``module``'s parameters (``"cpu"`` for a module without any)."""
    for param in module.parameters():
        return param.device.type
    for buffer in module.buffers():
        return buffer.device.type
    return "cpu"


def default_mesh(module: nn.Module, api_name: str) -> DeviceMesh:
    """A 1-D mesh over the whole world on ``module``'s device type (meta: the accelerator
    if there is one, else CPU). Without a default process group it initialises one from
    the environment (``env://``: torchrun's variables), as torch's ``fully_shard`` and
    ``replicate`` do; RuntimeError naming the fix where the environment has none."""
    if not dist.is_initialized():
        try:
            dist.init_process_group()
        except ValueError as err:  # env:// without RANK, WORLD_SIZE, MASTER_ADDR, ...
            raise RuntimeError(
                f"{api_name} needs a default process group and could not initialise one "
                f"from the environment ({err}): run under torchrun, call "
                "torch.distributed.init_process_group() first, or pass mesh=..."
            ) from err
    device_type = module_device_type(module)
    if device_type == "meta":  # built for deferred init: use the device it will live on
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def one_dim_group(mesh: object, api_name: str) -> dist.ProcessGroup:
    """The process group of a 1-D ``mesh``, or a clear error naming the fix."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{api_name}: mesh must be a torch.distributed.device_mesh.DeviceMesh, "
            f"got {type(mesh).__name__}"
        )
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        raise ValueError(
            f"{api_name} needs a 1-D mesh (the data-parallel group) but got a {mesh.ndim}-D mesh "
            f"of shape {tuple(mesh.shape)} with dims {names}: pass one dimension, "
            f'e.g. mesh["{DP}"]'
        )
    group = mesh.get_group()
    assert isinstance(group, dist.ProcessGroup)
    return group


def mesh_coordinate(mesh: DeviceMesh | None, dim: str) -> int:
    """This rank's index along ``dim`` (0 where the mesh has no such dimension: meshes
    built from a layout leave out the dimensions of size 1)."""
    if mesh is None or dim not in (mesh.mesh_dim_names or ()):
        return 0
    return mesh.get_local_rank(dim)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The compute device of ``mesh`` on this rank (the current CUDA device for "cuda")."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(
        mesh.device_type, torch.get_device_module(mesh.device_type).current_device()
    )


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device a tensor must be on for a collective on ``group`` (CPU for gloo)."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


_SUBGROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[int, int], dist.ProcessGroup]]
_SUBGROUPS = weakref.WeakKeyDictionary()


def subgroup(group: dist.ProcessGroup, index: int, size: int) -> dist.ProcessGroup:
    """The ``index``-th block of ``size`` consecutive ranks of ``group`` (cached).

    Only the block's own members take part in creating it, so ranks of other blocks (or
    outside ``group``) need not call this at the same time.
    """
    cache = _SUBGROUPS.setdefault(group, {})
    if (index, size) not in cache:
        ranks = dist.get_process_group_ranks(group)[index * size : (index + 1) * size]
        if ranks != sorted(ranks):
            raise ValueError(f"subgroup: ranks {ranks} of the parent group must be increasing")
        new = dist.new_group(ranks, use_local_synchronization=True)
        assert isinstance(new, dist.ProcessGroup)
        cache[(index, size)] = new
    return cache[(index, size)]


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to host memory. From a GPU into pinned memory, without waiting: the
    copy is queued on the current stream (wait for it, by an event or a later read on that
    stream, before the host reads the copy)."""
    pinned = t.is_cuda
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
    return host.copy_(t, non_blocking=pinned)


def check_mesh_device(mesh: DeviceMesh, module: nn.Module, api_name: str) -> None:
    """Refuse a mesh whose device type differs from the module's (meta is fine)."""
    device_type = module_device_type(module)
    if device_type not in ("meta", mesh.device_type):
        raise ValueError(
            f"{api_name}: the mesh is on {mesh.device_type!r} but {type(module).__name__}'s "
            f"parameters are on {device_type!r}: move the module first "
            f"(module.to({mesh.device_type!r})) or build the mesh with "
            f'init_device_mesh("{device_type}", ...)'
        )


def buffers_to_mesh_device(mesh: DeviceMesh, modules: Iterable[nn.Module]) -> None:
    """Move the buffers of ``modules`` (and their submodules) onto ``mesh``'s device in
    place, as torch's ``fully_shard`` moves a module's states (meta ones stay). For an
    offloaded unit (``CPUOffloadPolicy``), whose module may be built on the CPU: the
    parameters' shards stay there, but forward runs on the device, buffers included."""
    device = mesh_device(mesh)
    with torch.no_grad():
        for module in modules:
            for buffer in module.buffers():
                if buffer.device != device and buffer.device.type != "meta":
                    buffer.data = buffer.to(device)


def data_parallel_submesh(
    mesh: DeviceMesh, replicate: tuple[str, ...], shard: tuple[str, ...], api_name: str
) -> DeviceMesh:
    """The 1-D (shard) or 2-D (replicate, shard) mesh over the named dims of ``mesh``.

    Several names on one side are flattened into one dim. Dims of ``mesh`` not named are
    model-parallel (tensor parallelism): parameters placed on them are sharded further.
    """
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"{api_name}: dp_mesh_dims needs a mesh with mesh_dim_names")
    unknown = [n for n in replicate + shard if n not in names]
    if unknown:
        raise ValueError(
            f"{api_name}: dp_mesh_dims names {unknown}, which the mesh does not have (its dims "
            f"are {names}): use names from mesh_dim_names"
        )

    def one_dim(side: tuple[str, ...]) -> DeviceMesh:
        sub = mesh[side]
        return sub._flatten("_".join(side)) if len(side) > 1 else sub

    if not replicate:
        return one_dim(shard)
    if not shard:  # replication only: a shard group of one rank per replica
        raise NotImplementedError(
            f"{api_name}: dp_mesh_dims with replicate= only (pure replication) is not "
            "supported: use plait.replicate, or name a shard dim"
        )
    if len(replicate) > 1 or len(shard) > 1:
        raise NotImplementedError(
            f"{api_name}: dp_mesh_dims flattening several names on a side is supported "
            "without replicate= only; name one dim for each side"
        )
    return mesh[replicate + shard]


def local_in_layout(
    grad: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> torch.Tensor:
    """This rank's part of ``grad`` laid out as a tensor-parallel parameter with
    ``placements`` on ``mesh`` (a plain ``grad`` is returned as it is).

    A DTensor gradient in other placements than its parameter (``Partial`` where a
    replicated parameter met sharded activations, e.g. a sequence-parallel norm weight;
    ``Replicate`` for a vocabulary-sharded embedding) is redistributed first: a collective
    over ``mesh``, which every rank of it runs, in the same order, since they all run the
    same backward.
    """
    if not isinstance(grad, DTensor):
        return grad
    if tuple(grad.placements) != tuple(placements):
        grad = grad.redistribute(mesh, placements)
    return grad._local_tensor


def contiguous_strides(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a zero-size dim counts as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def make_dtensor(local: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False) -> DTensor:
    """A DTensor around ``local`` with a precomputed spec: no communication, no checks.

    Built directly rather than through ``DTensor.from_local`` because gradients are
    wrapped for every parameter at every step, and the public path costs far more.
    """
    # ``__new__`` alone: DTensor's ``__init__`` does nothing but sits behind a dynamo guard
    # that costs more than building the tensor.
    if local.storage_offset() == 0:
        return DTensor.__new__(DTensor, local, spec, requires_grad=requires_grad)
    # ``__new__`` gives the wrapper the local tensor's storage offset, and torch's pickling
    # then takes the wrapper (which has no storage) for a tensor with data, and fails: a
    # wrapper at offset 0 pickles (a gradient that is a piece of its unit's reduce-scatter
    # output saves with that buffer, as any view does).
    meta = spec.tensor_meta
    assert meta is not None
    wrapper = torch.Tensor._make_wrapper_subclass(
        DTensor,
        meta.shape,
        strides=meta.stride,
        dtype=local.dtype,
        device=local.device,
        layout=local.layout,
        requires_grad=requires_grad,
    )
    wrapper._spec = spec
    wrapper._local_tensor = local
    return wrapper


def own_storage(view: torch.Tensor) -> torch.Tensor:
    """``view``'s memory as the whole of a storage object of its own (no copy).

    ``fully_shard`` keeps a unit's shards as views into one flat buffer. The state dict's
    DTensors are made by DTensor's own operators (``detach``), which give the wrapper the
    local tensor's storage offset; torch's pickling then takes a wrapper at a non-zero
    offset (which has no storage) for a tensor with data, and fails, so
    ``torch.save(model.state_dict())``, ``pickle`` and ``copy.deepcopy`` of the state dict
    would fail; and a view at offset 0 would save the whole buffer, every other
    parameter's bytes included. A storage slice aliases exactly the view's bytes (and
    keeps the buffer alive), so the fast path of one buffer per unit stays. Made once per
    shard (at ``fully_shard`` and after ``module._apply``), not per step.

    Tensors without real data (meta, fake) and tensor subclasses are returned as they are.
    """
    if type(view) is not torch.Tensor or view.is_meta:
        return view
    buffer, nbytes = view.untyped_storage(), view.numel() * view.element_size()
    if view.storage_offset() == 0 and buffer.nbytes() == nbytes:
        return view
    if not view.is_contiguous():
        raise ValueError(f"own_storage: expected a contiguous view, got strides {view.stride()}")
    start = view.storage_offset() * view.element_size()
    piece = buffer[start : start + nbytes]
    piece._plait_buffer = buffer  # see buffer_of
    if torch._C._len_torch_dispatch_stack() == 0:  # the common case, and twice as fast
        return _on_storage(piece, view)
    # Outside any dispatch mode: a live-memory tracker must not count the alias as new bytes.
    with _disable_current_modes():
        return _on_storage(piece, view)


def _on_storage(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s shape and dtype over the whole of ``storage``."""
    out = torch.empty(0, dtype=like.dtype, device=like.device)
    return out.set_(storage, 0, like.shape, like.stride())


def buffer_of(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """The storage whose memory ``storage`` is: the whole buffer for a piece that
    :func:`own_storage` made, else ``storage`` itself. Memory accounting counts buffers."""
    return getattr(storage, "_plait_buffer", storage)
