"""Expert parallelism: stacked experts sharded over an ``ep`` mesh, tokens sent to them.

Two entry points, one mechanism (:func:`shard_experts`):

* ``ExpertParallel()``, a ``ParallelStyle``: torch's vocabulary, so one
  ``parallelize_module(model, mesh["ep"], {"layers.*.moe.experts": ExpertParallel()})``
  plan sits beside tensor-parallel styles, as torchtitan writes it. It sees only the
  experts module; the MoE then balances its load over the ep ranks, and
  ``set_load_balance_mesh(model, mesh)`` widens that to data-parallel ranks beside them.
* ``expert_parallel(model, mesh["ep"], load_balance_mesh=...)``: one call for a model
  built from ``plait.experts.MoE``: every ``GroupedExperts`` inside is sharded (errors
  name it by its path) and every MoE balances over the given ranks.

What sharding does to an experts module (any module whose parameters all stack experts on
dim 0 and whose forward is ``(rows sorted by expert, counts per expert) -> rows``, such as
``GroupedExperts``):

* each parameter becomes a ``Shard(0)`` DTensor on the 1-D ep mesh, so each rank holds
  ``E / ep`` whole experts and optimizers, ``clip_grad_norm_``, state dicts and DCP see
  DTensors. Names do not change.
* a forward pre-hook dispatches the rows to their experts' ranks and a forward hook
  combines the results back (``plait.experts.dispatch``); what one call plans is kept on
  the module's state only between those two hooks, so a style object applied to many
  modules, pipelined microbatches and checkpoint recomputes never share it.
* the ep ranks hold different tokens (they are data-parallel for everything but the
  experts), so an expert's gradient sums the losses of all ep ranks. Data parallelism
  averages the other gradients over the ranks; to match, each expert gradient is divided
  by ``gradient_divide_factor`` (default ``ep``), which makes it the mean over the ep
  ranks. Then averaging experts over the remaining data-parallel ranks (e.g.
  ``replicate(experts, mesh["dp"])``, or ``fully_shard`` with the experts on
  ``ShardPlacement(..., mesh["efsdp"])``, which averages each parameter group over its
  own mesh) and everything else over all of them gives the single-process gradient. The
  division happens in the autograd graph of the experts' forward (their output rows'
  gradient is divided, their input rows' multiplied back), not on the parameters, so it
  holds whatever parameter object ``fully_shard`` substitutes while unsharded. Training
  that sums gradients and divides the loss by the global token count (torchtitan's
  convention) passes ``gradient_divide_factor=1.0``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from plait.contract import APIState, contract
from plait.experts.dispatch import Exchange, combine, dispatch, plan_exchange
from plait.experts.moe import set_load_balance_mesh
from plait.experts.rows import scale_grad
from plait.experts.swiglu import GroupedExperts
from plait.hooks import outside_graphs
from plait.layout import EP

__all__ = ["ExpertParallel", "ExpertParallelState", "expert_parallel", "shard_experts"]


class ExpertParallelState(APIState):
    """What :func:`shard_experts` keeps on an experts module."""

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self.num_experts = 0
        self.gradient_divide_factor = 1.0
        # The exchange planned by the forward pre-hook, until the forward hook uses it.
        self.pending: Exchange | None = None


def _check(module: nn.Module, mesh: object, label: str) -> tuple[int, int]:
    """``(ep, num_experts)`` if ``module`` can be sharded over ``mesh``, else ``ValueError``."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"expert parallelism of {label}: mesh must be a DeviceMesh, got {mesh!r}")
    if mesh.ndim != 1:
        raise ValueError(
            f"expert parallelism of {label} needs a 1-D mesh (the ep ranks) but got a "
            f"{mesh.ndim}-D mesh with dims {mesh.mesh_dim_names}: pass one dimension, "
            f'e.g. mesh["{EP}"]'
        )
    params = list(module.named_parameters(recurse=False))
    if not params:
        raise ValueError(f"expert parallelism of {label}: the module has no expert weights")
    num_experts = int(getattr(module, "num_experts", params[0][1].shape[0]))
    for name, param in params:
        if isinstance(param, DTensor):
            raise ValueError(
                f"expert parallelism of {label}: parameter {name!r} is already a DTensor "
                f"(placements {param.placements}): apply expert parallelism before other "
                "parallelisms, and only once"
            )
        if param.dim() == 0 or param.shape[0] != num_experts:
            raise ValueError(
                f"expert parallelism of {label}: parameter {name!r} has shape "
                f"{tuple(param.shape)}; every parameter must stack the {num_experts} experts "
                "on dim 0"
            )
    ep = mesh.size()
    if num_experts % ep:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"expert parallelism of {label}: its {num_experts} experts do not split evenly "
            f"over ep={ep} ranks (each rank must hold the same number of whole experts). "
            f"Fix: an ep size that divides {num_experts} ({', '.join(map(str, divisors))}), "
            f"or a number of experts that is a multiple of {ep}"
        )
    return ep, num_experts


