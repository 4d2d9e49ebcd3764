"""What torchtitan itself needs to run on CPU processes (gloo), nothing about plait.

torchtitan is written for accelerators. Each shim below makes torchtitan (not the
parallelism library under it) run on CPU, and is applied identically to the torch run and
the plait run, before any torchtitan module binds the patched names. README.md lists them
with their reasons; keep the two in sync.

1. ``cpu_device_module``: torchtitan picks ``"cuda"`` when no accelerator is found and
   calls ``device_module.memory_stats`` / ``get_device_properties`` / ... for its memory
   monitor. We set ``device_type = "cpu"`` (so the process group is gloo and tensors live
   on CPU) and give it ``torch.cpu`` plus the memory-monitor calls ``torch.cpu`` lacks
   (reporting no memory statistics).
2. ``dense_attention``: the debug Llama's attention is FlexAttention (a class-level
   ``torch.compile(flex_attention, ...)``), and torch's ``flex_attention`` refuses
   backward on CPU, compiled or eager ("FlexAttention does not support backward on
   CPU"). We put in its place the same attention written with dense tensor ops: the
   ``BlockMask``'s ``mask_mod`` materialized as a boolean mask, masked softmax, and the
   log-sum-exp when torchtitan asks for it; autograd gives its backward.
3. ``torch_fsdp_sum_reduction`` (reaches torch's own ``fully_shard`` only; inert on the
   plait run, where torchtitan never holds a torch ``FSDPModule``): torchtitan calls
   ``set_gradient_divide_factor(1.0)`` on every unit, and torch 2.13 then reduce-scatters
   with ``ReduceOp.PREMUL_SUM``, which gloo does not implement ("Cannot use
   ReduceOp.PREMUL_SUM with Gloo"). The shim makes that call also set torch's own
   ``set_force_sum_reduction_for_comms(True)``: plain SUM, then torch divides by the
   factor itself, the same arithmetic (the factor is 1.0).
4. ``set_timeout``: torchtitan 0.3.0 calls ``torch.distributed.set_timeout`` (newer
   torch); torch 2.13 has the same operation as ``distributed_c10d._set_pg_timeout``.
   A torch-version gap of torchtitan's own, not a CPU one.
5. ``torch_schedule_step_microbatches`` (reaches torch's own schedules only; inert on the
   plait run): torchtitan 0.3.0 calls ``schedule.step(arg_mbs=..., kwarg_mbs=...,
   target_mbs=..., losses=..., loss_kwargs=..., return_outputs=False)`` with
   microbatches it split itself, a form newer than torch 2.13, whose ``step`` takes the
   whole batch and so fails ("Expecting 4 arg_mbs but got 1"). The shim gives torch's
   ``step`` that form by doing what torch 2.13's own ``step`` does after splitting (reset
   the stages, then ``_step_microbatches``). A torch-version gap of torchtitan's own.
6. ``no_extra_cpu_backend``: with CPU offload torchtitan adds a ``cpu:gloo`` backend to
   the device's; on CPU the device's backend already is gloo and torch refuses the
   duplicate ("Duplicate device type cpu in backend string ... cpu:gloo,cpu:gloo").
   ``init_distributed`` is called with ``enable_cpu_backend=False``: the same gloo group.
"""

from __future__ import annotations

import os
import platform
import types
from typing import Any

import torch


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` with the memory-monitor calls torchtitan makes on its device module."""

    def __init__(self) -> None:
        super().__init__("cpu_device_module")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def set_device(device: Any) -> None:
        """Every process has the one CPU; nothing to select."""

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return platform.processor() or "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=total, name="cpu")

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}  # torchtitan reports -1 for statistics it does not find

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def dense_flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    score_mod: Any = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_aux: Any = None,
    kernel_options: Any = None,
) -> tuple[torch.Tensor, Any]:
    """``flex_attention(q, k, v, ...)`` on ``(B, N, L, H)`` tensors, as dense tensor ops."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None:
        raise NotImplementedError("dense_flex_attention: score_mod is not used by llama3")
    if enable_gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if block_mask is not None:
        batch, heads = block_mask.shape[0], block_mask.shape[1]
        mask = create_mask(
            block_mask.mask_mod, batch, heads, q.shape[-2], k.shape[-2], device=q.device
        )
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v
    want_lse = return_aux is not None and return_aux.lse
    return out, AuxOutput(lse=lse if want_lse else None)


_MICROBATCH_KEYS = ("arg_mbs", "kwarg_mbs", "target_mbs")


def _step_with_microbatches(original: Any) -> Any:
    """torch 2.13's schedule ``step`` plus the pre-split form newer torch accepts."""

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not any(key in kwargs for key in _MICROBATCH_KEYS):
            return original(self, *args, **kwargs)
        if args or kwargs.get("return_outputs", True):
            raise NotImplementedError("shim: pre-split step() with return_outputs=False only")
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() requires gradients to be enabled")
        stages = getattr(self, "_stages", None) or [self._stage]
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(
            kwargs.get("arg_mbs"),
            kwargs.get("kwarg_mbs"),
            kwargs.get("target_mbs"),
            kwargs.get("losses"),
            False,
            loss_kwargs=kwargs.get("loss_kwargs"),
        )
        return None

    return step


def set_timeout() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout


def cpu_device_module() -> None:
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = "cpu"
    titan_utils.device_module = _CpuDeviceModule()


def no_extra_cpu_backend() -> None:
    import torchtitan.distributed.utils as titan_dist

    init_distributed = titan_dist.init_distributed

    def init_without_extra_cpu_backend(*args: Any, **kwargs: Any) -> int:
        kwargs["enable_cpu_backend"] = False
        return init_distributed(*args, **kwargs)

    titan_dist.init_distributed = init_without_extra_cpu_backend


def dense_attention() -> None:
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = dense_flex_attention


def torch_fsdp_sum_reduction() -> None:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    set_factor = TorchFSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self: Any, factor: float) -> None:
        set_factor(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    TorchFSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def torch_schedule_step_microbatches() -> None:
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        cls.step = _step_with_microbatches(cls.step)


def install() -> None:
    """Apply every shim, in this order (the device module must be patched before any
    torchtitan module binds ``device_type``); call before importing torchtitan."""
    set_timeout()
    cpu_device_module()
    no_extra_cpu_backend()
    dense_attention()
    torch_fsdp_sum_reduction()
    torch_schedule_step_microbatches()
