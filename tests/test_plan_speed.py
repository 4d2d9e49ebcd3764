"""The shortcuts that make cold ``plait plan`` searches fast change nothing (how fast they
are is reported by ``benchmarks/plan_speed.py``, not asserted here).

Oracles: plait's schedule generator (:func:`plait.pipeline.schedules.generate`, peaks
read with :func:`plait.pipeline.simulate.peak_live`) for the closed-form peaks; the
search with those shortcuts switched off, run in the same process under the same timing
and memory code; and the top layouts recorded before the shortcuts went in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys

import pytest

from plait.layout import Layout, ModelShape, check_ep
from plait.pipeline.actions import stage_to_rank
from plait.pipeline.schedules import generate, schedule_spec
from plait.pipeline.simulate import peak_live
from plait.plan import Workload, device, plan, preset
from plait.plan import schedule as schedule_module
from plait.plan import search as search_module
from plait.plan.pinned import Pinned as _Pinned
from plait.plan.search import Candidate, _ep_options, _with, describe

H100 = device("h100")
PEAKS = tuple[tuple[int, ...], int, tuple[int, ...]]


def _generated_peaks(name: str, p: int, v: int, m: int) -> PEAKS:
    """Per rank the peak of live activations, the last stage's on its rank, and per rank
    the peak after the first backward: read from the generated order."""
    order = generate(name, p, p * v, m)
    owner = stage_to_rank(p * v - 1, p, schedule_spec(name).style)
    return (
        tuple(peak_live(order[r]) for r in range(p)),
        peak_live(order[owner], p * v - 1),
        tuple(peak_live(order[r], after_backward=True) for r in range(p)),
    )


def test_megatron_peaks_equal_the_generator() -> None:
    # Interleaved1F1B and InterleavedZeroBubble, fewer microbatches than ranks to several
    # groups (uneven ones included), one to four stages per rank.
    checked = 0
    for name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        for p in range(1, 9):
            for v in (1, 2, 3, 4):
                for m in range(1, 3 * p + 3):
                    got = schedule_module._closed_form_peaks(name, p, v, m)
                    assert got == _generated_peaks(name, p, v, m), (name, p, v, m)
                    checked += 1
    assert checked > 600


@pytest.mark.parametrize(("p", "v", "m"), [(16, 2, 64), (12, 3, 40), (8, 4, 19), (32, 2, 33)])
def test_megatron_peaks_equal_the_generator_at_larger_shapes(p: int, v: int, m: int) -> None:
    for name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        assert schedule_module._closed_form_peaks(name, p, v, m) == _generated_peaks(name, p, v, m)


def test_v_peaks_equal_the_generator() -> None:
    # From 2p microbatches (DualPipeV's fewest) on, and None below (ZBV: generated).
    checked = 0
    for name in ("ZBVZeroBubble", "DualPipeV"):
        for p in range(1, 11):
            for m in range(2 * p, 4 * p + 3):
                got = schedule_module._closed_form_peaks(name, p, 2, m)
                assert got == _generated_peaks(name, p, 2, m), (name, p, m)
                checked += 1
        assert schedule_module._closed_form_peaks(name, 4, 2, 7) is None
    assert checked > 250


@pytest.mark.parametrize(
    ("name", "p", "n_stages", "m"),
    [
        ("DualPipeV", 4, 8, 7),
        ("ZBVZeroBubble", 4, 12, 8),
        ("Interleaved1F1B", 4, 10, 8),
        ("InterleavedZeroBubble", 4, 8, 0),
        ("1F1B", 4, 8, 8),
    ],
)
def test_shapes_the_generator_refuses_are_refused(name: str, p: int, n_stages: int, m: int) -> None:
    # _runs mirrors the generator's checks; a refused shape still raises its ValueError.
    assert not schedule_module._runs(name, p, n_stages, m)
    with pytest.raises(ValueError):
        schedule_module._figures(name, p, n_stages, m)


def test_ep_options_are_the_sizes_check_ep_takes() -> None:
    pinned = _Pinned(Layout(), frozenset())
    for experts in (0, 1, 6, 8, 64, 160, 256):
        shape = ModelShape(8, 8, 8, 512, 1024, 1000, 4096, experts=experts)
        for dp_shard in (1, 2, 3, 12, 16, 96, 1024):
            want = [d for d in range(1, dp_shard + 1) if not check_ep(shape, d, dp_shard)]
            assert _ep_options(shape, dp_shard, pinned) == want, (experts, dp_shard)


def test_with_is_dataclasses_replace() -> None:
    layout = Layout(dp_shard=4, tp=2, pp=2, schedule="Interleaved1F1B", stages_per_rank=2)
    for changes in ({"ac": "full"}, {"microbatches": 8, "ep": 2}, {"cp_method": "ring"}):
        assert _with(layout, **changes) == dataclasses.replace(layout, **changes)


def _digest(found: list[Candidate]) -> str:
    text = "\n".join(
        f"{c.layout!r} {c.timing.tokens_per_s_per_device!r} {c.memory.total!r}" for c in found
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_CLOSED_FORM_PEAKS = schedule_module._closed_form_peaks


def _unshortcut_peaks(name: str, pp: int, v: int, m: int) -> PEAKS | None:
    """The closed forms as they were before issue 28: GPipe, 1F1B and LoopedBFS only."""
    if name in ("GPipe", "1F1B", "LoopedBFS"):
        return _CLOSED_FORM_PEAKS(name, pp, v, m)
    return None


def _reference_ep_options(shape: ModelShape, dp_shard: int, pinned: _Pinned) -> list[int]:
    if pinned.given("ep"):
        return [pinned.layout.ep]
    return [d for d in range(1, dp_shard + 1) if not check_ep(shape, d, dp_shard)]


def _cold() -> None:
    schedule_module.pipeline_shape.cache_clear()
    schedule_module._figures.cache_clear()


@pytest.mark.parametrize(
    ("name", "seq", "batch", "gpus"),
    [("llama3-405b", 8192, 2048, 2048), ("llama3-70b", 8192, 512, 512)],
)
def test_search_equals_the_search_without_shortcuts(
    monkeypatch: pytest.MonkeyPatch, name: str, seq: int, batch: int, gpus: int
) -> None:
    # Every candidate, in order, with its figures to the bit: the generated peaks of every
    # schedule and the ep sizes asked of check_ep one by one give the same search.
    _cold()
    fast = plan(preset(name), Workload(seq, batch), H100, gpus)
    with monkeypatch.context() as patch:
        patch.setattr(schedule_module, "_closed_form_peaks", _unshortcut_peaks)
        patch.setattr(search_module, "_ep_options", _reference_ep_options)
        _cold()
        slow = plan(preset(name), Workload(seq, batch), H100, gpus)
    _cold()
    assert any(c.layout.schedule in ("DualPipeV", "Interleaved1F1B") for c in fast)
    assert _digest(fast) == _digest(slow)


#: The 10,240-GPU search of ``plait plan --preset llama3-405b --gpus 10240`` (global batch
#: one sequence per device) as the search found it before issue 28's shortcuts, under the
#: timing and memory code of this tree: the three best layouts, the three best with a
#: pipeline, how many fit, and a digest of every candidate with its figures. Recorded with
#: the search code before the shortcuts; record it again (same way) when the timing or
#: memory model changes the figures, or the search tries more (2026-11-29: the pipelines
#: with the embedding and the head weighing a block, ``end_blocks=1``; 2026-11-30: the
#: shared sustained fraction refitted once llm-foundry's attention had its own rate; then
#: ``Layout.max_active_stages``, 0 in every candidate, joined each layout's repr).
RECORDED_10240 = {
    "top": [
        "dp_replicate=10 dp_shard=512 tp=2 ac=full",
        "dp_replicate=5 dp_shard=1024 tp=2 ac=full",
        "dp_replicate=20 dp_shard=256 tp=2 ac=full",
    ],
    "piped": [
        "pp=16 dp_shard=160 tp=4 InterleavedZeroBubblex8 ends=1 mb=64 ac=full",
        "pp=16 dp_replicate=2 dp_shard=80 tp=4 InterleavedZeroBubblex8 ends=1 mb=64 ac=full",
        "pp=16 dp_replicate=4 dp_shard=40 tp=4 InterleavedZeroBubblex8 ends=1 mb=64 ac=full",
    ],
    "n": 894,
    "digest": "cf403480888f47e9",
}

_COLD_SEARCH = """
import hashlib, json, sys
from plait.plan import Workload, device, plan, preset
from plait.plan.search import describe
model, work, h100 = preset("llama3-405b"), Workload(8192, 10240), device("h100")
found = plan(model, work, h100, 10240)
text = "\\n".join(
    f"{c.layout!r} {c.timing.tokens_per_s_per_device!r} {c.memory.total!r}" for c in found
)
piped = [c for c in found if c.layout.pp > 1]
print(json.dumps({
    "top": [describe(c.layout) for c in found[:3]],
    "piped": [describe(c.layout) for c in piped[:3]],
    "n": len(found),
    "digest": hashlib.sha256(text.encode()).hexdigest()[:16],
}))
"""


@pytest.fixture(scope="module")
def cold_10240() -> dict[str, object]:
    """The 10,240-GPU search in a fresh process (no cache), timing itself."""
    out = subprocess.run(
        [sys.executable, "-c", _COLD_SEARCH], capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_cold_10240_gpu_search_finds_the_recorded_layouts(cold_10240: dict[str, object]) -> None:
    got = {key: cold_10240[key] for key in RECORDED_10240}
    assert got == RECORDED_10240
    assert (
        describe(Layout(dp_replicate=10, dp_shard=512, tp=2, ac="full")) == RECORDED_10240["top"][0]
    )
