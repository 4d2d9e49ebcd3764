"""A model built on the meta device, after the recipe has cut it, given storage and values
on the run's device, piece by piece: no rank ever holds the whole model.

``plait train`` builds its model under ``torch.device("meta")`` (shapes only: no memory,
no random draws), lets :func:`~plait.train.parallelize.parallelize` split and shard it
(``fully_shard``, tensor and expert parallelism all lay out meta parameters as they would
real ones), and then :func:`materialize` finishes this rank's stages:

1. ``to_empty(device=...)``: every parameter and buffer gets uninitialised storage on the
   device, of this rank's piece only (``fully_shard``'s modules re-point their shards;
   with ``--cpu-offload`` the parameters go straight to host memory, where its shards
   live, and only the buffers to the device).
   A parameter held by two modules (a head tied to the embedding) is one again afterwards:
   ``to_empty`` makes a new parameter per module for a plain tensor leaving the meta
   device (DTensors are swapped in place and stay shared);
2. every buffer is recomputed by the module that owns it (``reset_buffers()``: the rotary
   frequencies, the experts' load counts and balancing biases); a module with buffers but
   no such method is refused, naming the buffer;
3. unless a checkpoint is about to fill them (``--init-from``, ``--resume``), every
   parameter is set to its initial value (:func:`plait.train.param_init.init_parameters`:
   drawn whole by its whole-model name on the device, one parameter at a time, of which
   this rank keeps its piece). A pipeline stage's copy of a tied matrix (the head on the
   last stage) takes the embedding's name, so both copies start equal.

The memory a rank needs beyond its shards is one parameter's full value (the largest: the
embedding, or a block's stacked experts). A model whose parameters already have storage
(a test's, or the planner's dry run on fake tensors) is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from typing import TypeVar

import torch
from torch import nn

from plait.train.checkpointing import saved_names
from plait.train.config import ExecutionConfig
from plait.train.parallelize import Stage
from plait.train.param_init import init_parameters

__all__ = ["empty_model", "is_meta", "materialize", "reset_buffers"]

_Module = TypeVar("_Module", bound=nn.Module)


def is_meta(modules: Sequence[nn.Module]) -> bool:
    """Whether any parameter or buffer of ``modules`` is still on the meta device."""
    tensors = chain.from_iterable(chain(m.parameters(), m.buffers()) for m in modules)
    return any(t.device.type == "meta" for t in tensors)


def _shared(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Where each parameter of ``module`` held by several modules is: (owner, name) each."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((owner, name))
    return [where for where in places.values() if len(where) > 1]


def reset_buffers(module: nn.Module) -> None:
    """Recompute every buffer of ``module`` and its submodules, each by its owner's
    ``reset_buffers()``. RuntimeError naming the buffer when its owner has none."""
    for prefix, owner in module.named_modules():
        own = [name for name, _ in owner.named_buffers(recurse=False)]
        if not own:
            continue
        reset = getattr(owner, "reset_buffers", None)
        if reset is None:
            where = f"{prefix}.{own[0]}".lstrip(".")
            raise RuntimeError(
                f"buffer {where!r} of {type(owner).__name__} cannot be recomputed after the "
                "model is given storage on its device (built on the meta device): "
                f"{type(owner).__name__} has no reset_buffers() method; give it one that "
                "computes its buffers where they are"
            )
        reset()


def _buffers_to(module: nn.Module, device: torch.device | str) -> None:
    for owner in module.modules():
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                owner._buffers[name] = buffer.to(device)


def _allocate(module: nn.Module, device: torch.device | str, buffers: torch.device | str) -> None:
    """Steps 1 and 2 of the module docstring: storage for ``module``'s parameters on
    ``device`` (ties kept) and its buffers, recomputed, on ``buffers``."""
    shared = _shared(module)
    module.to_empty(device=device)
    for (first, name), *others in shared:  # the first holder's parameter everywhere
        for owner, other in others:
            owner._parameters[other] = first._parameters[name]
    _buffers_to(module, buffers)
    reset_buffers(module)


def empty_model(build: Callable[[], _Module], device: torch.device | str = "cpu") -> _Module:
    """``build()``'s model, built on the meta device and given storage on ``device``: its
    buffers computed, its parameters uninitialised, for a checkpoint to fill (``plait
    sample``, ``plait export``: no random draws for values about to be overwritten)."""
    with torch.device("meta"):
        model = build()
    _allocate(model, device, device)
    return model


def materialize(stages: Sequence[Stage], execution: ExecutionConfig, seed: int | None) -> None:
    """This rank's ``stages`` (parallelized, built on the meta device) given storage on
    the run's device (``execution.device``; with ``--cpu-offload`` the parameters' shards
    in host memory, where ``fully_shard`` keeps them, and the buffers on the device), their
    buffers recomputed and, with ``seed``, their parameters set to their initial values
    (module docstring); with ``seed`` None the parameters are left uninitialised, for a
    checkpoint to fill. Does nothing to stages with no meta tensor."""
    modules = [stage.module for stage in stages]
    if not is_meta(modules):
        return
    device = execution.device
    for module in modules:
        # Offloaded shards straight to host memory: never all on the device at once.
        _allocate(module, "cpu" if execution.cpu_offload else device, device)
    if seed is None:
        return
    for module in modules:
        rule = module.param_init
        init_parameters(module, rule, seed, names=saved_names(module), device=device)
