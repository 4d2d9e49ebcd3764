"""Activation offloading: keep what backward needs in host memory instead of recomputing it.

``checkpoint(module, offload=True)`` trades PCIe bandwidth for compute: every tensor autograd
saves inside the module is copied to CPU during the forward (into pinned memory, without
blocking, when it lives on CUDA) and copied back to its device when backward unpacks it.
Nothing is recomputed, so random ops and autocast need no replay.

Two kinds of saved tensors stay where they are: those already on CPU (moving them would be a
no-op), and the module's own parameters and buffers (and views of them, such as the
transposed weight a ``Linear`` saves): they stay resident anyway, so copying them would only
cost time and host memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait.mesh import host_copy, make_dtensor

__all__ = ["offload_hooks"]

# (the tensor or its host copy, the device to bring it back to or None, a DTensor's spec)
_Packed = tuple[torch.Tensor, torch.device | None, Any]


def _local(x: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``x``'s data on this rank: a DTensor's local tensor."""
    return x._local_tensor if isinstance(x, DTensor) else x


def _storage_ptr(x: torch.Tensor) -> int | None:
    x = _local(x)
    if x.layout != torch.strided or x.device.type == "meta":
        return None
    return x.untyped_storage().data_ptr()


def offload_hooks(module: nn.Module) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that park ``module``'s activations on CPU until backward.

    A DTensor (tensor or expert parallelism) parks its local tensor and comes back as the
    same DTensor around the restored one."""
    resident = {
        ptr
        for t in (*module.parameters(), *module.buffers())
        if (ptr := _storage_ptr(t)) is not None
    }

    def pack(x: torch.Tensor) -> _Packed:
        local = _local(x)
        if local.device.type == "cpu" or local.layout != torch.strided:
            return x, None, None
        if _storage_ptr(x) in resident:
            return x, None, None
        # Pinned host memory lets the copy run asynchronously on the current stream; the copy
        # back in backward is queued on the device after it, so no synchronisation is needed.
        host = host_copy(local)
        spec = x._spec if isinstance(x, DTensor) else None
        return host, local.device, spec

    def unpack(packed: _Packed) -> torch.Tensor:
        tensor, device, spec = packed
        if device is None:
            return tensor
        restored = tensor.to(device, non_blocking=True)
        return restored if spec is None else make_dtensor(restored, spec)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
