"""The seam that makes ordinary attention code context-parallel: a ``TorchFunctionMode``
that routes every ``torch.nn.functional.scaled_dot_product_attention`` call made while it
is active to :func:`~plait.context.attention.context_parallel_attention` on the local
shards, and lets every other torch function through untouched.

Only what the exact methods can honour is accepted: no mask, ``is_causal``, and the
document ids of :func:`~plait.context.options.packed_documents`. An arbitrary
``attn_mask`` (its columns would be local, not global, positions) and dropout are
refused with the fix, never run silently wrong.

Autograd does not carry torch function modes into backward, so an activation-checkpointed
block that recomputes its forward there would run plain attention on the shards.
:class:`ModeScope` closes that gap: forward hooks that put the mode back on the stack for
any hooked module call that runs without it (the recompute calls the block again).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from plait.context.attention import Method, context_parallel_attention
from plait.context.options import current_documents

__all__ = ["ContextParallelMode", "ModeScope", "UnsupportedAttention"]


class UnsupportedAttention(ValueError):
    """An SDPA call inside context parallelism that it cannot run exactly."""


@dataclass(frozen=True)
class _Settings:
    group: dist.ProcessGroup
    method: Method
    load_balance: bool


def _sdpa_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, float | None, bool]:
    """SDPA's signature: checks the call and returns what context parallelism uses."""
    if attn_mask is not None:
        raise UnsupportedAttention(
            "scaled_dot_product_attention was called with an attn_mask inside context "
            "parallelism, which cannot apply an arbitrary mask to a sequence split over "
            "ranks. Pass is_causal=True for causal attention, and plait.context."
            "packed_documents(document_ids) (or context_parallel(..., document_ids=...)) "
            "for packed sequences, instead of the mask"
        )
    if dropout_p:
        raise UnsupportedAttention(
            f"scaled_dot_product_attention was called with dropout_p={dropout_p} inside "
            "context parallelism, which does not support attention dropout: pass "
            "dropout_p=0.0"
        )
    return query, key, value, is_causal, scale, enable_gqa


class ContextParallelMode(TorchFunctionMode):
    """While active, SDPA calls run context-parallel (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup, method: Method, load_balance: bool) -> None:
        super().__init__()
        self.settings = _Settings(group, method, load_balance)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, is_causal, scale, enable_gqa = _sdpa_arguments(*args, **kwargs)
        s = self.settings
        return context_parallel_attention(
            q,
            k,
            v,
            s.group,
            method=s.method,
            load_balance=s.load_balance,
            is_causal=is_causal,
            document_ids=current_documents(),
            scale=scale,
            enable_gqa=enable_gqa,
        )


class ModeScope:
    """Forward pre-hook / hook pair that keeps ``mode`` active for the length of each
    hooked module call, entering it only when it is not already on this thread's stack
    (so nested calls, and calls inside a ``with mode``, add nothing)."""

    def __init__(self, mode: ContextParallelMode) -> None:
        self.mode = mode
        self._local = threading.local()  # modes are per thread, so is what entered them

    def _entered(self) -> list[bool]:
        calls: list[bool] | None = getattr(self._local, "calls", None)
        if calls is None:
            calls = self._local.calls = []
        return calls

    def before(self, module: nn.Module, args: Any) -> None:
        active = any(m is self.mode for m in _get_current_function_mode_stack())
        if not active:
            self.mode.__enter__()
        self._entered().append(not active)

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._entered().pop():
            self.mode.__exit__(None, None, None)
