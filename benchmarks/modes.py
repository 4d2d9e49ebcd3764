"""The benchmark modes: one entry per way of training the GPT model.

Each mode builds the model from the same seed, the same per-rank data and the same AdamW
step; only the parallel wrapping differs. plait modes name their torch counterpart, and
the report gives their ratio to it. Later capabilities add their modes and suites here.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from benchmarks.harness import BenchConfig, Mode, Step
from benchmarks.int8_weight import int8_gather_linears
from benchmarks.moe_modes import MOE_GROUPED_SUITE, MOE_MODES, MOE_SUITE
from benchmarks.pipeline_modes import PIPELINE_MODES, PIPELINE_SUITE
from benchmarks.tp_modes import TP_MODES, TP_SUITE
from plait.checkpoint import checkpoint
from plait.fsdp import MixedPrecisionPolicy, fully_shard
from plait.replicate import replicate
from plait.train.model import GPT, lm_loss


def _batch(cfg: BenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed local batch of random byte sequences (inputs, next-token targets)."""
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    tokens = torch.randint(0, cfg.gpt.vocab_size, (cfg.batch, cfg.gpt.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _model(cfg: BenchConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg.gpt)


def training_step(model: nn.Module, cfg: BenchConfig) -> Step:
    """Forward, loss, backward and an AdamW step on this rank's local batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = _batch(cfg)

    def step() -> None:
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _single(cfg: BenchConfig) -> Step:
    return training_step(_model(cfg), cfg)


def _replicate(cfg: BenchConfig) -> Step:
    return training_step(replicate(_model(cfg)), cfg)


def _replicate_blocks(cfg: BenchConfig, which: str) -> Step:
    """``replicate`` per block, then the root (torch's FSDP-based replicate is applied so)."""
    if which == "torch":
        from torch.distributed._composable.replicate_with_fsdp import replicate as apply
    else:
        apply = replicate
    model = _model(cfg)
    for block in model.blocks:
        apply(block)
    apply(model)
    return training_step(model, cfg)


def _torch_ddp(cfg: BenchConfig) -> Step:
    from torch.nn.parallel import DistributedDataParallel

    return training_step(DistributedDataParallel(_model(cfg)), cfg)


# --- activation checkpointing (one process; "single" is the model without checkpointing) ---

_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
}


def _checkpoint_api(which: str) -> Callable[[nn.Module], object]:
    if which == "torch":
        from torch.distributed._composable import checkpoint as torch_checkpoint

        return torch_checkpoint
    return partial(checkpoint, policy=_MATMULS) if which == "selective" else checkpoint


def _checkpointed(cfg: BenchConfig, which: str) -> Step:
    """Every block checkpointed by ``which``: "plait", "selective" (plait) or "torch"."""
    model = _model(cfg)
    apply = _checkpoint_api(which)
    for block in model.blocks:
        apply(block)
    return training_step(model, cfg)


# --- fully_shard ----------------------------------------------------------------------------


def _shard_api(which: str) -> Callable[..., object]:
    if which == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard
    return fully_shard


def _policy(which: str, param_dtype: torch.dtype | None) -> dict[str, Any]:
    """``mp_policy=`` for ``which``: bf16 parameters with fp32 gradient reduction."""
    if param_dtype is None:
        return {}
    if which == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

        return {"mp_policy": TorchPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)}
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)}


def _shard_blocks(
    model: nn.Module,
    which: str,
    reshard: bool,
    mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """One unit per block plus the root, by ``which`` ("plait" or "torch")."""
    shard = _shard_api(which)
    kwargs = {"reshard_after_forward": reshard, "mesh": mesh, **_policy(which, param_dtype)}
    for block in model.blocks:
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model


def _sharded(
    cfg: BenchConfig,
    which: str,
    reshard: bool,
    hsdp: bool = False,
    param_dtype: torch.dtype | None = None,
) -> Step:
    """``hsdp``: a (2, world / 2) mesh, replicated over pairs of shard groups."""
    world = dist.get_world_size()
    names = ("dp_replicate", "dp_shard")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names) if hsdp else None
    return training_step(_shard_blocks(_model(cfg), which, reshard, mesh, param_dtype), cfg)


def _int8_sharded(cfg: BenchConfig) -> Step:
    """``fully_shard`` per block with every block's linear weights all-gathered as int8 and a
    per-row scale (``benchmarks.int8_weight``, the README's all-gather extension)."""
    model = _model(cfg)
    for block in model.blocks:
        int8_gather_linears(block)
    return training_step(_shard_blocks(model, "plait", reshard=True), cfg)


def _compile_blocks(model: GPT) -> GPT:
    """torchtitan's recipe: each block replaced by ``torch.compile(block, fullgraph=True)``
    (inductor), before any sharding; the API is then applied to the compiled wrappers."""
    for name, block in list(model.blocks.named_children()):
        compiled = torch.compile(block, fullgraph=True)  # an OptimizedModule
        model.blocks.register_module(name, compiled)  # type: ignore[arg-type]
    return model


def _compiled_sharded(cfg: BenchConfig, which: str) -> Step:
    """Compiled blocks, then one unit per block plus the root, by ``which``."""
    return training_step(_shard_blocks(_compile_blocks(_model(cfg)), which, True), cfg)


