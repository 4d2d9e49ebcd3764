"""Float8 training (``plait train --float8``): the blocks' linears run their matmuls in float8.

torchao's recipe, as torchtitan applies it: every ``nn.Linear`` inside a transformer block
becomes torchao's ``Float8Linear`` (tensorwise dynamic scaling: input, weight and output
gradient are each cast to float8 with one scale per tensor before each matmul), except

* the output head (it is no block's: the logits' precision decides the loss), and the
  routers of mixture-of-experts blocks (a rounding there changes which experts a token
  goes to; torchtitan leaves them out too);
* a linear whose input or output width is not a multiple of 16, or under tensor
  parallelism of ``16 x tp`` (a rank multiplies its share of one of them): float8 GEMMs
  need both dims aligned to 16 (torchtitan skips those as well, and so do we). The third
  dim, a matmul's inner one, is the microbatch's token count in the weight gradient's:
  on the GPU it is padded with zeros where it is not aligned (``pad_inner_dim``).

On CUDA the matmuls are torch's float8 kernels, which need compute capability 8.9 or
newer (Ada, Hopper and later); elsewhere torchao *emulates* them (``emulate=True``):
operands are rounded to float8 as on the GPU and multiplied in float32. A CPU run has the
recipe's numerics (up to the GPU kernels' accumulation order), not its speed.

Under ``fully_shard`` (``dp_shard x cp > 1``) the weights are also *all-gathered* in
float8 (``enable_fsdp_float8_all_gather``): each linear's weight becomes torchao's
``WeightWithDynamicFloat8CastTensor``, whose ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` hooks plait's ``fully_shard`` honours (its all-gather extensions,
:mod:`plait.fsdp.extensions`): a quarter of the fp32 bytes on the wire. A weight's scale
must be the whole weight's, not one shard's: :func:`after_step` computes every weight's
scale after each optimizer step, in one all-reduce per stage (torchao's
``precompute_float8_dynamic_scale_for_fsdp``); otherwise each pre-all-gather hook issues
an all-reduce of its own (as it does before the first step). Checkpoints hold the plain
weights (:func:`_plain_weight`), loadable without torchao.

Tensor parallelism runs with torch's plain styles around the float8 linears: a cast of a
sharded activation takes the scale of the whole tensor (DTensor reduces the max), so the
matmuls round as in one process, but the tensor-parallel collectives move high-precision
activations (torchao's float8 tensor-parallel styles are not used).

Where in the recipe (:mod:`plait.train.parallelize`): right after the pipeline split, so
each rank converts only the blocks of its own stages, and before everything else. Before
tensor parallelism: torchao swaps a whole ``nn.Linear`` for a new module, which would
drop the forward hooks that ``parallelize_module`` puts on it, and its weight wrapper must
be the DTensor's *local* tensor (torchtitan converts first too). Before checkpointing and
``fully_shard``: ``fully_shard`` must find the float8 weight wrapper when it shards (else
its shards are plain tensors, gathered in full precision), and manages the parameters of
the modules it saw, not of modules swapped in later.

Refused before any worker starts (:func:`check`): a CUDA device older than compute
capability 8.9, a model whose width is not a multiple of ``16 x tp`` (no linear would
convert),
and a missing torchao (``pip install 'plait[float8]'``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait.train.config import ConfigError, ExecutionConfig, TrainConfig
from plait.train.extras import missing, require

__all__ = ["ALIGN", "after_step", "check", "convert", "emulates", "gathers_float8"]

#: float8 GEMMs need both dims of a weight to be multiples of this.
ALIGN = 16
#: The oldest CUDA compute capability with float8 matmuls (Ada Lovelace, sm_89).
MIN_CAPABILITY = (8, 9)
_FLAG = "--float8"
_EXTRA = "float8"
#: Submodules of a block whose linears stay in high precision (a MoE's router).
_KEPT = frozenset({"router"})


def _torchao() -> Any:
    """``torchao.float8``, imported on first use (an optional package)."""
    return require("torchao.float8", _FLAG, extra=_EXTRA, fix=f"or drop {_FLAG}")


def emulates(device: str) -> bool:
    """Whether float8 matmuls are emulated on ``device`` (everywhere but CUDA)."""
    return not device.startswith("cuda")


def gathers_float8(cfg: ExecutionConfig | TrainConfig) -> bool:
    """Whether ``--float8`` is on and ``fully_shard`` shards the blocks (``dp_shard x cp >
    1``), so their float8 weights are all-gathered in float8."""
    return cfg.float8 and cfg.layout.dp_shard * cfg.layout.cp > 1


def check(cfg: ExecutionConfig | TrainConfig, d_model: int) -> None:
    """Refuse ``--float8`` combinations that cannot run (module docstring), naming the fix:
    ConfigError. ``d_model``: the model's width (every block linear has it as one dim)."""
    if not cfg.float8:
        return
    if importlib.util.find_spec("torchao") is None:
        raise missing(_FLAG, "torchao", _EXTRA, fix=f"or drop {_FLAG}")
    tp = cfg.layout.tp
    if d_model % (ALIGN * tp):
        each = f" over --tp {tp}" if tp > 1 else ""
        raise ConfigError(
            f"{_FLAG}: the model width {d_model}{each} is not a multiple of {ALIGN * tp}, so "
            f"no linear can run in float8 (float8 matmuls need both dims of each rank's "
            f"share aligned to {ALIGN}); use a --d-model multiple of {ALIGN * tp}, or drop "
            f"{_FLAG}"
        )
    if cfg.device.startswith("cuda") and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CAPABILITY:
            have = ".".join(map(str, capability))
            need = ".".join(map(str, MIN_CAPABILITY))
            raise ConfigError(
                f"{_FLAG}: this GPU has compute capability {have}, but float8 matmuls need "
                f"{need} or newer (Ada, Hopper, Blackwell); drop {_FLAG} on this GPU"
            )


