"""Tensor-parallel modes: TP alone, and fully_shard over TP (FSDP x TP), plait beside torch.

Every mode trains plait's GPT (``plait.train.model``) under ``plait train``'s TP plan
(``plait.train.parallelize.tensor_parallel_plan``: torch's own
``torch.distributed.tensor.parallel`` styles, which plait builds on rather than replaces;
logits sharded by vocabulary, the loss under ``loss_parallel``), from the same seed, with
the same loss and AdamW step:

* ``fsdp_tp`` / ``torch_fsdp_tp`` (and ``_sp``): a ``(dp_shard, tp)`` mesh of
  ``(nproc / 2, 2)``; TP over ``mesh["tp"]``, then ``fully_shard`` of every block and of the
  root over ``mesh["dp_shard"]``, by plait or by torch. At ``--nproc 2`` the dp dimension
  has one rank, so the rows measure FSDP's per-unit overhead over TP; at ``--nproc 4``
  they are the 2 x 2 layout, with real all-gathers and reduce-scatters.
* ``tp`` / ``tp_sp``: the same mesh and TP, no ``fully_shard``. Pure TP would run identical
  code in both libraries (torch's own TP), so it has no plait-versus-torch pair; it is the
  floor the FSDP x TP rows add their cost to. Without a data-parallel wrapper nothing
  synchronizes the dp ranks, so at ``--nproc 4`` its two TP groups train independently: a
  timing floor, not a training layout.

``_sp`` modes add sequence parallelism. The ranks of one TP group share their batch, so a
group trains ``--batch x tp`` sequences: every layout then trains ``--batch x nproc``
sequences per step, as the harness's tokens/s assumes, and rows compare at equal work.
The harness's all-gather / reduce-scatter byte counts see FSDP's collectives only (TP's go
through functional collectives).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from benchmarks.harness import BenchConfig, Mode, Step
from plait.train.model import GPT, GPTConfig, lm_loss
from plait.train.parallelize import tensor_parallel_plan

TP_DEGREE = 2  # of the FSDP x TP modes


def _group_batch(cfg: BenchConfig, tp: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch of data-parallel rank ``dp_rank``: ``cfg.batch * tp`` sequences,
    identical on the ``tp`` ranks that share it (inputs, next-token targets)."""
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    shape = (cfg.batch * tp, cfg.gpt.seq_len + 1)
    tokens = torch.randint(0, cfg.gpt.vocab_size, shape, generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _check_divisible(cfg: GPTConfig, tp: int) -> None:
    """Raise ``ValueError`` naming the flag when ``cfg`` cannot be split ``tp`` ways."""
    sizes = {
        "--heads": cfg.n_head,
        "--d-model": cfg.d_model,
        "the vocabulary": cfg.vocab_size,
        "--seq-len (sequence parallelism)": cfg.seq_len,
    }
    for flag, size in sizes.items():
        if size % tp:
            raise ValueError(f"tp suite: {flag} ({size}) must be divisible by tp={tp}")


def _tp_model(cfg: BenchConfig, tp_mesh: DeviceMesh, sequence_parallel: bool) -> GPT:
    _check_divisible(cfg.gpt, tp_mesh.size())
    torch.manual_seed(0)
    model = GPT(cfg.gpt)
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model, sequence_parallel))  # type: ignore[arg-type]
    return model


def _step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Step:
    """Forward, loss, backward and an AdamW step on ``batch``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = batch

    def step() -> None:
        with loss_parallel():  # the head leaves the logits sharded by vocabulary
            lm_loss(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _fully_shard_api(which: str) -> Any:
    if which == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard
    from plait.fsdp import fully_shard

    return fully_shard


def _tp_step(cfg: BenchConfig, which: str | None, sequence_parallel: bool) -> Step:
    """TP over ``mesh["tp"]`` of a ``(dp_shard, tp)`` mesh, then, unless ``which`` is None,
    ``which``'s fully_shard ("plait" or "torch") of every block and the root on dp_shard."""
    world = dist.get_world_size()
    if world % TP_DEGREE:
        raise ValueError(f"tp suite: --nproc ({world}) must be a multiple of tp={TP_DEGREE}")
    names = ("dp_shard", "tp")
    mesh = init_device_mesh("cpu", (world // TP_DEGREE, TP_DEGREE), mesh_dim_names=names)
    model = _tp_model(cfg, mesh["tp"], sequence_parallel)
    if which is not None:
        shard = _fully_shard_api(which)
        for block in model.blocks:
            shard(block, mesh=mesh["dp_shard"])
        shard(model, mesh=mesh["dp_shard"])
    batch = _group_batch(cfg, TP_DEGREE, dp_rank=mesh["dp_shard"].get_local_rank())
    return _step(model, batch)


def _modes() -> list[Mode]:
    modes = []
    for suffix, sp in (("", False), ("_sp", True)):
        modes.append(Mode(f"tp{suffix}", partial(_tp_step, which=None, sequence_parallel=sp)))
        modes.append(
            Mode(
                f"fsdp_tp{suffix}",
                partial(_tp_step, which="plait", sequence_parallel=sp),
                torch_counterpart=f"torch_fsdp_tp{suffix}",
            )
        )
        modes.append(
            Mode(f"torch_fsdp_tp{suffix}", partial(_tp_step, which="torch", sequence_parallel=sp))
        )
    return modes


TP_MODES: dict[str, Mode] = {m.name: m for m in _modes()}
TP_SUITE = list(TP_MODES)
