"""Issue 28, memory side: a published layout that was trained must be predicted to fit.

Each published row (:mod:`benchmarks.published_runs`) is evaluated under its framework's
recipe (:data:`plait.plan.memory.RECIPE_KEEPS`): llm-foundry's MPT (fused cross-entropy,
gradients reduce-scattered every microbatch), Meta's Llama 3 (Megatron-like activations,
ZeRO-2-like gradients, stage outputs freed, one block fewer on the end stages), torchtitan
(plait's runtime with torchtitan's per-op selective checkpointing), Megatron-LM. Then every
mechanism a recipe adds has its own unit test. Single process, seconds.
"""

from __future__ import annotations

import pytest

from benchmarks.plan_published import planner_layout
from benchmarks.published_runs import FOUNDRY, LLAMA3, RUNS, TORCHTITAN, PublishedRun
from plait.plan.memory import (
    RECIPE_KEEPS,
    Keeps,
    activation_elems_per_token,
    predict_memory,
    scores_elems_per_token,
)
from plait.plan.models import gpt, preset
from plait.plan.spec import Layout, Workload

GIB = 2.0**30

#: The recipe each code base's rows run (Megatron rows: planner_layout's own).
RECIPE_OF = {FOUNDRY: "foundry", LLAMA3: "llama3", TORCHTITAN: "torchtitan"}

#: Peak reserved GiB torchtitan's tables state (benchmarks/llama3_h100_202412_torchtitan.md),
#: for the rows without torch.compile or Float8 (which change what is saved).
TITAN_PEAKS = {"torchtitan T1 8B FSDP 8": 82.4, "torchtitan T3 8B FSDP 128": 67.0}

#: Rows the memory model cannot yet place within the device, with the reason.
KNOWN = {
    "Llama 3 405B, 8,192 GPUs, seq 8,192": (
        "32 microbatches of plait's Interleaved1F1B over 8 one-block stages per rank hold "
        "143 stage-microbatches on rank 0 (predicted 79 GiB); Meta's schedule, its number of "
        "consecutive microbatches N tuned (not stated), holds fewer"
    ),
}


def _predicted_gib(run: PublishedRun) -> float:
    name = RECIPE_OF.get(run.code_base)
    keeps = RECIPE_KEEPS[name] if name else None
    return predict_memory(run.model, planner_layout(run), run.work, keeps=keeps).total / GIB


def _ran(run: PublishedRun) -> bool:
    """A row whose layout is as it ran (not one the data contradicts)."""
    return not run.excluded.startswith("Table 4")


@pytest.mark.parametrize("run", [r for r in RUNS if _ran(r)], ids=lambda r: r.name)
def test_every_trained_layout_fits_its_device(run: PublishedRun) -> None:
    if run.name in KNOWN:
        pytest.xfail(KNOWN[run.name])
    assert _predicted_gib(run) <= 0.9 * run.memory_gib, run.name


def test_compiled_torchtitan_rows_held_out_sit_below_their_peaks() -> None:
    """The held-out H200 rows (Trainy, June 2025: blocks and loss compiled, Float8
    all-gathers) state 47.96 and 46.97 GiB reserved: predicted below and within 25%, as
    above. Priced with an eager loss (fp32 full-vocabulary tensors) they were 59.9 and
    58.5 GiB, above."""
    holdout = pytest.importorskip("benchmarks.published_holdout")
    peaks = {"32 GPUs": 47.96, "64 GPUs": 46.97}
    rows = [r for r in holdout.HOLDOUT if "(Trainy)" in r.name]
    assert len(rows) == 2 and all(r.software.compiled_loss for r in rows)
    for run in rows:
        peak = next(p for key, p in peaks.items() if key in run.name)
        keeps = RECIPE_KEEPS["torchtitan"]
        layout = planner_layout(run)
        got = predict_memory(run.model, layout, run.work, keeps=keeps, software=run.software)
        assert 0.75 * peak <= got.total / GIB < peak, (run.name, got.total / GIB, peak)


def test_torchtitan_predictions_sit_below_the_stated_peaks() -> None:
    """Reserved memory (what torchtitan prints) exceeds allocated memory (what the model
    predicts) by the allocator's cache and fragmentation and by CUDA and NCCL workspaces,
    typically 5 to 20% on these runs; so the prediction must be below the stated peak and
    within 25% of it."""
    for run in RUNS:
        if run.name in TITAN_PEAKS:
            got, peak = _predicted_gib(run), TITAN_PEAKS[run.name]
            assert 0.75 * peak <= got < peak, (run.name, got, peak)


def test_torchtitan_rows_with_compile_or_float8_are_below_their_peaks() -> None:
    peaks = {"T2": 83.9, "T4": 71.9, "T5 405B PP 8 x FSDP 8 x TP 8, 1F1B": 82.5}
    for run in RUNS:
        for key, peak in peaks.items():
            if run.code_base == TORCHTITAN and run.name.startswith(f"torchtitan {key}"):
                assert _predicted_gib(run) < peak, run.name


LLAMA8 = preset("llama3-8b")
W = Workload(4096, 8)


