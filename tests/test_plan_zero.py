"""ZeRO-1/2 data parallelism and Megatron-LM's activations: planner flavours for published
runs (:class:`plait.plan.spec.PlanLayout`), which plait train does not run."""

from __future__ import annotations

import pytest

from plait.layout import Layout
from plait.plan import spec
from plait.plan.comm import ZERO, communication, ring
from plait.plan.devices import device
from plait.plan.memory import activation_elems_per_token, predict_memory
from plait.plan.models import preset
from plait.plan.schedule import layout_shape
from plait.plan.search import PlanError, describe, plan
from plait.plan.shards import rank_params
from plait.plan.spec import PlanLayout, Workload

GIB = 2.0**30
L405 = preset("llama3-405b")
W405 = Workload(8192, 2048, "bf16")  # Meta's 16M tokens per step


def _meta(zero: int = 0, recipe: str = "plait", ac: str = "none") -> PlanLayout:
    # Llama 3 405B as Meta trained it at 8K: TP 8, PP 16, DP 128, no checkpointing.
    fixed = {"dp_replicate": 128, "tp": 8, "pp": 16, "microbatches": 16}
    return PlanLayout(**fixed, ac=ac, zero=zero, recipe=recipe)


def test_megatron_activations_are_korthikanti_without_the_attention_scores() -> None:
    # Korthikanti et al. 2022, sequence parallelism, no recompute: s b h (34 / t + 5 a s /
    # (h t)) bytes per layer. Flash attention drops 5 a s / (h t); a Llama block has no
    # dropout masks (2 of the 34), GQA's k, v are k wide, SwiGLU's MLP f wide (fused:
    # input 2f, output f). Per token, in bf16 bytes: (12 d + 4 k + 6 f) / t.
    d, f, k, t = L405.d_model, L405.ffn_hidden, 1024, 8
    elems = activation_elems_per_token(L405, _meta(recipe="megatron"))
    assert 2 * elems == pytest.approx((12 * d + 4 * k + 6 * f) / t)
    # A GPT-3 block (k = d, GELU of 4 d, no dropout) gives 32 of Korthikanti's 34.
    gpt3 = spec.ModelSpec("gpt3", 96, 12288, 96, 96, 4 * 12288, 50257, gated=False)
    per = 2 * activation_elems_per_token(gpt3, PlanLayout(tp=8, recipe="megatron"))
    assert per == pytest.approx(12288 * 32 / 8)
    # Selective recomputation (core attention) saves nothing more under flash attention.
    selective = _meta(recipe="megatron", ac="selective")
    assert activation_elems_per_token(L405, selective) == elems
    # plait's own recipe keeps the all-gathered linear inputs: twice as much here.
    assert activation_elems_per_token(L405, _meta()) > 1.9 * elems


def test_405b_tp8_pp16_without_checkpointing_as_meta_ran_it() -> None:
    before = predict_memory(L405, _meta(zero=1), W405).total / GIB
    zero1 = predict_memory(L405, _meta(zero=1, recipe="megatron"), W405).total / GIB
    zero2 = predict_memory(L405, _meta(zero=2, recipe="megatron"), W405).total / GIB
    assert before > 150  # plait's recipe
    assert 80 < zero1 < 90  # 64 GiB of activations, 6.4 bf16 parameters, 12.9 fp32 grads
    assert zero2 < 0.9 * 80  # gradients sharded too: fits an 80 GiB device


def test_zero_memory_parts() -> None:
    work = Workload(8192, 256, "bf16")
    model = preset("llama3-8b")
    base = PlanLayout(dp_replicate=8, tp=2)
    load = layout_shape(model, base).ranks[0]
    p = rank_params(model, base, load).total
    for stage in (1, 2):
        m = predict_memory(model, PlanLayout(dp_replicate=8, tp=2, zero=stage), work)
        assert m.params == pytest.approx(2 * p)  # bf16, replicated
        assert m.optimizer == pytest.approx(12 * p / 8)  # fp32 master and moments, sharded
        assert m.grads == pytest.approx(4 * p / (8 if stage == 2 else 1))
        assert m.unsharded == 0  # no autocast cache: the model is kept in bf16
    plain = predict_memory(model, Layout(dp_replicate=8, tp=2), work)
    assert predict_memory(model, PlanLayout(dp_replicate=8, tp=2, zero=1), work).total < (
        plain.total
    )


def test_zero_collectives_are_an_all_reduce_split_in_two_on_their_own_dim() -> None:
    model, work, h100 = preset("llama3-8b"), Workload(8192, 64, "bf16"), device("h100")
    layout = PlanLayout(dp_replicate=8, tp=8, zero=1)
    load = layout_shape(model, layout).ranks[0]
    out = {(c.dim, c.op): c for c in communication(model, layout, work, h100, load)}
    assert ("dp_replicate", "all_reduce") not in out
    p = rank_params(model, layout, load).total
    assert out[(ZERO, "reduce_scatter")].bytes == pytest.approx(4 * p * ring("all_gather", 8))
    assert out[(ZERO, "all_gather")].bytes == pytest.approx(2 * p * ring("all_gather", 8))
    assert out[(ZERO, "all_gather")].bandwidth == h100.inter_node_bw  # 64 ranks: across nodes
    # ZeRO-2 with gradient accumulation reduces every microbatch.
    acc = PlanLayout(dp_replicate=8, tp=8, zero=2, microbatches=4)
    load = layout_shape(model, acc).ranks[0]
    out2 = {(c.dim, c.op): c for c in communication(model, acc, work, h100, load)}
    assert out2[(ZERO, "reduce_scatter")].bytes == pytest.approx(
        4 * out[(ZERO, "reduce_scatter")].bytes
    )


def test_zero_is_searched_only_when_asked() -> None:
    model, work, h100 = preset("llama3-8b"), Workload(8192, 64), device("h100")
    plain = plan(model, work, h100, 64, dp_shard=1)
    assert not any(isinstance(c.layout, PlanLayout) for c in plain)
    zero = plan(model, work, h100, 64, dp_shard=1, zero=1)
    zeroed = [c for c in zero if spec.zero_stage(c.layout) == 1]
    assert zeroed and all(c.layout.dp_shard == 1 for c in zeroed)
    assert "zero=1" in describe(zeroed[0].layout)
    with pytest.raises(PlanError, match="--dp-shard 1"):
        plan(model, work, h100, 64, dp_shard=8, zero=2)
    with pytest.raises(ValueError, match="--zero 3"):
        PlanLayout(zero=3)


def test_plan_command_says_zero_is_for_other_frameworks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from plait.plan.cli import main

    args = ["--preset", "llama3-8b", "--gpus", "64", "--dp-shard", "1", "--tp", "8"]
    assert main([*args, "--zero", "1", "--recipe", "megatron", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "recipe=megatron" in out and "plait train does not run them" in out
