"""``plait plan`` from 8 to 10,000 GPUs: the searches find layouts, and the shortcuts that
make them fast (closed-form makespans, caches keyed by what matters) change nothing. How
long the searches take is reported by ``benchmarks/plan_speed.py``, not asserted here.

Oracle: plait's own schedule generator and simulator (:mod:`plait.pipeline`), run the way
:func:`plait.plan.schedule.pipeline_shape` ran them before the shortcuts. Single process.
"""

from __future__ import annotations

import functools
import json

import pytest

from plait.layout import stage_blocks
from plait.pipeline.actions import Schedule, stage_to_rank
from plait.pipeline.schedules import SCHEDULES, generate, schedule_spec
from plait.pipeline.simulate import Simulation, peak_live, simulate
from plait.plan import Workload, device, plan, preset
from plait.plan.cli import main
from plait.plan.schedule import (
    PipelineShape,
    RankLoad,
    _figures,
    _pareto,
    closed_form_makespan,
    pipeline_shape,
)

COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
H100 = device("h100")


@functools.cache
def _simulated(name: str, pp: int, v: int, m: int) -> tuple[Schedule, Simulation]:
    sched = generate(name, pp, pp * v, m)
    return sched, simulate(sched, COSTS)


def simulated_shape(layers: int, pp: int, name: str, v: int, m: int) -> PipelineShape:
    """``pipeline_shape`` as it was: every shape generated and simulated."""
    spec = schedule_spec(name)
    n_stages = pp * v
    sched, sim = _simulated(spec.name, pp, v, m)
    sizes = stage_blocks(layers, n_stages)
    loads = []
    for rank in range(pp):
        mine = [s for s in range(n_stages) if stage_to_rank(s, pp, spec.style) == rank]
        head = n_stages - 1 in mine
        loads.append(
            RankLoad(
                rank,
                sum(sizes[s] for s in mine),
                max(sizes[s] for s in mine),
                0 in mine,
                head,
                sim.peak_activations[rank],
                peak_live(sched[rank], n_stages - 1) if head else 0,
                peak_live(sched[rank], after_backward=True),
            )
        )
    return PipelineShape(_pareto(loads), sim.makespan / 3, sim.bubble_fraction)


def _shapes(max_ranks: int, per_rank: int) -> list[tuple[str, int, int, int]]:
    """(schedule, ranks, stages per rank, microbatches) for every schedule plait has, up
    to ``max_ranks`` ranks and ``per_rank`` microbatches per rank, that it accepts."""
    out = []
    for name, spec in SCHEDULES.items():
        for p in range(2, max_ranks + 1):
            for v in [spec.stages_per_rank] if spec.stages_per_rank else [2, 3, 4]:
                low = spec.min_microbatches(p * v)
                out += [(name, p, v, m) for m in range(max(1, low), per_rank * p + 1)]
    return out


def test_closed_form_makespans_equal_the_simulator() -> None:
    checked = 0
    for name, p, v, m in _shapes(8, 3):
        closed = closed_form_makespan(name, p, v, m)
        if closed is None:
            assert name == "InterleavedZeroBubble" and m < p
            continue
        sim = _simulated(name, p, v, m)[1]
        assert closed == sim.makespan, (name, p, v, m)
        checked += 1
    assert checked > 1000


def test_pipeline_shape_equals_the_simulated_one() -> None:
    # Every field, floats to the bit, with blocks that divide the stages and blocks that
    # do not (earlier stages one more).
    for name, p, v, m in _shapes(6, 2):
        for layers in (p * v, p * v + 1, 4 * p * v - 1):
            got = pipeline_shape(layers, p, name, v, m)
            assert got == simulated_shape(layers, p, name, v, m), (name, p, v, m, layers)


@pytest.mark.parametrize(
    ("name", "p", "v", "m"),
    [
        ("1F1B", 32, 1, 64),
        ("GPipe", 16, 1, 8),
        ("Interleaved1F1B", 16, 2, 24),
        ("Interleaved1F1B", 16, 4, 8),
        ("LoopedBFS", 12, 3, 13),
        ("InterleavedZeroBubble", 16, 2, 16),
        ("InterleavedZeroBubble", 12, 2, 7),  # fewer microbatches than ranks: simulated
        ("ZBVZeroBubble", 16, 2, 20),
        ("ZBVZeroBubble", 16, 2, 24),
        ("DualPipeV", 16, 2, 40),
    ],
)
def test_larger_shapes_equal_the_simulated_ones(name: str, p: int, v: int, m: int) -> None:
    assert pipeline_shape(126, p, name, v, m) == simulated_shape(126, p, name, v, m)


@pytest.mark.parametrize(
    ("name", "v", "m"),
    [
        ("1F1B", 2, 8),
        ("GPipe", 1, 0),
        ("LoopedBFS", 2, 0),
        ("DualPipeV", 2, 7),
        ("ZBVZeroBubble", 3, 8),
    ],
)
def test_refused_shapes_are_still_refused(name: str, v: int, m: int) -> None:
    # The closed forms skip the full generation; the generator's checks still run.
    with pytest.raises(ValueError):
        generate(name, 4, 4 * v, m)
    with pytest.raises(ValueError):
        pipeline_shape(32, 4, name, v, m)


def test_figures_are_shared_across_block_counts() -> None:
    # The schedule's figures do not depend on the blocks: one generation serves them all.
    pipeline_shape(64, 4, "Interleaved1F1B", 2, 12)
    before = _figures.cache_info().hits
    pipeline_shape(80, 4, "Interleaved1F1B", 2, 12)
    assert _figures.cache_info().hits == before + 1


def _cold_caches() -> None:
    # Search as a fresh process would, not with earlier tests' shapes cached.
    pipeline_shape.cache_clear()
    _figures.cache_clear()


def _cold_plan_count(name: str, seq: int, batch: int, gpus: int) -> int:
    _cold_caches()
    return len(plan(preset(name), Workload(seq, batch), H100, gpus))


def test_10240_gpu_search_of_405b_finds_layouts() -> None:
    # The upper end.
    assert _cold_plan_count("llama3-405b", 8192, 2048, 10240) > 0


def test_1024_gpu_search_of_8b_finds_layouts() -> None:
    assert _cold_plan_count("llama3-8b", 8192, 1024, 1024) > 1000


def test_cli_json_at_1024_gpus_prints_the_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--preset", "llama3-8b", "--gpus", "1024", "--gpus-per-node", "8"]
    _cold_caches()
    assert main([*argv, "--seq-len", "8192", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)