def _eligible(module: nn.Module, fqn: str, tp: int = 1) -> bool:
    """torchao's filter: a linear to convert (aligned dims, not inside a kept submodule).
    Under tensor parallelism a rank multiplies its ``1 / tp`` of one dim: both dims over
    ``tp`` must stay aligned (``torch._scaled_mm`` refuses others on the GPU)."""
    if not isinstance(module, nn.Linear):
        return True  # torchao asks about every module it walks past; only linears swap
    if _KEPT.intersection(fqn.split(".")):
        return False
    return all(n % (ALIGN * tp) == 0 for n in (module.in_features, module.out_features))


def convert(blocks: Iterable[nn.Module], cfg: ExecutionConfig | TrainConfig) -> int:
    """Swap the eligible linears of ``blocks`` (module docstring) for torchao's
    ``Float8Linear``, in place; returns how many were swapped. Nothing without ``--float8``.
    Parameters keep their names and values (the weight object is reused, or wrapped in
    the float8 all-gather subclass under ``fully_shard``)."""
    if not cfg.float8:
        return 0
    float8 = _torchao()
    emulate = emulates(cfg.device)
    config = float8.Float8LinearConfig(
        emulate=emulate,
        enable_fsdp_float8_all_gather=gathers_float8(cfg),
        # The weight gradient's inner dim is the microbatch's token count, which need not
        # be aligned: padded with zeros where torch._scaled_mm needs it (not emulated).
        pad_inner_dim=not emulate,
    )
    tp = cfg.layout.tp
    swapped = 0
    for block in blocks:
        plain = sum(type(m) is nn.Linear for m in block.modules())
        float8.convert_to_float8_training(
            block, config=config, module_filter_fn=lambda m, fqn: _eligible(m, fqn, tp)
        )
        swapped += plain - sum(type(m) is nn.Linear for m in block.modules())
        if config.enable_fsdp_float8_all_gather:
            for module in block.modules():
                if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
                    module.register_state_dict_post_hook(_plain_weight)  # a Float8Linear
    return swapped


def _plain(value: torch.Tensor) -> torch.Tensor:
    """``value`` without the float8 all-gather wrapper: its high-precision tensor (a view
    of the same storage), as a DTensor again if ``value`` was one."""
    if isinstance(value, DTensor):
        local = _plain(value._local_tensor)
        if local is value._local_tensor:
            return value
        return DTensor.from_local(
            local,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    inner = getattr(value, "_tensor", None)
    if isinstance(inner, torch.Tensor) and hasattr(value, "fsdp_pre_all_gather"):
        return inner.detach()
    return value


def _plain_weight(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    """State-dict hook of a float8 linear whose weight is torchao's all-gather wrapper:
    the state holds the plain tensor it wraps. Checkpoints then load without torchao
    (``plait sample``, ``plait export``, a run without ``--float8``), and loading into
    the wrapper writes through to that tensor."""
    key = prefix + "weight"
    if key in state:
        state[key] = _plain(state[key])


def after_step(modules: Iterable[nn.Module], cfg: ExecutionConfig | TrainConfig) -> None:
    """After each optimizer step, with float8 all-gather on: every float8 weight's scale
    from its updated values, for the next forward's pre-all-gather casts (one all-reduce
    of the weights' max magnitudes per module). Nothing otherwise."""
    if not gathers_float8(cfg):
        return
    precompute = _torchao().precompute_float8_dynamic_scale_for_fsdp
    for module in modules:
        precompute(module)
