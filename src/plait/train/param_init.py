"""Initial values of ``plait train``'s models: one rule, and each parameter drawn whole, by
its name, then copied into whatever piece of it a rank holds.

**The rule** (:func:`decoder_init`, GPT-2's, for both families): matrices (linears,
embeddings, the stacked experts, routers) normal with standard deviation 0.02, those that
add into the residual stream (:data:`RESIDUAL`: attention's output projection, the MLP's
down projection, the experts' ``w2``) scaled down by ``1 / sqrt(2 * n_layer)``; biases
zero; normalisation gains one. It goes by the kind of module that owns a parameter, so a
module kind it does not know (a new layer type) is refused with the parameter's name
rather than left uninitialised.

**The draw** (:func:`initial_value`): a parameter's value is a function of the seed and
its *whole-model* name only: a normal draw from its own generator, seeded by a stable hash
of ``(seed, name)`` (blake2b; Python's ``hash`` is salted per process). So its value does
not depend on which rank holds it, on how it is cut (tensor, data, context or expert
parallelism, a pipeline split), on the order parameters are visited, or on what was drawn
before: every layout of a run starts from the single-process run's values, and a model
built on one CPU with ``torch.manual_seed(seed)`` holds ``plait train --seed seed``'s
initial weights. Each value is drawn on the run's device in float32 (then cast to the
parameter's dtype): CPU runs use the CPU generator and CUDA runs the CUDA one, so a CPU
and a GPU run start from different (equally distributed) values, but every layout on one
kind of device agrees (CUDA's draws also depend on the GPU model: a run's GPUs are taken to
be alike, as its replicas are no longer broadcast from rank 0 at start).

:func:`init_parameters` visits a module's parameters one at a time: the full value of at
most one parameter is alive at once, and each rank keeps only its piece
(:func:`copy_into`, which :mod:`plait.train.hf_load` uses too).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait.experts import GroupedExperts
from plait.fsdp.state_dict import shard_full_tensor
from plait.train.llama.rms_norm import RMSNorm

__all__ = [
    "RESIDUAL",
    "STD",
    "Init",
    "InitRule",
    "copy_into",
    "decoder_init",
    "init_parameters",
    "initial_value",
    "param_seed",
]

#: The standard deviation of every matrix (GPT-2's).
STD = 0.02
#: Whole-model names (suffixes) of the matrices whose outputs add into the residual stream.
RESIDUAL = (
    "attn.proj.weight",  # attention's output projection (both families)
    "mlp.proj.weight",  # the GPT MLP's down projection
    "mlp.down.weight",  # the Llama SwiGLU's
    "experts.w2",  # the stacked experts' down projections
    "shared_experts.w2.weight",  # a MoE's shared experts'
)
#: Modules whose weight is a gain (one) and bias an offset (zero).
NORMS = (nn.LayerNorm, RMSNorm)


@dataclass(frozen=True)
class Init:
    """How one parameter starts: a normal draw of standard deviation ``std`` (mean 0), or,
    with ``std`` 0, the constant ``fill``."""

    std: float = 0.0
    fill: float = 0.0


#: A model's rule: (whole-model name, the module owning the parameter) -> how it starts.
InitRule = Callable[[str, nn.Module], Init]


def decoder_init(name: str, owner: nn.Module, n_layer: int) -> Init:
    """The rule (module docstring) for parameter ``name`` (whole-model name) of ``owner``,
    in a decoder of ``n_layer`` blocks. RuntimeError for a module kind it has no rule for."""
    leaf = name.rpartition(".")[2]
    if isinstance(owner, NORMS):
        return Init(fill=1.0 if leaf == "weight" else 0.0)
    if isinstance(owner, nn.Linear | nn.Embedding):  # torchao's Float8Linear is a Linear
        if leaf == "bias":
            return Init()
    elif not isinstance(owner, GroupedExperts):
        raise RuntimeError(
            f"no initial value for parameter {name!r}: its module is a "
            f"{type(owner).__name__}, which plait.train.param_init.decoder_init has no rule "
            "for (it knows linears, embeddings, LayerNorm, RMSNorm and stacked experts); add "
            "one there"
        )
    residual = name.endswith(RESIDUAL)
    return Init(std=STD / math.sqrt(2 * n_layer) if residual else STD)


def param_seed(seed: int, name: str) -> int:
    """The seed of parameter ``name``'s generator in a run seeded ``seed``: a stable hash
    (the same in every process and Python version), 64 bits."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def initial_value(
    init: Init, name: str, shape: tuple[int, ...], seed: int, device: torch.device | str
) -> torch.Tensor:
    """The full float32 value of parameter ``name`` (whole-model name) of ``shape``, drawn
    on ``device`` (module docstring)."""
    if init.std == 0.0:
        return torch.full(shape, init.fill, dtype=torch.float32, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(param_seed(seed, name))
    value = torch.empty(shape, dtype=torch.float32, device=device)
    return value.normal_(0.0, init.std, generator=generator)


@torch.no_grad()
def copy_into(param: torch.Tensor, full: torch.Tensor, name: str) -> None:
    """``full`` (the global value) into ``param``: this rank's piece of a DTensor (no
    communication: :func:`~plait.fsdp.state_dict.shard_full_tensor`), else all of it; cast
    to the parameter's dtype and moved to its device. RuntimeError, naming ``name``, for a
    layout whose piece does not match the rank's shard."""
    if isinstance(param, DTensor):
        local = param.to_local()
        piece = shard_full_tensor(full, param).to_local()
        if local.shape != piece.shape:  # a layout this function does not know
            raise RuntimeError(
                f"{name}: this rank's shard is {tuple(local.shape)} but its piece of the "
                f"full tensor is {tuple(piece.shape)} (placements {param.placements})"
            )
        local.copy_(piece)
    else:
        param.copy_(full)


def _device_of(param: torch.Tensor) -> torch.device:
    return param.to_local().device if isinstance(param, DTensor) else param.device


def init_parameters(
    module: nn.Module,
    rule: InitRule,
    seed: int,
    *,
    names: Mapping[str, str] | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Set every parameter of ``module`` (plain, or a rank's DTensor piece) to its initial
    value under ``rule`` and ``seed``, one parameter at a time: at most one full value is
    alive at once. ``names``: a parameter's whole-model name where it differs from its name
    in ``module`` (a pipeline stage's copy of a tied matrix; default: the same).
    ``device``: where values are drawn (default: each parameter's own; a run passes its
    device, so that offloaded parameters get the same values). Parameters on the meta
    device are skipped: they get values once they have storage."""
    names = names or {}
    for name, param in module.named_parameters():
        if param.device.type == "meta":
            continue
        key = names.get(name, name)
        owner = module.get_submodule(name.rpartition(".")[0])
        full = initial_value(
            rule(key, owner), key, tuple(param.shape), seed, device or _device_of(param)
        )
        copy_into(param, full, name)
        del full  # before the next draw: one full value at a time