class TinyLayers(nn.Module):
    """64 tiny linear layers: compute is negligible, so a step measures per-unit overhead."""

    def __init__(self, n: int = 64, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _tiny(cfg: BenchConfig, which: str) -> Step:
    """Forward and backward only: the optimizer step (identical for both, and dominated by
    DTensor dispatch in AdamW) would hide the per-unit overhead this model measures."""
    torch.manual_seed(0)
    model = _shard_blocks(TinyLayers(), which, True)
    x = torch.randn(8, 16)

    def step() -> None:
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)

    return step


MODES: dict[str, Mode] = {
    m.name: m
    for m in [
        Mode("single", _single, single_process=True),
        Mode("replicate", _replicate, torch_counterpart="torch_ddp"),
        Mode("torch_ddp", _torch_ddp),
        Mode(
            "replicate_blocks",
            partial(_replicate_blocks, which="plait"),
            torch_counterpart="torch_replicate_fsdp",
        ),
        Mode("torch_replicate_fsdp", partial(_replicate_blocks, which="torch")),
        Mode("ac_plait", partial(_checkpointed, which="plait"), torch_counterpart="ac_torch"),
        Mode(
            "ac_plait_selective",
            partial(_checkpointed, which="selective"),
            torch_counterpart="ac_torch",
        ),
        Mode("ac_torch", partial(_checkpointed, which="torch")),
        Mode(
            "fully_shard",
            partial(_sharded, which="plait", reshard=True),
            torch_counterpart="torch_fully_shard",
        ),
        Mode(
            "fully_shard_keep",
            partial(_sharded, which="plait", reshard=False),
            torch_counterpart="torch_fully_shard_keep",
        ),
        Mode("torch_fully_shard", partial(_sharded, which="torch", reshard=True)),
        Mode("int8_allgather_fully_shard", _int8_sharded, torch_counterpart="torch_fully_shard"),
        Mode("torch_fully_shard_keep", partial(_sharded, which="torch", reshard=False)),
        Mode(
            "fully_shard_bf16",
            partial(_sharded, which="plait", reshard=True, param_dtype=torch.bfloat16),
            torch_counterpart="torch_fully_shard_bf16",
        ),
        Mode(
            "torch_fully_shard_bf16",
            partial(_sharded, which="torch", reshard=True, param_dtype=torch.bfloat16),
        ),
        Mode(
            "hsdp",
            partial(_sharded, which="plait", reshard=True, hsdp=True),
            torch_counterpart="torch_hsdp",
        ),
        Mode("torch_hsdp", partial(_sharded, which="torch", reshard=True, hsdp=True)),
        Mode(
            "tiny64_fully_shard",
            partial(_tiny, which="plait"),
            torch_counterpart="tiny64_torch_fully_shard",
        ),
        Mode("tiny64_torch_fully_shard", partial(_tiny, which="torch")),
        Mode(
            "compiled_fully_shard",
            partial(_compiled_sharded, which="plait"),
            torch_counterpart="torch_compiled_fully_shard",
            measure_memory=False,
        ),
        Mode(
            "torch_compiled_fully_shard",
            partial(_compiled_sharded, which="torch"),
            measure_memory=False,
        ),
    ]
}

MODES.update(PIPELINE_MODES)
MODES.update(TP_MODES)
MODES.update(MOE_MODES)

SUITES: dict[str, list[str]] = {
    "replicate": ["single", "replicate", "torch_ddp", "replicate_blocks", "torch_replicate_fsdp"],
    # run with --nproc 1 --layers 8: checkpointing is a single-process feature
    "checkpoint": ["single", "ac_plait", "ac_torch", "ac_plait_selective"],
    # "_keep" modes: reshard_after_forward=False; tiny64: per-unit CPU overhead
    "fully_shard": [
        "single",
        "fully_shard",
        "torch_fully_shard",
        "fully_shard_keep",
        "torch_fully_shard_keep",
        "tiny64_fully_shard",
        "tiny64_torch_fully_shard",
    ],
    "fsdp_features": [
        "fully_shard",
        "fully_shard_bf16",
        "torch_fully_shard_bf16",
        "hsdp",  # needs --nproc 4 (a 2 x 2 mesh)
        "torch_hsdp",
    ],
    # the README's all-gather extension: linear weights gathered as int8 + per-row scale
    "int8_allgather": ["fully_shard", "int8_allgather_fully_shard", "torch_fully_shard"],
    # torchtitan's per-block torch.compile (inductor), then fully_shard; eager beside it
    "compile": [
        "fully_shard",
        "torch_fully_shard",
        "compiled_fully_shard",
        "torch_compiled_fully_shard",
    ],
    # --nproc 2: GPipe, 1F1B and Interleaved1F1B (2 stages per rank) beside torch's
    "pipeline": PIPELINE_SUITE,
    # --nproc 4: fully_shard over TP on a (dp_shard 2, tp 2) mesh beside torch's, with and
    # without sequence parallelism; --nproc 2: dp 1 x tp 2 (FSDP's overhead over TP)
    "tp": TP_SUITE,
    # GPT with MoE blocks: expert parallel 2 x fully_shard (experts on efsdp, the rest on
    # dp_shard) beside torch's fully_shard, and the ep 1 reference; --nproc 2 (efsdp 1) or
    # --nproc 4 (efsdp 2). The table adds the all-to-all bytes and their formula.
    "moe": MOE_SUITE,
    # the same MoE model, plait's routed experts as grouped GEMMs (the default) beside the
    # loop of one matmul per expert ("_loop"), with and without expert parallelism
    "moe_grouped": MOE_GROUPED_SUITE,
}
