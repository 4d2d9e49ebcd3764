"""Grouped GEMM: every local expert's matmul in one ``torch._grouped_mm`` call.

:func:`grouped_swiglu` runs ``E`` SwiGLU experts on expert-sorted rows with three grouped
GEMMs (one per stacked matrix, ``w1``, ``w3``, ``w2``) and, through torch's autograd of
``_grouped_mm``, six in backward (each matrix's input and weight gradients). Expert ``e``
owns rows ``[offs[e - 1], offs[e])``, ``offs`` the running sum of the row counts: the
offsets stay a device tensor, so nothing is read on the host (the fused CUDA kernel reads
them on the GPU; torch's CPU implementation reads them inside the op).

:func:`grouped_mm_supported` says when it may run; elsewhere the caller runs the experts
one after another (``plait.experts.swiglu``). Autocast does not cast ``_grouped_mm``'s
operands, so under autocast they are cast here (the weights by :func:`autocast_weights`,
the rows per GEMM by :func:`grouped_swiglu`), as autocast casts each matmul of the loop:
the same precision either way.

The numbers: torch's CPU implementation multiplies each group with the very ``mm`` the loop
calls, so on CPU the GEMMs, forward and backward, are bitwise the loop's. The SwiGLU
between them (``silu``, ``*``) runs once over all rows instead of once per expert, and
ATen's CPU kernels compute the part of a tensor that does not fill their vectors in scalar
code, which can move a ``silu`` by an ulp: the two paths are bitwise equal when the hidden
width is a multiple of 32 floats (no such part either way), else equal to that rounding.
CUDA's fused kernel rounds differently from cuBLAS's ``mm``, to float tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

__all__ = ["autocast_weights", "grouped_mm_supported", "grouped_swiglu"]

#: Dtypes torch's ``_grouped_mm`` accepts. Its CPU implementation runs all three; on CUDA
#: only bfloat16 has the fused kernel, and tracing (fake tensors) only accepts bfloat16.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The fused CUDA kernel prepares its groups with one thread each in one block.
_MAX_CUDA_GROUPS = 1023


def grouped_mm_supported(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether the experts may run as grouped GEMMs on rows ``x`` ``(n, dim)`` with the
    stacked ``weights`` (this rank's local tensors, ``(E, in, out)`` each).

    The rows are multiplied in their own dtype, or under autocast in autocast's dtype for
    their device (autocast casts the loop's matmuls but not ``_grouped_mm``: the weights
    come cast by :func:`autocast_weights`, and :func:`grouped_swiglu` casts the rows).
    True when all of these hold, else False (run the loop):

    * **one dtype, one device**: every weight in that dtype and on the rows' device (the
      op does not promote).
    * **16-byte rows**: the last dim of the rows and of every weight (``dim`` and
      ``hidden``), times the element size, is a multiple of 16 bytes. ``_grouped_mm``
      refuses other row strides, on every device, and backward multiplies the transposes.
    * **traced** (``torch.compile``, fake tensors as in ``plait plan --dry-run``, the meta
      device): bfloat16 only, since torch's meta kernel refuses other dtypes; on CUDA
      also the group limit below (data pointers cannot be read while tracing).
    * **CPU**: float32, bfloat16 or float16. torch runs each group through the loop's
      ``mm``, inside one call.
    * **CUDA**: bfloat16, a GPU of compute capability 9.x or 10.x (H100, H200, B200), fewer
      than 1024 local experts and 16-byte-aligned data pointers: torch's fused kernel.
      Anything else (fp32, other GPUs, ROCm) takes torch's per-group fallback, which reads
      the offsets on the host like the loop and is no faster, or is refused.
    * any other device: never.
    """
    device = x.device.type
    dtype = _autocast_dtype(x) or x.dtype  # what the rows are multiplied in
    if any(w.dtype != dtype or w.device != x.device for w in weights):
        return False
    width = x.shape[-1] * dtype.itemsize
    if (
        dtype not in _DTYPES
        or width % 16
        or any(w.shape[-1] * w.element_size() % 16 for w in weights)
    ):
        return False
    experts = weights[0].shape[0] if weights else 0
    if torch.compiler.is_compiling() or device == "meta" or is_fake(x):
        return dtype == torch.bfloat16 and (device != "cuda" or experts <= _MAX_CUDA_GROUPS)
    if device == "cpu":
        return True
    if device != "cuda" or torch.version.hip is not None or dtype != torch.bfloat16:
        return False
    major, _ = torch.cuda.get_device_capability(x.device)
    aligned = [*weights, x] if x.dtype == dtype else weights  # a cast is a fresh block
    return (
        major in (9, 10)
        and experts <= _MAX_CUDA_GROUPS
        and all(t.data_ptr() % 16 == 0 for t in aligned)
    )


