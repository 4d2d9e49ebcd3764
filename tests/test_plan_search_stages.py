"""The search over stages per rank of interleaved schedules."""

from __future__ import annotations

from plait.layout import Layout
from plait.plan.devices import device
from plait.plan.models import preset
from plait.plan.search import plan, stages_options
from plait.plan.spec import Workload


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
