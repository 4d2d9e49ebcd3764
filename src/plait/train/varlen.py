"""Flash attention's variable-length kernel, as packed rows use it on GPUs.

Packed rows (:mod:`plait.train.packing`) keep attention inside documents. Through SDPA that
takes a dense ``(B, 1, T, T)`` mask, which rules out the flash kernel and costs ``B * T^2``
bytes. ``torch.nn.attention.varlen.varlen_attn`` instead takes the tokens of all rows
flattened, ``(tokens, heads, d)``, and the cumulative boundaries of the documents
(``cu_seqlens``, int32): each document is its own causal sequence, no mask is built.

A :class:`VarlenKernel` is that kernel and what it takes (device type, dtypes, head dims,
no dropout). :func:`varlen_kernel` says which one runs on a device: flash's on CUDA GPUs
that run flash attention, where this torch has ``varlen_attn``; none elsewhere (the CPU
keeps the dense mask). Tests substitute it (where :mod:`plait.train.packing` looks it up)
with a reference of the same semantics, so the plumbing is checked on machines without
the kernel.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["DISABLE", "VarlenKernel", "VarlenRun", "compute_dtype", "flash_call", "varlen_kernel"]

logger = logging.getLogger(__name__)

#: ``PLAIT_VARLEN=0`` in the environment keeps packed rows on SDPA with the dense mask on
#: GPUs too: a way around a torch whose variable-length kernel fails (with torch.compile,
#: say) without giving up packing.
DISABLE = "PLAIT_VARLEN"

#: ``run(q, k, v, cu_seqlens, longest, gqa)``: ``q`` ``(tokens, heads, d)``, ``k`` / ``v``
#: ``(tokens, kv heads, d)`` (fewer with ``gqa``: each serves ``heads / kv heads``
#: consecutive query heads, as SDPA's ``enable_gqa``), ``cu_seqlens`` ``(N + 1,)`` int32 the
#: documents' cumulative boundaries over the tokens, ``longest`` the longest document (an
#: upper bound is enough). Returns ``(tokens, heads, d)``: causal attention inside each
#: document, scaled by ``1 / sqrt(d)``.
VarlenRun = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, bool], torch.Tensor
]


@dataclass(frozen=True)
class VarlenKernel:
    """A variable-length causal attention kernel (:data:`VarlenRun`) and the inputs it
    takes: tensors on ``device_type`` computed in one of ``dtypes``, head dims that are a
    multiple of ``head_dim_multiple`` up to ``max_head_dim``, no dropout."""

    run: VarlenRun
    device_type: str = "cuda"
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    max_head_dim: int = 256
    head_dim_multiple: int = 8

    def takes(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
        """Whether it runs SDPA-layout ``q``, ``k``, ``v`` ``(B, heads, T, d)`` with
        ``dropout_p``: all facts known without looking at values (no device sync, and
        constant for a compiled graph)."""
        d = q.shape[-1]
        return (
            dropout_p == 0.0  # the kernel has no dropout
            and not any(isinstance(t, DTensor) for t in (q, k, v))  # local tensors only
            and q.device.type == self.device_type
            and compute_dtype(q) in self.dtypes
            and k.shape[-1] == d
            and v.shape[-1] == d
            and d <= self.max_head_dim
            and d % self.head_dim_multiple == 0
        )


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype SDPA would compute ``q`` in: autocast's where autocast is on for its
    device (SDPA is one of autocast's lower-precision ops: mixed precision may give
    parameters in float32 and attention in bfloat16), else ``q``'s own."""
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return q.dtype


@dataclass(frozen=True)
class _FlashVarlen:
    """:data:`VarlenRun` through torch's ``varlen_attn``, with the keywords this torch
    spells causality with (``window_size=(-1, 0)``, which replaced 2.10's
    ``is_causal=True``) and whether it has ``enable_gqa`` (later versions check the head
    counts against it; the flash kernel itself takes fewer key/value heads in every
    version, so without the flag grouped heads go as they are)."""

    fn: Callable[..., Any]
    causal: tuple[tuple[str, Any], ...]
    gqa_flag: bool

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        longest: int,
        gqa: bool,
    ) -> torch.Tensor:
        keywords = dict(self.causal)
        if gqa and self.gqa_flag:
            keywords["enable_gqa"] = True
        out: torch.Tensor = self.fn(q, k, v, cu_seqlens, cu_seqlens, longest, longest, **keywords)
        return out


@functools.lru_cache(maxsize=1)
def _flash_varlen() -> _FlashVarlen | None:
    """torch's ``varlen_attn`` with its keywords, or None (once, with a warning naming the
    torch version) where this torch has none we can call."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        _warn_unavailable()
        return None
    flash = flash_call(varlen_attn)
    if flash is None:
        _warn_unavailable()
    return flash


def flash_call(varlen_attn: Callable[..., Any]) -> _FlashVarlen | None:
    """:data:`VarlenRun` through ``varlen_attn``, spelling causality as its signature
    does; None if it has neither spelling."""
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: tuple[tuple[str, Any], ...] = (("window_size", (-1, 0)),)
    elif "is_causal" in params:
        causal = (("is_causal", True),)
    else:
        return None
    return _FlashVarlen(varlen_attn, causal, "enable_gqa" in params)


def _warn_unavailable() -> None:
    logger.warning(
        "torch %s has no torch.nn.attention.varlen.varlen_attn with causal attention: "
        "packed rows use SDPA with a dense document mask on GPUs (slower, B*T^2 bytes)",
        torch.__version__,
    )


@functools.lru_cache(maxsize=16)
def _runs_flash(device: torch.device) -> bool:
    """Whether the CUDA device runs flash attention (compute capability 8.0 and up); asked
    once per device (a host query, no sync)."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def varlen_kernel(device: torch.device) -> VarlenKernel | None:
    """The variable-length kernel packed rows on ``device`` run through: flash's on CUDA
    GPUs that run flash attention, where torch has ``varlen_attn``, unless the environment
    sets :data:`DISABLE` to ``0``; None elsewhere (the dense mask then). The same object
    for every call on one device (a compiled graph that reads it is not recompiled)."""
    if device.type != "cuda" or os.environ.get(DISABLE) == "0" or not _runs_flash(device):
        return None
    flash = _flash_varlen()
    return None if flash is None else _cuda_kernel(flash)


@functools.lru_cache(maxsize=1)
def _cuda_kernel(flash: _FlashVarlen) -> VarlenKernel:
    return VarlenKernel(flash)
