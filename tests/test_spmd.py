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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from plait import spmd
from plait.fsdp import fully_shard
from plait.pipeline import PipelineStage, ScheduleGPipe, split_model
from plait.replicate import replicate

from harness import RankError, RankTimeout, run_on_ranks
from models import MLP, MLPStack
from parity import check_parity, random_batches

DIM = 8
DEADLINE = 2.0  # seconds a collective may wait with checking on
# A check that fires "at once" or after a deadline or two, as against a hang until the
# harness's 60 s timeout: the messages asserted say which check fired, so the bound only
# rules out the hang, with room for a slow, loaded machine.
PROMPT = 30.0


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
        assert seconds < PROMPT


def test_replicate_branch_on_one_rank_is_named() -> None:
    results = run_on_ranks(2, _diverge, "replicate", timeout=60, leaves_group_broken=True)
    for message, seconds in results:
        assert "ranks issued different collectives" in message
        assert "replicate bucket 0" in message
        assert seconds < PROMPT


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
    # The message says the fault timeout (1 s) fired, and the report exists: it came within
    # the harness's grace after the death (5 s); the bound only rules out a hang.
    assert seconds < PROMPT


# --- pipelines --------------------------------------------------------------------------------


def _pipeline(
    microbatches: int,
    group: dist.ProcessGroup | None = None,
    wrap: Callable[[nn.Module], nn.Module] = lambda m: m,
) -> ScheduleGPipe:
    """This rank's stage of a 2-stage GPipe over ``group`` (default: the world)."""
    rank = dist.get_rank(group)
    model = nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(4)))
    (module,) = split_model(model, 2, stages=[rank])
    stage = PipelineStage(wrap(module), rank, 2, "cpu", group=group)
    return ScheduleGPipe(stage, microbatches, nn.functional.mse_loss)


def _pipeline_counts_differ(checking: bool) -> tuple[str, float]:
    """Rank 0 builds ScheduleGPipe(stage, 4), rank 1 ScheduleGPipe(stage, 2)."""
    if checking:
        spmd.enable(timeout=DEADLINE)
    try:
        schedule = _pipeline(4 if dist.get_rank() == 0 else 2)
        start = time.monotonic()
        with pytest.raises(spmd.DivergenceError) as info:
            schedule.step(torch.randn(8, DIM), target=torch.randn(8, DIM))
        return str(info.value), time.monotonic() - start
    finally:
        spmd.disable()


@pytest.mark.parametrize("checking", [True, False])
def test_pipeline_ranks_with_different_microbatch_counts_fail_fast(checking: bool) -> None:
    """Checking on or off: the schedule's first-step agreement check names both sides
    (without it, rank 0 would wait forever for the gradients of microbatches 2 and 3)."""
    results = run_on_ranks(
        2, _pipeline_counts_differ, checking, timeout=60, leaves_group_broken=True
    )
    for message, seconds in results:
        assert "pipeline rank 0 (global rank 0) runs GPipe with 4 microbatches" in message
        assert "pipeline rank 1 (global rank 1) runs GPipe with 2 microbatches" in message
        assert seconds < PROMPT


def _pipeline_extra_step(checking: bool) -> tuple[str, float]:
    """Rank 0 runs two steps, rank 1 one; then both end training with a check."""
    if checking:
        spmd.enable(timeout=DEADLINE)
    try:
        schedule = _pipeline(2)
        start = time.monotonic()
        try:
            for _ in range(2 if dist.get_rank() == 0 else 1):
                start = time.monotonic()
                schedule.step(torch.randn(4, DIM), target=torch.randn(4, DIM))
            spmd.check("end of training")
        except spmd.DivergenceError as error:
            return str(error), time.monotonic() - start
        return "no error", time.monotonic() - start
    finally:
        spmd.disable()


def test_pipeline_rank_running_an_extra_step_is_named() -> None:
    """Rank 0's extra step waits for gradients rank 1 never sends: past the deadline both
    ranks compare and name the step only rank 0 ran, and where each one is."""
    results = run_on_ranks(2, _pipeline_extra_step, True, timeout=60, leaves_group_broken=True)
    for message, seconds in results:
        assert "ranks issued different collectives over ranks [0,1]" in message
        assert "rank 0 (stuck in recv from rank 1 of gradients of pipeline stage 1" in message
        assert "pipeline_step over ranks [0,1] for GPipe with 2 microbatches" in message
        assert "rank 1 (end of training): nothing" in message
        assert "rank 0's last point-to-point operation: recv of" in message
        assert seconds < PROMPT


def test_pipeline_extra_step_without_checking_hangs_until_the_deadline() -> None:
    """Checking off, the same mistake is a hang, bounded here by the harness deadline
    (in a job, by the process group's timeout): rank 0 waits for its gradients."""
    with pytest.raises(RankTimeout) as info:
        run_on_ranks(2, _pipeline_extra_step, False, timeout=4, leaves_group_broken=True)
    report = str(info.value)
    assert "did not finish on rank(s) [0]" in report and "_wait_posted" in report


def _checked_pipeline_with_fully_shard() -> int:
    """Checking on, a correct pipeline of fully_shard stages on a 2 x 2 (dp, pp) mesh."""
    spmd.enable(timeout=30)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))

        def shard(module: nn.Module) -> nn.Module:
            for layer in module.children():
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh["dp"])
            return fully_shard(module, mesh=mesh["dp"])

        schedule = _pipeline(2, mesh["pp"].get_group(), shard)
        for _ in range(2):
            schedule.step(torch.randn(4, DIM), target=torch.randn(4, DIM))
        spmd.check("end of training")
        return len(spmd._checker.records) if spmd._checker else -1
    finally:
        spmd.disable()


def test_checked_pipeline_of_fully_shard_stages_passes() -> None:
    """Stages issue different collectives (their own parameters, over their own dp groups)
    and reach their backwards at different times: each group is compared on its own and
    the per-backward checks wait for the end of the pipeline step, so nothing is flagged."""
    assert run_on_ranks(4, _checked_pipeline_with_fully_shard) == [0] * 4
