"""The pipelined dry run (:func:`plait.plan.dryrun.pipeline_step`): rank 0's own actions of
a schedule, in one process, against the prediction for rank 0."""

from __future__ import annotations

import dataclasses

import pytest

from plait.layout import Layout
from plait.plan.dryrun import dry_run
from plait.plan.memory import first_rank_memory
from plait.plan.models import gpt
from plait.plan.spec import Workload
from plait.plan.train_plan import config_of_layout


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("end_blocks", [0, 2])
def test_pipelined_dry_run_within_5_percent_of_rank_0_prediction(end_blocks: int) -> None:
    # 16 ranks: pp 4 x dp_shard 4, 1F1B over 8 microbatches (rank 0 holds 4 in flight).
    # With the ends weighing 2 blocks each, the 8 blocks split 1, 3, 3, 1.
    layout = Layout(dp_shard=4, pp=4, schedule="1F1B", microbatches=8, end_blocks=end_blocks)
    work = Workload(256, 32, "fp32")
    model = gpt(8, 8, 512, work.seq_len)
    measured = dry_run(config_of_layout(model, layout, work), 16)
    predicted = first_rank_memory(model, layout, work).total
    assert predicted == pytest.approx(measured.peak, rel=0.05)
    # Rank 0 holds the embeddings and its blocks: its peak is well above its shards.
    assert measured.peak > 2 * measured.setup


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_plan_command_dry_runs_a_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    from plait.plan.cli import main

    gpt_flags = ["--n-layer", "8", "--n-head", "8", "--d-model", "512", "--seq-len", "256"]
    fixed = ["--pp", "4", "--dp-shard", "4", "--schedule", "1F1B", "--microbatches", "8"]
    args = [*gpt_flags, *fixed, "--gpus", "16", "--global-batch", "32", "--device", "cpu"]
    assert main([*args, "--top", "1", "--dry-run"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("dry run of pp=4 dp_shard=4 1F1Bx1") and "(rank 0 of 16" in line
    change = float(line.rsplit("(", 1)[1].rstrip("%)"))
    assert abs(change) < 5


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_bound_on_gathered_stages_is_predicted_as_the_dry_run_measures_it() -> None:
    # 8 ranks: pp 2 x dp_shard 4, Interleaved1F1B with 4 stages per rank over 8 blocks.
    work = Workload(128, 32, "fp32")
    model = gpt(8, 8, 512, work.seq_len)
    base = Layout(dp_shard=4, pp=2, schedule="Interleaved1F1B", stages_per_rank=4, microbatches=8)
    peaks = {}
    for bound in (0, 1):
        layout = dataclasses.replace(base, max_active_stages=bound)
        measured = dry_run(config_of_layout(model, layout, work), 8)
        predicted = first_rank_memory(model, layout, work).total
        assert predicted == pytest.approx(measured.peak, rel=0.05), bound
        peaks[bound] = measured.peak
    # One stage of four held gathered, and the next one's all-gather output while it is
    # gathered again: two stages' parameters (fp32 blocks of 512) fewer at the peak.
    assert peaks[1] < peaks[0]


def test_a_bound_on_gathered_stages_costs_all_gathers() -> None:
    from plait.plan.candidate import describe, evaluate
    from plait.plan.comm import communication
    from plait.plan.devices import device
    from plait.plan.schedule import layout_gathers, layout_shape

    work = Workload(4096, 512)
    model = gpt(32, 32, 4096, work.seq_len)
    base = Layout(dp_shard=8, pp=4, schedule="Interleaved1F1B", stages_per_rank=4, microbatches=16)
    bounded = dataclasses.replace(base, max_active_stages=2)
    h100 = device("h100")
    free, held = evaluate(model, base, work, h100), evaluate(model, bounded, work, h100)
    assert held.memory.total < free.memory.total
    assert held.timing.step_time > free.timing.step_time
    assert layout_gathers(base) == 1 and layout_gathers(bounded) > 2
    load = layout_shape(model, base).ranks[0]
    gathered = [
        sum(c.bytes for c in communication(model, lay, work, h100, load) if c.op == "all_gather")
        for lay in (base, bounded)
    ]
    assert gathered[1] == pytest.approx(gathered[0] * layout_gathers(bounded), rel=0.01)
    assert "active=2" in describe(bounded) and "active" not in describe(base)


def test_the_search_bounds_gathered_stages_only_when_nothing_fits_without() -> None:
    from plait.plan import plan
    from plait.plan.devices import device, override
    from plait.plan.search import PlanError, describe

    model, work = gpt(32, 32, 4096, 2048), Workload(2048, 64)
    fixed = {
        "pp": 2,
        "dp_shard": 4,
        "schedule": "Interleaved1F1B",
        "stages_per_rank": 4,
        "microbatches": 16,
        "ac": "full",
    }
    # Every local stage gathered: 31.3 GiB; one (and one being gathered again): 28.3 GiB.
    roomy, tight = (override(device("h100"), memory=gib * 2**30) for gib in (40, 33))
    assert {c.layout.max_active_stages for c in plan(model, work, roomy, 8, **fixed)} == {0}
    found = plan(model, work, tight, 8, **fixed)
    assert {c.layout.max_active_stages for c in found} == {1}
    assert "active=1" in describe(found[0].layout)
    with pytest.raises(PlanError, match="fits in no layout"):
        plan(model, work, tight, 8, max_active_stages=0, **fixed)
    with pytest.raises(PlanError, match="--max-active-stages -1: .* 0 for no bound"):
        plan(model, work, tight, 8, max_active_stages=-1, **fixed)
