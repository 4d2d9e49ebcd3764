"""Mixture-of-experts modes: expert parallelism 2 x fully_shard, plait's beside torch's.

Every mode trains plait's GPT (``plait.train.model``) with a MoE feed-forward in every
block (:data:`MOE`: 8 routed SwiGLU experts, top-2, one shared expert, balance and z
losses), the run's other model flags unchanged, from the same seed, on the same per-rank
batches, with the same loss and AdamW step:

* ``moe_ep_fsdp`` / ``torch_moe_ep_fsdp``: ``plait train``'s layout
  (``plait.train.parallelize``). The routed experts are sharded over the ``ep`` dimension
  (:data:`EP` = 2) of the experts' mesh ``(efsdp, ep)`` by plait's ``expert_parallel``
  (tokens dispatched and combined by all-to-all), every MoE balancing its load over all
  ``dp_shard`` ranks. Then ``fully_shard`` of every block, one unit whose experts are a
  parameter group on ``efsdp`` and whose other parameters are on ``dp_shard``, then the
  root. The two modes differ only in whose ``fully_shard``: plait's (the experts' group
  given as ``plait.fsdp.ShardPlacement``) or torch's (as torch's ``ShardPlacementResult``,
  the way torchtitan passes it). ``--nproc 2``: ep 2 x efsdp 1, dp_shard 2;
  ``--nproc 4``: ep 2 x efsdp 2, dp_shard 4.
* ``moe_fsdp`` / ``torch_moe_fsdp``: the reference without expert parallelism (ep 1): the
  same model, every parameter (the experts too) sharded over ``dp_shard``; no all-to-all,
  every rank computes all experts on its own tokens.
* ``moe_ep_fsdp_loop`` / ``moe_fsdp_loop``: plait's ``moe_ep_fsdp`` / ``moe_fsdp`` with the
  routed experts run one after another (``set_grouped_mm(model, False)``) instead of as
  grouped GEMMs (``plait.experts.grouped``, the default where torch can run them: the
  expert width is rounded to :data:`EXPERT_WIDTH_MULTIPLE` elements, so it can). Their
  torch counterpart is the grouped mode: the "vs torch" ratio is loop over grouped. The
  suite ``moe_grouped`` runs the four.

The harness counts the bytes each rank's all-to-alls send to the other ranks (its
``count_all_to_all_bytes``): per MoE layer and step, the forward's dispatch and combine
and their two reverses in backward, each sending the rows routed to experts of the other
ep ranks (``d_model`` fp32 values a row), plus the tiny exchange of per-expert row counts
before each dispatch (``E / ep`` int64 per peer). The formula beside it assumes balanced
routing: each of ``tokens * top_k`` rows leaves its rank with probability
``(ep - 1) / ep``, four times per layer. Measured over formula is the routing's locality:
above 1 when more rows than the balanced share go to the other rank. plait's and torch's
fully_shard modes route identically (same seed, same data, bitwise the same training), so
their counts must be equal; the report says whether they are. Each mode also prints the
loss of its first two steps (mean over ranks, fp32), which must agree between the pair.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from benchmarks.harness import BenchConfig, Mode, Step
from plait.experts import MoE, expert_parallel, set_grouped_mm, set_load_balance_mesh
from plait.experts.swiglu import GroupedExperts
from plait.fsdp import ShardPlacement, fully_shard
from plait.layout import DP_SHARD, EFSDP, EP, Layout
from plait.train.model import GPT, GPTConfig, lm_loss

EP_DEGREE = 2  # of the expert-parallel modes

#: The MoE fields of every mode's model; the rest comes from the run's flags.
MOE: dict[str, Any] = {
    "experts": 8,
    "top_k": 2,
    "shared_experts": 1,
    "aux_loss_coeff": 1e-2,
    "z_loss_coeff": 1e-3,
}

#: Expert widths are rounded down to a multiple of this many elements: 16-byte rows in
#: fp32 and bf16, which grouped GEMM needs (the automatic 4 * 128 // 3 = 170 would run the
#: loop in every mode; it becomes 168).
EXPERT_WIDTH_MULTIPLE = 8


def moe_config(cfg: BenchConfig) -> GPTConfig:
    auto = dataclasses.replace(cfg.gpt, **MOE).d_expert
    width = max(EXPERT_WIDTH_MULTIPLE, auto // EXPERT_WIDTH_MULTIPLE * EXPERT_WIDTH_MULTIPLE)
    return dataclasses.replace(cfg.gpt, **MOE, expert_hidden=width)


def all_to_all_formula(cfg: BenchConfig, ep: int) -> float:
    """Bytes one rank sends to its peers per step under balanced routing: per MoE layer,
    dispatch and combine in forward and again in backward, ``tokens * top_k`` fp32 rows of
    ``d_model`` each, the share ``(ep - 1) / ep`` of them bound for other ranks."""
    gpt = moe_config(cfg)
    tokens = cfg.batch * gpt.seq_len
    per_layer = 4 * tokens * gpt.top_k * gpt.d_model * 4 * (ep - 1) / ep
    return gpt.n_layer * per_layer


def _batch(cfg: BenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed local batch (the same as the other suites')."""
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    tokens = torch.randint(0, cfg.gpt.vocab_size, (cfg.batch, cfg.gpt.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


_REPORTED: set[str] = set()  # modes whose first loss this process has printed


def _step(name: str, model: GPT, cfg: BenchConfig) -> Step:
    """Forward, loss, backward, an AdamW step. The first two calls of the first model built
    for ``name`` print their loss (mean over ranks) on rank 0: the first is the forward of
    the initial weights, the second follows one optimizer step (so it checks gradients)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = _batch(cfg)
    report = name not in _REPORTED
    _REPORTED.add(name)
    calls = 0

    def step() -> None:
        nonlocal calls
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        calls += 1
        if report and calls <= 2:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
            if dist.get_rank() == 0:
                print(f"[moe] {name}: step {calls} loss (mean over ranks) {mean.item():.9f}")

    return step


def _placement_fn(block: nn.Module, efsdp: DeviceMesh, which: str) -> Callable[[nn.Parameter], Any]:
    """``shard_placement_fn`` of ``block``'s unit: its experts' parameters a group on
    ``efsdp`` (``Shard(0)``), the others on the unit's mesh (``None``)."""
    own = {id(p) for m in block.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    if which == "torch":
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            FSDPMeshInfo,
            ShardPlacementResult,
        )

        chosen: Any = ShardPlacementResult(Shard(0), FSDPMeshInfo(efsdp, shard_mesh_dim=0))
    else:
        chosen = ShardPlacement(Shard(0), efsdp)
    return lambda p: chosen if id(p) in own else None


def _fully_shard_api(which: str) -> Callable[..., Any]:
    if which == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard
    return fully_shard


def _moe_step(cfg: BenchConfig, which: str, ep: int, name: str, grouped: bool = True) -> Step:
    """``ep`` > 1: expert parallelism over ``ep`` ranks, then ``which``'s fully_shard of
    every block (experts on efsdp, the rest on dp_shard) and of the root. ``ep`` 1: every
    parameter of a block on dp_shard. ``grouped``: the routed experts as grouped GEMMs
    (False: one after another)."""
    world = dist.get_world_size()
    if world % ep:
        raise ValueError(f"moe suite: --nproc ({world}) must be a multiple of ep={ep}")
    layout = Layout(dp_shard=world, ep=ep)
    mesh = layout.mesh("cpu")
    assert mesh is not None, "moe suite: needs --nproc 2 or more"
    dp = mesh[DP_SHARD]
    experts = layout.expert_mesh("cpu")  # (efsdp, ep); None for ep 1
    torch.manual_seed(0)
    model = GPT(moe_config(cfg))
    set_grouped_mm(model, grouped)
    if experts is not None:
        expert_parallel(model, experts[EP], load_balance_mesh=dp)
    else:
        set_load_balance_mesh(model, dp)
    assert any(isinstance(m, MoE) for m in model.modules())
    shard = _fully_shard_api(which)
    for block in model.blocks:
        fn = None if experts is None else _placement_fn(block, experts[EFSDP], which)
        shard(block, mesh=dp, shard_placement_fn=fn)
    shard(model, mesh=dp)
    return _step(name, model, cfg)


def _modes() -> list[Mode]:
    modes = []
    for name, ep in (("moe_ep_fsdp", EP_DEGREE), ("moe_fsdp", 1)):
        formula = partial(all_to_all_formula, ep=ep) if ep > 1 else None
        torch_name = f"torch_{name}"
        modes.append(
            Mode(
                name,
                partial(_moe_step, which="plait", ep=ep, name=name),
                torch_counterpart=torch_name,
                all_to_all_formula=formula,
            )
        )
        modes.append(
            Mode(
                torch_name,
                partial(_moe_step, which="torch", ep=ep, name=torch_name),
                all_to_all_formula=formula,
            )
        )
        modes.append(
            Mode(
                f"{name}_loop",
                partial(_moe_step, which="plait", ep=ep, name=f"{name}_loop", grouped=False),
                torch_counterpart=name,  # the ratio column: loop over grouped
                all_to_all_formula=formula,
            )
        )
    return modes


MOE_MODES: dict[str, Mode] = {m.name: m for m in _modes()}
MOE_SUITE = [name for name in MOE_MODES if not name.endswith("_loop")]
#: Grouped GEMM beside the loop, plait's fully_shard, with and without expert parallelism.
MOE_GROUPED_SUITE = ["moe_ep_fsdp", "moe_ep_fsdp_loop", "moe_fsdp", "moe_fsdp_loop"]