def test_materialized_scores_add_heads_by_sequence_per_token() -> None:
    layout = Layout(dp_shard=8, ac="none")
    flash, materialized = Keeps(), Keeps(attention="materialized")
    assert scores_elems_per_token(LLAMA8, layout, W, flash) == 0
    assert scores_elems_per_token(LLAMA8, layout, W, materialized) == LLAMA8.heads * 4096
    a = predict_memory(LLAMA8, layout, W, keeps=flash)
    b = predict_memory(LLAMA8, layout, W, keeps=materialized)
    tokens = 4096 * 8 / 8
    expected = tokens * LLAMA8.layers * LLAMA8.heads * 4096 * 2  # bf16 probabilities
    assert b.activations - a.activations == pytest.approx(expected)
    # Under full checkpointing only the block being recomputed holds them.
    full = Layout(dp_shard=8, ac="full")
    c = predict_memory(LLAMA8, full, W, keeps=flash)
    d = predict_memory(LLAMA8, full, W, keeps=materialized)
    assert c.activations == d.activations
    assert d.extra["recompute"] - c.extra["recompute"] == pytest.approx(expected / LLAMA8.layers)


def test_fused_cross_entropy_keeps_no_fp32_logits() -> None:
    layout = Layout(dp_shard=8)
    torch_ce = predict_memory(LLAMA8, layout, W, keeps=Keeps()).extra["logits"]
    fused = predict_memory(LLAMA8, layout, W, keeps=Keeps(loss="fused_ce")).extra["logits"]
    n, v, d = 4096 * 8 / 8, LLAMA8.vocab, LLAMA8.d_model
    head_input = n * d * (2 + 2)
    # The saved fp32 log-probabilities, and at their peak beside them the loss backward's
    # two fp32 gradients (more than the forward's bf16 logits and their fp32 copy).
    assert torch_ce - head_input == pytest.approx(n * v * (4 + 4 + 4))
    assert fused - head_input == pytest.approx(n * v * (2 + 2))  # logits and their gradient


def test_one_moment_optimizer_halves_the_state() -> None:
    layout = Layout(dp_shard=8)
    adamw = predict_memory(LLAMA8, layout, W, keeps=Keeps())
    lion = predict_memory(LLAMA8, layout, W, keeps=Keeps(moments=1))
    assert lion.optimizer == pytest.approx(adamw.optimizer / 2)
    assert lion.params == adamw.params
    with pytest.raises(ValueError):
        Keeps(moments=3)


def test_sharded_accumulation_keeps_no_unsharded_gradients() -> None:
    mpt = gpt(48, 64, 7168, 2048, vocab=50368, tied=True)
    layout = Layout(dp_shard=32, microbatches=3, ac="full")
    work = Workload(2048, 1344)
    fsdp2 = predict_memory(mpt, layout, work, keeps=Keeps())
    foundry = predict_memory(mpt, layout, work, keeps=RECIPE_KEEPS["foundry"])
    assert fsdp2.extra["accumulated_grads"] / GIB > 100  # plait: set_requires_gradient_sync
    assert "accumulated_grads" not in foundry.extra
    assert foundry.total / GIB < 0.9 * 80


@pytest.mark.parametrize(
    ("recipe", "layout"),
    [("foundry", {"dp_shard": 8}), ("megatron", {"dp_shard": 8}), ("plait", {"dp_replicate": 8})],
)
def test_accumulated_gradients_are_alive_through_the_next_microbatch(
    recipe: str, layout: dict[str, int]
) -> None:
    # Gradients accumulated where they live (in their shards, or without fully_shard) are
    # all alive through the second microbatch's backward: the peak grows by them, once.
    # (Counting them only at the step's end left them out of every backward moment.)
    mpt = gpt(24, 16, 2048, 16384, vocab=50368, tied=True)
    keeps = RECIPE_KEEPS[recipe]
    one = predict_memory(mpt, Layout(**layout), Workload(16384, 8), keeps=keeps)
    two = predict_memory(mpt, Layout(**layout, microbatches=2), Workload(16384, 16), keeps=keeps)
    assert "accumulated_grads" not in two.extra
    assert two.total == pytest.approx(one.total + two.grads, rel=1e-9)


def test_llama3_recipe_frees_stage_outputs_and_thins_end_stages() -> None:
    l405 = preset("llama3-405b")
    layout = Layout(dp_shard=128, tp=8, pp=16, microbatches=16, reshard_after_forward=False)
    work = Workload(8192, 16 * 128)
    megatron = Keeps(activations="megatron", sharded_accumulation=True)
    llama3 = RECIPE_KEEPS["llama3"]
    a = predict_memory(l405, layout, work, keeps=megatron)
    b = predict_memory(l405, layout, work, keeps=llama3)
    assert b.activations < a.activations
    per_token = activation_elems_per_token(l405, layout, keeps=llama3)
    assert per_token == activation_elems_per_token(l405, layout, keeps=megatron)


def test_torchtitan_selective_keeps_every_other_matmul() -> None:
    layout = Layout(dp_shard=8, ac="selective")
    d, f = LLAMA8.d_model, LLAMA8.ffn_hidden
    k = LLAMA8.kv_heads * (d // LLAMA8.heads)
    titan = activation_elems_per_token(LLAMA8, layout, keeps=RECIPE_KEEPS["torchtitan"])
    assert titan == d + d + k + d + f + d  # input, wq, wv, attention out, w1, w2
    assert titan < activation_elems_per_token(LLAMA8, layout, keeps=Keeps())
