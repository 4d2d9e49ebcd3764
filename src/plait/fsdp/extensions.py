"""All-gather extensions: a parameter that chooses what is gathered and how it is rebuilt.

torch's contract (how float8 and other low-precision weights are all-gathered under FSDP2):
the sharded local tensor (a tensor subclass, or any tensor with the methods patched on) defines

* ``fsdp_pre_all_gather(mesh)`` or ``fsdp_pre_all_gather(mesh, outer_size, outer_stride,
  module, mp_policy)``: called on this rank's shard before every all-gather; returns
  ``(inputs, metadata)``, the tensors to gather and anything to hand to the post hook.
  ``mesh`` is the 1-D shard mesh (HSDP's replicate dimension left out); on a rank whose
  shard is padded, every input must have the padded shard's size;
* ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)``: ``outputs`` are the
  gathered inputs (concatenated along dim 0, rank after rank). Without ``out`` (first
  gather) it returns ``(unsharded_tensor, inner_tensors)``: the tensor the unsharded
  parameter wraps (viewed at the original size, so padding rows are dropped), and the
  tensors whose storage is freed at reshard and reallocated before each later gather.
  On later gathers it is called with ``out=`` the unsharded parameter and must write into
  it in place (autograd holds that object); the outputs then live in the same buffers as
  at the first gather.

:class:`GatherExtension` is that protocol for one parameter; its unit gathers the inputs of
all its parameters in one collective (``group.FSDPParamGroup``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.fsdp.param import FSDPParam
from plait.fsdp.policies import MixedPrecisionPolicy
from plait.mesh import contiguous_strides


def has_extension(param: FSDPParam) -> bool:
    """The parameter's sharded local tensor defines the all-gather hooks (both or neither)."""
    local = param.sharded._local_tensor  # type: ignore[attr-defined]
    pre, post = hasattr(local, "fsdp_pre_all_gather"), hasattr(local, "fsdp_post_all_gather")
    if pre != post:
        raise TypeError(
            f"fully_shard: parameter {param.fqn!r} defines only one of fsdp_pre_all_gather "
            "and fsdp_post_all_gather; an all-gather extension needs both"
        )
    return pre


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh a parameter is sharded over (the last dimension; HSDP's is a submesh)."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "fully_shard: all-gather extensions on a 2-D mesh need mesh_dim_names, to hand "
            "fsdp_pre_all_gather the shard dimension; name the mesh's dimensions"
        )
    return mesh[names[-1]]


def _free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = int(tensor.storage_offset() + tensor.numel()) * tensor.itemsize
    if storage.nbytes() < nbytes:
        storage.resize_(nbytes)


class GatherExtension:
    """One parameter's extension state across gathers: metadata, sizes, output buffers."""

    def __init__(self, param: FSDPParam, world: int, mp_policy: MixedPrecisionPolicy) -> None:
        self.param = param
        self.world = world
        self.mp_policy = mp_policy  # handed to 5-argument pre-all-gather hooks
        self.metadata: Any = None
        self.sizes: list[torch.Size] = []
        # Flat (world * numel) buffers the gathered inputs land in, kept across gathers so
        # that the post hook's ``out=`` path finds the storage it aliased at the first one.
        self.outputs: list[torch.Tensor] = []
        self.inner: tuple[torch.Tensor, ...] = ()

    def inputs(self) -> list[torch.Tensor]:
        """Call the pre-all-gather hook; this rank's inputs, each flat as bytes."""
        p = self.param
        local = p.sharded._local_tensor  # type: ignore[attr-defined]
        if p.policy.offload:
            local = local.to(p.device, non_blocking=True)
        hook = local.fsdp_pre_all_gather
        arity = len(inspect.signature(hook).parameters)
        mesh = shard_mesh(p.mesh)
        if arity == 1:
            inputs, self.metadata = hook(mesh)
        elif arity == 5:
            module = p.locations[0].module
            inputs, self.metadata = hook(
                mesh, p.shape, contiguous_strides(p.shape), module, self.mp_policy
            )
        else:
            raise TypeError(
                f"fully_shard: fsdp_pre_all_gather of parameter {p.fqn!r} takes {arity} "
                "arguments; expected (mesh) or (mesh, outer_size, outer_stride, module, "
                "mp_policy)"
            )
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        padded_size = torch.Size((p.chunk_rows, *p.shape[1:]))
        if p.local_rows != p.chunk_rows and any(t.size() != padded_size for t in inputs):
            raise ValueError(
                f"fully_shard: parameter {p.fqn!r} of size {tuple(p.shape)} is sharded "
                f"unevenly over {self.world} ranks; fsdp_pre_all_gather must return inputs "
                f"of the padded shard size {tuple(padded_size)}, got "
                f"{[tuple(t.size()) for t in inputs]}"
            )
        self.sizes = [t.size() for t in inputs]
        kinds = [(self.world * t.numel(), t.dtype) for t in inputs]
        if [(o.numel(), o.dtype) for o in self.outputs] != kinds:  # first gather, or changed
            device = p.device
            self.outputs = [
                torch.empty(self.world * t.numel(), dtype=t.dtype, device=device) for t in inputs
            ]
        return [t.contiguous().view(-1).view(torch.uint8) for t in inputs]

    @property
    def nbytes(self) -> list[int]:
        """Bytes of each input (valid after :meth:`inputs`)."""
        return [o.numel() // self.world * o.itemsize for o in self.outputs]

    def finish(self, columns: list[torch.Tensor]) -> nn.Parameter:
        """Rebuild the unsharded parameter from the gathered ``columns``: (world, nbytes) each.

        The first time the post hook creates it; later it writes into it (``out=``).
        """
        p = self.param
        for out, column in zip(self.outputs, columns, strict=True):
            _alloc(out)
            # Through ``.data`` (its own version counter): the unsharded parameter may alias
            # this buffer, and autograd saved it in forward; refilling it is no change.
            out.data.view(torch.uint8).view(self.world, -1).copy_(column)
        gathered = tuple(
            out.view(-1, *size[1:]) for out, size in zip(self.outputs, self.sizes, strict=True)
        )
        local = p.sharded._local_tensor  # type: ignore[attr-defined]
        if p.unsharded is not None:
            for tensor in self.inner:
                _alloc(tensor)
            local.fsdp_post_all_gather(gathered, self.metadata, p.param_dtype, out=p.unsharded)
        else:
            tensor, inner = local.fsdp_post_all_gather(gathered, self.metadata, p.param_dtype)
            self.inner = tuple(inner)
            view = torch.as_strided(tensor, p.shape, contiguous_strides(p.shape), 0)
            # Wrapped as without extensions: a tensor-parallel parameter's unsharded tensor
            # is a DTensor on its tp mesh (what the tp styles' layers expect).
            p.unsharded = p.new_unsharded(view)
        self.metadata = None
        return p.unsharded

    def free(self) -> None:
        """Reshard: free the gathered buffers and the hook's inner tensors (kept as objects)."""
        for tensor in (*self.outputs, *self.inner):
            _free(tensor)