def autocast_weights(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``weights`` as autocast would hand them to a matmul of rows ``x``: cast to
    autocast's dtype where autocast is on for ``x``'s device and ``x`` is floating point;
    as they are otherwise. The casts are differentiable: the gradients reach the weights
    in their own dtype, as through autocast's."""
    dtype = _autocast_dtype(x)
    if dtype is None:
        return tuple(weights)
    return tuple(w.to(dtype) if w.is_floating_point() else w for w in weights)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes ``x``'s matmuls in on its device (the meta device as
    the CPU: tracing); None when autocast is off there or ``x`` is not floating point."""
    device = "cpu" if x.device.type == "meta" else x.device.type
    if not x.is_floating_point() or not torch.amp.is_autocast_available(device):
        return None
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    """``w2(silu(x @ w1) * (x @ w3))`` per expert, as grouped GEMMs: ``x`` ``(n, dim)`` rows
    in expert order, ``counts`` ``(E,)`` integers summing to ``n`` (not checked: that would
    read them on the host), ``w1``/``w3`` ``(E, dim, hidden)``, ``w2`` ``(E, hidden, dim)``.
    Returns ``(n, dim)``. Only where :func:`grouped_mm_supported` holds for ``x`` in the
    rows: under autocast ``x`` may be in another dtype than the (cast) weights, and each
    GEMM casts it."""
    offs = counts.cumsum(0, dtype=torch.int32)  # (E,) where each expert's rows end
    w1, w2, w3 = (w.contiguous() for w in (w1, w2, w3))  # no copy for parameters
    # Each GEMM casts the rows itself, as autocast casts each matmul's input: the two
    # gradients of x then meet in x's dtype, not in the weights' (no-ops without a cast).
    gate = torch._grouped_mm(_dense_rows(x.to(w1.dtype)), w1, offs=offs)  # (n, hidden)
    up = torch._grouped_mm(_dense_rows(x.to(w3.dtype)), w3, offs=offs)
    h = F.silu(gate) * up
    out = torch._grouped_mm(h, w2, offs=offs)  # (n, dim)
    return _dense_grad(out)


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``(n, k)`` with row-major strides ``(k, 1)``: itself, or a copy.

    ``is_contiguous`` is not enough: an empty or one-row tensor counts as contiguous with
    any strides (``.sum().backward()`` hands an empty output strides ``(0, 0)``), and
    ``_grouped_mm`` checks the strides themselves."""
    if t.stride() == (t.shape[1], 1):
        return t
    return t.clone(memory_format=torch.contiguous_format)


class _DenseGrad(torch.autograd.Function):
    """The identity; backward hands the gradient on with row-major strides.

    The gradient that reaches the experts' output may be any strided tensor (an expanded
    one from ``out.sum().backward()``, strides ``(0, 0)``), which ``_grouped_mm``'s own
    backward refuses. A gradient already row-major passes as it is."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _dense_rows(grad)


def _dense_grad(out: torch.Tensor) -> torch.Tensor:
    if not out.requires_grad:
        return out
    dense: torch.Tensor = _DenseGrad.apply(out)
    return dense
