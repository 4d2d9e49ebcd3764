"""The search over stages per rank of interleaved schedules."""

from __future__ import annotations

import dataclasses

import pytest

from plait.layout import Layout, check_stages, stage_blocks
from plait.layout.schedule import _ends_that_fit
from plait.pipeline import stage_layers
from plait.plan.cli import main
from plait.plan.devices import device
from plait.plan.models import preset
from plait.plan.report import stage_split
from plait.plan.schedule import pipeline_shape, pipeline_stages
from plait.plan.search import evaluate, plan, stages_options
from plait.plan.spec import Workload
from plait.train.model import GPT, GPTConfig


def test_stages_options_double_up_to_one_block_per_stage() -> None:
    interleaved = Layout(pp=4, schedule="Interleaved1F1B", stages_per_rank=2)
    assert stages_options(interleaved, 32) == [4, 8]
    assert stages_options(interleaved, 126) == [4, 8, 16, 31]
    assert stages_options(Layout(pp=16, schedule="Interleaved1F1B", stages_per_rank=2), 126) == [
        4,
        7,
    ]
    assert stages_options(Layout(pp=4, schedule="1F1B"), 32) == []  # one stage per rank
    assert stages_options(Layout(pp=4, schedule="ZBVZeroBubble", stages_per_rank=2), 32) == []
    assert stages_options(Layout(), 32) == []


def test_search_finds_more_stages_per_rank() -> None:
    # 70B on 64 GPUs with a pipeline: the bubble shrinks with stages per rank.
    model, work, h100 = preset("llama3-70b"), Workload(8192, 64), device("h100")
    found = plan(model, work, h100, 64, pp=8, tp=8, schedule="Interleaved1F1B")
    assert {c.layout.stages_per_rank for c in found} > {2}
    assert found[0].layout.stages_per_rank > 2
    pinned = plan(model, work, h100, 64, pp=8, tp=8, schedule="Interleaved1F1B", stages_per_rank=2)
    assert {c.layout.stages_per_rank for c in pinned} == {2}


def test_the_split_with_weighted_ends_is_the_one_plait_train_makes() -> None:
    # One rule (plait.layout.stage_blocks) for the planner's stages and plait train's cut.
    gpt = GPT(GPTConfig(n_layer=10, n_head=2, d_model=16, vocab_size=32, seq_len=8))
    for n_stages, ends in [(2, 0), (4, 1), (5, 1), (4, 2), (12, 1)]:
        plan_ = stage_layers(gpt, n_stages, layers="blocks", end_blocks=ends)
        cut = [sum(name.startswith("blocks.") for name in names) for names in plan_]
        priced = [size for size, _ in pipeline_stages(10, n_stages, "1F1B", 1, ends)]
        assert cut == priced == stage_blocks(10, n_stages, ends), (n_stages, ends)
    # Llama 3 405B (section 3.3.2 of its paper): 126 blocks over 16 x 8 stages, the first
    # chunk the embedding alone, the last the head alone, every other one block.
    stages = pipeline_stages(126, 16, "Interleaved1F1B", 8, 1)
    assert [size for size, _ in stages] == [0] + [1] * 126 + [0]
    assert stages[0][1] == 0 and stages[-1][1] == 15
    shape = pipeline_shape(126, 16, "Interleaved1F1B", 8, 16, 1)
    assert {(r.rank, r.layers, r.embedding, r.head) for r in shape.ranks} >= {(0, 7, True, False)}
    with pytest.raises(ValueError, match="128 pipeline stages but only 126 blocks"):
        pipeline_stages(126, 16, "Interleaved1F1B", 8)
    with pytest.raises(ValueError, match="end blocks 3: more than a stage's share"):
        stage_blocks(4, 4, 3)


def test_pipeline_rules_name_the_end_blocks_fix() -> None:
    shape = preset("llama3-405b").shape(8192)
    eight = Layout(pp=16, schedule="Interleaved1F1B", stages_per_rank=8)
    (reason,) = check_stages(shape, eight)
    assert "or --end-blocks 1 (the embedding and the head as stages of their own)" in reason.message
    assert check_stages(shape, dataclasses.replace(eight, end_blocks=1)) == []
    (reason,) = check_stages(shape, dataclasses.replace(eight, stages_per_rank=2, end_blocks=9))
    assert reason.field == "end_blocks" and "--end-blocks 9" in reason.message
    (reason,) = check_stages(shape, dataclasses.replace(eight, end_blocks=-1))
    assert reason.message == "--end-blocks -1: use 0 or more"


def test_search_weighs_the_ends_unless_fixed() -> None:
    model, work, h100 = preset("llama3-70b"), Workload(8192, 64), device("h100")
    interleaved = Layout(pp=16, schedule="Interleaved1F1B", stages_per_rank=2)
    assert stages_options(interleaved, 126) == [4, 7]
    assert stages_options(dataclasses.replace(interleaved, end_blocks=1), 126) == [4, 8]
    found = plan(model, work, h100, 64, pp=8, tp=8, schedule="Interleaved1F1B")
    assert {c.layout.end_blocks for c in found} == {0, 1}
    assert any(c.layout.stages_per_rank == 10 and c.layout.end_blocks for c in found)  # 80 + 2
    fixed = plan(model, work, h100, 64, pp=8, tp=8, schedule="1F1B", end_blocks=0)
    assert {c.layout.end_blocks for c in fixed} == {0}
    pinned = plan(model, work, h100, 64, pp=8, tp=8, schedule="Interleaved1F1B", stages_per_rank=2)
    assert {c.layout.stages_per_rank for c in pinned} == {2}
    assert {c.layout.end_blocks for c in pinned} == {0, 1}
    best = evaluate(model, found[0].layout, work, h100)
    assert best.timing.step_time == pytest.approx(found[0].timing.step_time)


def test_the_report_shows_the_blocks_of_each_stage(capsys: pytest.CaptureFixture[str]) -> None:
    llama3 = Layout(pp=16, schedule="Interleaved1F1B", stages_per_rank=8, end_blocks=1)
    ends = "(the embedding on the first, the head on the last)"
    assert stage_split(llama3, 126) == f"blocks per stage: 0, 1 x 126, 0 {ends}"
    assert (
        stage_split(Layout(pp=4, schedule="1F1B"), 10) == f"blocks per stage: 3 x 2, 2 x 2 {ends}"
    )
    flags = ["--preset", "llama3-405b", "--gpus", "8192", "--global-batch", "2048", "--top", "1"]
    pinned = ["--pp", "16", "--schedule", "InterleavedZeroBubble", "--stages-per-rank", "8"]
    assert main([*flags, *pinned, "--end-blocks", "1"]) == 0
    assert f"  blocks per stage: 0, 1 x 126, 0 {ends}" in capsys.readouterr().out


def test_the_end_blocks_suggested_are_the_fewest_that_split() -> None:
    # check_stages suggests --end-blocks from a closed form (the search asks it of every
    # layout with too many stages); it must name the smallest end weight stage_blocks
    # accepts, as trying each weight in turn finds, or 0 when none does.
    def tried(blocks: int, n_stages: int) -> int:
        for ends in range(1, n_stages):
            try:
                stage_blocks(blocks, n_stages, ends)
            except ValueError:
                continue
            return ends
        return 0

    for blocks in range(0, 40):
        for n_stages in range(1, 60):
            assert _ends_that_fit(blocks, n_stages) == tried(blocks, n_stages), (blocks, n_stages)