@contract(state_cls=ExpertParallelState)
def shard_experts(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    gradient_divide_factor: float | None = None,
    src_data_rank: int | None = 0,
    name: str | None = None,
) -> nn.Module:
    """Shard ``module``'s stacked experts over the 1-D ``mesh`` and route its rows there.

    See the module docstring. ``src_data_rank``: whose weights are scattered (as torch's
    styles: ``None`` keeps each rank's own slice, no communication). ``name``: how errors
    call the module (its path in the model). Raises ``ValueError`` (before changing
    anything) when the experts do not split over the mesh; applying it twice raises
    ``AssertionError``, as torch's composable APIs do.
    """
    label = f"{name!r} ({type(module).__name__})" if name else type(module).__name__
    ep, num_experts = _check(module, mesh, label)
    factor = float(ep) if gradient_divide_factor is None else float(gradient_divide_factor)
    for param_name, param in list(module.named_parameters(recurse=False)):
        local = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=src_data_rank)
        sharded = nn.Parameter(local, requires_grad=param.requires_grad)
        module.register_parameter(param_name, sharded)
    state: ExpertParallelState = shard_experts.state(module)
    state.group = mesh.get_group()
    state.num_experts = num_experts
    state.gradient_divide_factor = factor
    module.register_forward_pre_hook(outside_graphs(functools.partial(_dispatch_hook, state)))
    module.register_forward_hook(outside_graphs(functools.partial(_combine_hook, state)))
    return module


def _dispatch_hook(
    state: ExpertParallelState, module: nn.Module, args: tuple[Any, ...]
) -> tuple[Any, ...]:
    if len(args) < 2 or not all(isinstance(a, torch.Tensor) for a in args[:2]):
        raise TypeError(
            f"expert parallelism: {type(module).__name__} must be called with "
            "(rows sorted by expert, row counts per expert) as its first two positional "
            "arguments"
        )
    rows, counts = args[0], args[1]
    if counts.shape != (state.num_experts,):
        raise ValueError(
            f"expert parallelism: {type(module).__name__} got counts of shape "
            f"{tuple(counts.shape)}; expected one count per global expert "
            f"({state.num_experts},)"
        )
    assert state.group is not None
    exchange = plan_exchange(counts, state.group, rows.shape[0])
    state.pending = exchange
    local_rows, local_counts = dispatch(rows, exchange)
    # The expert weights' gradient is divided by the factor (their output rows' gradient
    # is), the input rows' gradient multiplied back: the rest of the model is unchanged.
    local_rows = scale_grad(local_rows, state.gradient_divide_factor)
    return (local_rows, local_counts, *args[2:])


def _combine_hook(
    state: ExpertParallelState, module: nn.Module, args: tuple[Any, ...], output: Any
) -> torch.Tensor:
    exchange, state.pending = state.pending, None
    if exchange is None:
        raise RuntimeError(
            f"expert parallelism: {type(module).__name__}'s forward finished without a "
            "dispatch (was its forward pre-hook removed?)"
        )
    return combine(scale_grad(output, 1.0 / state.gradient_divide_factor), exchange)


class ExpertParallel(ParallelStyle):
    """``ParallelStyle`` for an experts module: ``parallelize_module(model, mesh["ep"],
    {"moe.experts": ExpertParallel()})``. See :func:`shard_experts`.

    One instance may be applied to many modules (wildcard plans): it holds no per-call
    state. Unlike torch's styles it cannot name the module in errors (``parallelize_module``
    does not pass the path); :func:`expert_parallel` does.
    """

    def __init__(self, *, gradient_divide_factor: float | None = None) -> None:
        super().__init__()
        self.gradient_divide_factor = gradient_divide_factor

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sharded: nn.Module = shard_experts(
            module,
            device_mesh,
            gradient_divide_factor=self.gradient_divide_factor,
            src_data_rank=self.src_data_rank,
        )
        return sharded


def expert_parallel(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    load_balance_mesh: DeviceMesh | None = None,
    gradient_divide_factor: float | None = None,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Shard every ``GroupedExperts`` in ``module`` over the 1-D ep ``mesh`` and balance
    every ``MoE`` over ``load_balance_mesh`` (default: ``mesh``; pass the mesh of all ranks
    that hold different tokens, e.g. ``(dp, ep)``). Returns ``module``, changed in place.

    Every experts module is checked before any is changed: a model the call refuses is
    left as it was.
    """
    found = [(name, m) for name, m in module.named_modules() if isinstance(m, GroupedExperts)]
    if not found:
        raise ValueError(
            f"expert_parallel: {type(module).__name__} holds no plait.experts.GroupedExperts; "
            "for experts modules of your own, use parallelize_module with ExpertParallel()"
        )
    for name, experts in found:
        _check(experts, mesh, f"{name or '<root>'!r} ({type(experts).__name__})")
    for name, experts in found:
        shard_experts(
            experts,
            mesh,
            gradient_divide_factor=gradient_divide_factor,
            src_data_rank=src_data_rank,
            name=name or "<root>",
        )
    set_load_balance_mesh(module, load_balance_mesh if load_balance_mesh is not None else mesh)
    return module
