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

import torch
from torch import nn

__all__ = ["offload_hooks"]

_Packed = tuple[torch.Tensor, torch.device | None]


def _storage_ptr(x: torch.Tensor) -> int | None:
    if x.layout != torch.strided or x.device.type == "meta":
        return None
    return x.untyped_storage().data_ptr()


def offload_hooks(module: nn.Module) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that park ``module``'s activations on CPU until backward."""
    resident = {
        ptr
        for t in (*module.parameters(), *module.buffers())
        if (ptr := _storage_ptr(t)) is not None
    }

    def pack(x: torch.Tensor) -> _Packed:
        if x.device.type == "cpu" or x.layout != torch.strided or _storage_ptr(x) in resident:
            return x, None
        # Pinned host memory lets the copy run asynchronously on the current stream; the copy
        # back in backward is queued on the device after it, so no synchronisation is needed.
        pinned = x.device.type == "cuda"
        host = torch.empty(x.size(), dtype=x.dtype, device="cpu", pin_memory=pinned)
        host.copy_(x, non_blocking=pinned)
        return host, x.device

    def unpack(packed: _Packed) -> torch.Tensor:
        tensor, device = packed
        return tensor if device is None else tensor.to(device, non_blocking=True)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
