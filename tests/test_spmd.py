"""Divergence detection (``plait.spmd``) and conditional units: errors, never hangs.

Each divergent scenario runs with checking on and a short deadline; without plait.spmd the
same scenarios hang (the collectives stop matching) or silently mix up data.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait import spmd
from plait.fsdp import fully_shard
from plait.replicate import replicate

from harness import RankError, run_on_ranks
from models import MLP, MLPStack
from parity import check_parity, random_batches

DIM = 8
DEADLINE = 2.0  # seconds a collective may wait with checking on


class _Skipping(MLPStack):
    """Rank 1 skips block 1: its collectives no longer match rank 0's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == 1 and dist.get_rank() == 1:
                continue
            x = x + block(x)
        return self.head(x)


def _diverge(build: str) -> tuple[str, float]:
    spmd.enable(timeout=DEADLINE)
    try:
        if build == "fully_shard":
            model: nn.Module = _Skipping(3, DIM, 16)
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            extra = False
        else:  # replicate: rank 0 takes a branch with one more backward
            model = replicate(MLP(DIM, 16))
            extra = dist.get_rank() == 0
        start = time.monotonic()
        with pytest.raises(spmd.DivergenceError) as info:
            for _ in range(2):
                model(torch.randn(4, DIM)).sum().backward()
                if extra:
                    model(torch.randn(4, DIM)).sum().backward()
                spmd.check()  # once per step: catches a rank running an extra backward
        return str(info.value), time.monotonic() - start
    finally:
        spmd.disable()


def test_fully_shard_unit_skipped_on_one_rank_is_named() -> None:
    results = run_on_ranks(2, _diverge, "fully_shard", timeout=60, leaves_group_broken=True)
    for message, seconds in results:
        assert "ranks issued different collectives" in message
        assert "fully_shard unit 'blocks.1'" in message  # rank 0 gathers it, rank 1 does not
        assert "rank 0" in message and "rank 1" in message
        assert seconds < 5 * DEADLINE


def test_replicate_branch_on_one_rank_is_named() -> None:
    results = run_on_ranks(2, _diverge, "replicate", timeout=60, leaves_group_broken=True)
    for message, seconds in results:
        assert "ranks issued different collectives" in message
        assert "replicate bucket 0" in message
        assert seconds < 5 * DEADLINE


def _agreeing_ranks() -> int:
    """Checking on, ranks in step: training runs and every step's check passes."""
    spmd.enable(timeout=30)
    try:
        model = MLPStack(3, DIM, 16)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        for _ in range(3):
            model(torch.randn(4, DIM)).sum().backward()
        return len(spmd._checker.records) if spmd._checker else -1
    finally:
        spmd.disable()


def test_checking_passes_when_ranks_agree() -> None:
    assert run_on_ranks(2, _agreeing_ranks) == [0, 0]  # each step's records were checked


# --- conditional units -------------------------------------------------------------------


class _Experts(nn.Module):
    """Two experts; rank r routes every token to expert r % 2 (the other never runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(MLP(DIM, 16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.router(x)
        return self.experts[self.route(x)](h)

    def route(self, x: torch.Tensor) -> int:
        return dist.get_rank() % 2


class _ReferenceExperts(_Experts):
    """The single-process reference: each sample goes where its rank would send it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.router(x)
        world, rows = dist.get_world_size(), x.shape[0] // dist.get_world_size()
        parts = [self.experts[r % 2](h[r * rows : (r + 1) * rows]) for r in range(world)]
        return torch.cat(parts)


def _conditional_experts() -> None:
    def parallelize(model: nn.Module) -> nn.Module:
        for expert in model.experts:
            fully_shard(expert, conditional=True)
        return fully_shard(model)

    spmd.enable(timeout=10)
    try:
        check_parity(
            _Experts, parallelize, random_batches(3, 8, DIM, DIM), build_reference=_ReferenceExperts
        )
    finally:
        spmd.disable()


@pytest.mark.parametrize("world_size", [2, 4])
def test_conditional_experts_train_like_one_process(world_size: int) -> None:
    run_on_ranks(world_size, _conditional_experts)


def _conditional_no_grad() -> list[Any]:
    model = _Experts()
    for expert in model.experts:
        fully_shard(expert, conditional=True)
    fully_shard(model)
    with torch.no_grad():
        model(torch.randn(2, DIM))
    return [type(p).__name__ for p in copy.copy(list(model.parameters()))]


def test_conditional_units_reshard_after_no_grad_forward() -> None:
    names = run_on_ranks(2, _conditional_no_grad)[0]
    assert set(names) == {"DTensor"}


# --- a rank that dies -----------------------------------------------------------------------


def _killed(report: str, checking: bool) -> None:
    """Rank 1 is killed (SIGKILL) in the middle of a forward; rank 0 reports what it saw."""
    os.environ["PLAIT_FAULT_TIMEOUT"] = "1"  # the survivors wait this long for each other
    if checking:
        spmd.enable(timeout=DEADLINE)
    try:
        model = MLPStack(3, DIM, 16)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        if dist.get_rank() == 1:
            model.blocks[1].register_forward_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        start = time.monotonic()
        try:
            for _ in range(2):
                model(torch.randn(4, DIM)).sum().backward()
            outcome = "no error"
        except Exception as error:  # what the survivor raised
            outcome = f"{type(error).__name__}: {error}"
        Path(report).write_text(json.dumps([outcome, time.monotonic() - start]))
    finally:
        spmd.disable()


@pytest.mark.parametrize("checking", [False, True])
def test_survivors_name_a_killed_rank(tmp_path: Path, checking: bool) -> None:
    report = tmp_path / "rank0.json"
    with pytest.raises(RankError, match=r"rank 1 process died"):
        run_on_ranks(2, _killed, str(report), checking, timeout=60, leaves_group_broken=True)
    outcome, seconds = json.loads(report.read_text())
    assert outcome.startswith("RankLostError") and "rank(s) [1] did not answer" in outcome
    assert seconds < 4  # the harness gives survivors 5 s after a death to report
