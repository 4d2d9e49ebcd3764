"""The planner's model of context parallelism (``plait plan --cp``, ``--cp-method``).

* Memory: per-token activations fall as ``1 / cp``; parameter, gradient and optimizer
  shards divide over ``dp_shard x cp``; all-gather attention keeps the whole sequence's
  keys and values; no method keeps a mask (linear in the sequence); within 5% of a cp 2
  dry run and of a real 2-rank run of every method.
* Bytes: each method's exchange per step against a hand computation, on the right link.
* The search tries cp only for long sequences; the command line prints the cp bytes,
  refuses a ``--cp`` the sequence or the heads do not divide, and ``plait train --plan``'s
  summary says what cp does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.plan import Layout, Workload, compute_time, evaluate, plan, predict_memory
from plait.plan.cli import main
from plait.plan.comm import DP_SHARD_CP, cp_traffic
from plait.plan.comm_time import cp_exposed, link_seconds
from plait.plan.compute_time import EFFICIENCY, device_scale, stack_scale
from plait.plan.devices import device
from plait.plan.dryrun import dry_run, step_memory
from plait.plan.memory import activation_elems_per_token
from plait.plan.models import gpt, preset
from plait.plan.report import cp_per_step
from plait.plan.roofline import elementwise_seconds, profile
from plait.plan.spec import Software
from plait.plan.stacks import STACKS, compiled, cp_pass_bytes
from plait.plan.timing import interference
from plait.plan.train_plan import config_of_layout, plan_of_config, plan_summary
from plait.train.compiled import compiled_parts
from plait.train.config import TrainConfig
from plait.train.llama.attention import LlamaAttention
from plait.train.llama.config import LlamaConfig
from plait.train.model import Block, GPTConfig
from plait.train.resolve import resolve

from harness import run_on_ranks

LONG = 32768
H100 = device("h100")


@pytest.mark.parametrize("method", ["ring", "allgather", "alltoall"])
def test_activations_per_rank_fall_with_cp(method: str) -> None:
    spec = gpt(2, 16, 2048, LONG)
    work = Workload(seq_len=LONG, global_batch=2, precision="bf16")
    one = predict_memory(spec, Layout(dp_shard=2), work)  # fully_shard on in both
    saved = activation_elems_per_token(spec, Layout(dp_shard=2))  # per token and block
    d = spec.d_model
    for cp in (2, 4):
        layout = Layout(dp_shard=2, cp=cp, cp_method=method)
        mem = predict_memory(spec, layout, work)
        ratio = mem.activations / one.activations
        # every method's output is copied for the output projection (d per token): ring
        # keeps nothing else, all-to-all its head-split q, k, v beside the output (as wide
        # as the local ones without grouped-query attention)
        ring_ratio = (saved + d) / saved / cp
        if method == "allgather":  # plus the gathered keys and values, 2 (cp - 1) d
            assert ratio == pytest.approx((saved + d + 2 * (cp - 1) * d) / saved / cp)
            assert ring_ratio < ratio < 1.5 * ring_ratio  # no mask: close to ring's
        else:
            assert ratio == pytest.approx(ring_ratio)
        assert ratio < 0.6 if cp == 2 else ratio < 0.4
        assert mem.extra["logits"] == pytest.approx(one.extra["logits"] / cp)
        assert mem.total < one.total


@pytest.mark.parametrize("method", ["ring", "allgather", "alltoall"])
def test_cp_activations_are_linear_in_the_sequence(method: str) -> None:
    # No method keeps a sequence-sized mask: twice the sequence, twice the activations.
    spec = gpt(2, 8, 512, 2 * LONG)
    layout = Layout(cp=4, cp_method=method)
    short, long = (
        predict_memory(spec, layout, Workload(seq_len=t, global_batch=1, precision="bf16"))
        for t in (LONG, 2 * LONG)
    )
    assert long.activations == pytest.approx(2 * short.activations)
    assert long.extra["cp_attention"] == pytest.approx(2 * short.extra["cp_attention"])


def test_cp_attention_keeps_what_plait_context_saves() -> None:
    spec = gpt(1, 4, 64, 1024)
    work = Workload(seq_len=1024, global_batch=1, precision="bf16")
    ring, gather, heads = (
        predict_memory(spec, Layout(cp=4, cp_method=m), work)
        for m in ("ring", "allgather", "alltoall")
    )
    alone = predict_memory(spec, Layout(dp_shard=4), work)  # 256 tokens a rank, as bf16
    # 256 local tokens. ring: the local q, k, v, output as without cp, and the output
    # projection's copy of the (batch, heads, tokens, head dim) output: 64 per token
    assert ring.activations == pytest.approx(alone.activations + 256 * 64 * 2)
    # all-gather: the fused blocks save 4 x 256 keys and values of width 64 instead of the
    # local 256; no mask
    assert gather.activations - ring.activations == 256 * (2 * 4 * 64 - 2 * 64) * 2
    # all-to-all: head-split q, k, v and SDPA's output beside the returned one; as wide as
    # ring's local q, k, v, output and copy (no grouped-query attention), no mask
    assert heads.activations == ring.activations
    # in backward: the queries' fp32 gradient, and ring's two key/value blocks and their
    # two fp32 gradient accumulators; all-gather's fp32 accumulators of the gathered keys
    # and values and their gradient in bf16; all-to-all's head-split gradients
    assert ring.extra["cp_attention"] == 256 * 64 * 4 + 2 * (2 * 256 * 64) * (2 + 4)
    assert gather.extra["cp_attention"] == 256 * 64 * 4 + 256 * 4 * 2 * 64 * (4 + 2)
    assert heads.extra["cp_attention"] == 256 * 4 * 64 * 2


def _cp_config(method: str, world: int = 2) -> TrainConfig:
    small = {"n_layer": 2, "n_head": 4, "d_model": 128, "seq_len": 2048, "batch_size": 1}
    plain = TrainConfig(device="cpu", nproc=world, cp=2, dp_shard=1, cp_method=method, **small)
    return resolve(plain, world_size=world)


def _cp_predicted(method: str) -> float:
    return plan_of_config(_cp_config(method), H100).memory.total


@pytest.mark.parametrize("method", ["allgather", "ring", "alltoall"])
def test_cp_dry_run_within_5_percent_of_the_prediction(method: str) -> None:
    # The shard mesh is built before the fake tensors, and every method's attention (the
    # fused kernels, the collectives of the fake process group) runs on fake tensors.
    measured = dry_run(_cp_config(method), 2)
    assert _cp_predicted(method) == pytest.approx(measured.peak, rel=0.05), method


#: A grouped-query Llama (8 query heads, 2 key/value heads), as a Hugging Face config.
GQA_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 512,
    "vocab_size": 512, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
    "hidden_act": "silu",
}  # fmt: skip


@pytest.mark.parametrize("method", ["allgather", "ring", "alltoall"])
def test_grouped_query_llama_dry_run_within_5_percent(method: str, tmp_path: Path) -> None:
    """plait's Llama hands context parallelism its grouped key/value heads: each method's
    memory as the planner counts it (within 2% of a real 2-rank run of each when
    written; ``--ac full`` within 8%)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GQA_LLAMA))
    plain = TrainConfig(
        device="cpu", nproc=2, cp=2, dp_shard=1, cp_method=method, model_config=str(config),
        seq_len=2048, batch_size=2,
    )  # fmt: skip
    cfg = resolve(plain, world_size=2)
    measured = dry_run(cfg, 2)
    predicted = plan_of_config(cfg, H100).memory.total
    assert predicted == pytest.approx(measured.peak, rel=0.05), method


def _real_peaks() -> list[int]:
    return [step_memory(_cp_config(m)).peak for m in ("allgather", "ring", "alltoall")]


def test_cp_real_run_within_5_percent_of_the_prediction() -> None:
    ranks = run_on_ranks(2, _real_peaks, timeout=120)
    measured = [max(peaks) for peaks in zip(*ranks, strict=True)]  # the busier rank
    for method, peak in zip(("allgather", "ring", "alltoall"), measured, strict=True):
        assert _cp_predicted(method) == pytest.approx(peak, rel=0.05), method


def test_shards_divide_over_dp_shard_times_cp() -> None:
    spec = gpt(2, 4, 64, 1024)
    work = Workload(seq_len=1024, global_batch=2, precision="bf16")
    four = predict_memory(spec, Layout(dp_shard=4), work)
    mixed = predict_memory(spec, Layout(dp_shard=2, cp=2), work)
    alone = predict_memory(spec, Layout(cp=2), work)
    whole = predict_memory(spec, Layout(), work)
    for part in ("params", "grads", "optimizer"):
        assert getattr(mixed, part) == pytest.approx(getattr(four, part))
        assert getattr(alone, part) == pytest.approx(getattr(whole, part) / 2)
    c = evaluate(spec, Layout(dp_shard=2, cp=2), work, H100)
    dims = {k.dim for k in c.timing.collectives}
    assert DP_SHARD_CP in dims and "dp_shard" not in dims


def _hand(method: str, cp: int, n: float, width: int, e: int) -> tuple[float, float]:
    """Forward and backward bytes one rank sends per block (the docstring's formulas)."""
    kv = 2 * n * width * e  # a rank's keys and values (GPT: as wide as the queries)
    if method == "allgather":
        return (cp - 1) * kv, (cp - 1) * kv
    if method == "ring":
        return (cp - 1) * kv, (cp - 1) * kv + cp * 2 * n * width * 4  # + fp32 accumulators
    return 4 * n * width * e * (cp - 1) / cp, 4 * n * width * e * (cp - 1) / cp


@pytest.mark.parametrize("method", ["allgather", "ring", "alltoall"])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_cp_bytes_per_step_by_hand(method: str, ac: str) -> None:
    spec = gpt(2, 4, 64, 1024)
    work = Workload(seq_len=1024, global_batch=2, precision="bf16")
    layout = Layout(cp=4, cp_method=method, ac=ac)
    n = 2 * 1024 / 4  # both sequences, a quarter of each
    fwd, bwd = _hand(method, 4, n, 64, 2)
    t = cp_traffic(spec, layout, work)
    assert (t.forward, t.backward) == (pytest.approx(fwd), pytest.approx(bwd))
    c = evaluate(spec, layout, work, H100)
    forwards = 2 if ac == "full" else 1  # checkpointing recomputes the forward's exchange
    assert cp_per_step(c.timing.collectives) == pytest.approx(2 * (forwards * fwd + bwd))
    (k,) = [k for k in c.timing.collectives if k.dim == "cp"]
    assert k.bandwidth == H100.intra_node_bw  # cp x tp = 4 ranks: one node
    across = evaluate(spec, Layout(cp=4, tp=4, cp_method=method, ac=ac), work, H100)
    (k,) = [k for k in across.timing.collectives if k.dim == "cp"]
    assert k.bandwidth == H100.inter_node_bw  # 16 consecutive ranks: two nodes


def test_ring_hides_its_exchange_behind_attention() -> None:
    spec = gpt(2, 8, 512, LONG)
    work = Workload(seq_len=LONG, global_batch=1, precision="bf16")
    ring, gather = (
        evaluate(spec, Layout(cp=4, cp_method=m), work, H100).timing for m in ("ring", "allgather")
    )
    assert cp_per_step(ring.collectives) > cp_per_step(gather.collectives)
    assert ring.step_time < gather.step_time


def test_search_tries_cp_for_long_sequences_only() -> None:
    spec = gpt(4, 8, 512, LONG)
    long = plan(spec, Workload(seq_len=LONG, global_batch=2), H100, 8)
    assert any(c.layout.cp > 1 for c in long)
    assert {c.layout.cp_method for c in long if c.layout.cp > 1} >= {"ring", "allgather"}
    for c in long:
        assert LONG % (2 * c.layout.cp) == 0 and c.layout.world == 8
    short = plan(gpt(4, 8, 512, 4096), Workload(seq_len=4096, global_batch=8), H100, 8)
    assert {c.layout.cp for c in short} == {1}
    asked = plan(gpt(4, 8, 512, 4096), Workload(seq_len=4096, global_batch=8), H100, 8, cp=2)
    assert {c.layout.cp for c in asked} == {2}


ARGS = ["--n-layer", "2", "--n-head", "4", "--d-model", "64", "--seq-len", "1024"]


def test_command_plans_cp_and_reports_its_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--gpus", "4", "--cp", "2", "--cp-method", "ring", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "cp=2/ring" in out and "cp/step" in out and "--cp 2 --cp-method ring" in out
    fixed = ["--dp-shard", "2", "--ac", "none", "--microbatches", "1", "--no-reshard-after-forward"]
    flags = [*ARGS, "--gpus", "4", "--cp", "2", "--cp-method", "ring", *fixed, "--json"]
    assert main(flags) == 0
    (best,) = json.loads(capsys.readouterr().out)
    assert (best["layout"]["cp"], best["layout"]["cp_method"]) == (2, "ring")
    fwd, bwd = _hand("ring", 2, 4 / 2 * 1024 / 2, 64, 2)  # 2 sequences per dp rank, half each
    assert best["cp_bytes_per_step"] == pytest.approx(2 * (fwd + bwd))
    assert {"dim": "cp", "op": "send_recv"}.items() <= best["communication"][-1].items()


def test_command_refuses_a_cp_the_sequence_or_heads_do_not_divide(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seq = ["--n-layer", "2", "--n-head", "4", "--d-model", "64", "--seq-len", "4096"]
    assert main([*seq, "--gpus", "6", "--cp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--cp 3" in err and "does not divide by 6" in err
    heads = ["--n-layer", "2", "--n-head", "6", "--d-model", "96", "--seq-len", "1024"]
    assert main([*heads, "--gpus", "4", "--cp", "4", "--cp-method", "alltoall"]) == 2
    err = capsys.readouterr().err
    assert "--cp-method alltoall" in err and "6 attention heads" in err
    assert main([*heads, "--gpus", "4", "--cp", "4", "--cp-method", "ring"]) == 0
    capsys.readouterr()


def test_train_plan_carries_cp_both_ways() -> None:
    spec = gpt(2, 4, 64, 1024)
    work = Workload(seq_len=1024, global_batch=4, precision="fp32")
    layout = Layout(dp_shard=2, cp=2, cp_method="alltoall")
    cfg = config_of_layout(spec, layout, work)
    assert (cfg.cp, cfg.cp_method) == (2, "alltoall") and cfg.layout == layout
    cfg = TrainConfig(
        nproc=4, device="cpu", n_layer=2, d_model=64, seq_len=1024, batch_size=4, dp_shard=2,
        cp=2, cp_method="ring", microbatches=1, stages_per_rank=1,
    )  # fmt: skip
    summary = plan_summary(cfg)
    assert "cp=2/ring" in summary
    assert "context parallelism: cp=2 (ring), each rank 512 tokens of each sequence" in summary


def test_exchange_moves_the_keys_attention_receives(monkeypatch: pytest.MonkeyPatch) -> None:
    """plait's Llama repeats its key/value heads to the query heads before SDPA, but hands
    them grouped to context parallelism (``repeat_kv`` off, as ``plait train --cp`` sets
    it), with the same output; torchtitan's Llama repeats them: the planner's bytes follow
    (``heads / kv_heads`` times more for torchtitan's), and plait's Ulysses expands
    key/value heads that cp does not divide."""
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=128, vocab_size=32,
    )  # fmt: skip
    seen: list[tuple[int, int]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        seen.append((q.shape[1], k.shape[1]))
        return sdpa(q, k, v, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    attention, x = LlamaAttention(config), torch.randn(2, 8, 64)
    repeated = attention(x)
    attention.repeat_kv = False
    torch.testing.assert_close(attention(x), repeated)
    assert seen == [(4, 4), (4, 1)]
    assert not STACKS["plait"].kv_repeated and STACKS["torchtitan"].kv_repeated

    spec = preset("llama3-8b")  # 32 query heads, 8 key/value heads
    work = Workload(seq_len=LONG, global_batch=1)
    n, e = LONG / 4, 2
    for method in ("allgather", "ring"):
        layout = Layout(cp=4, cp_method=method)
        plait_bytes = cp_traffic(spec, layout, work).forward
        assert plait_bytes == pytest.approx(3 * 2 * n * spec.kv_width * e)
        titan = cp_traffic(spec, layout, work, Software("torchtitan")).forward
        assert titan / plait_bytes == pytest.approx(spec.heads / spec.kv_heads)
    for cp, k in ((4, spec.kv_width), (16, spec.q_width)):  # 8 kv heads: 16 ranks expand
        ulysses = cp_traffic(spec, Layout(cp=cp, cp_method="alltoall"), work)
        tokens = LONG / cp
        assert ulysses.forward == pytest.approx(
            (2 * spec.q_width + 2 * k) * tokens * e * (cp - 1) / cp
        )


def test_torch_allgather_shifts_gradients_and_hides_behind_the_first_block() -> None:
    """torch's context_parallel (torchtitan's stack) gathers again in backward and shifts
    the fp32 key/value gradients cp times; each gather runs beside the first of the cp
    attention blocks and each shift beside the next block's backward."""
    spec = preset("llama3-8b")
    work = Workload(seq_len=LONG, global_batch=1)
    layout = Layout(cp=4, cp_method="allgather")
    titan = Software("torchtitan")
    n, k, e = LONG / 4, spec.q_width, 2  # torchtitan repeats k, v too
    t = cp_traffic(spec, layout, work, titan)
    assert t.forward == pytest.approx(3 * 2 * n * k * e)
    assert t.backward == pytest.approx(t.forward + 4 * 2 * n * k * 4)
    assert (t.forward_calls, t.backward_calls) == (1, 5)
    plait_t = cp_traffic(spec, layout, work)
    assert plait_t.backward == pytest.approx(plait_t.forward)  # plait's: one reduce-scatter

    gather = link_seconds(t.forward, "cp", layout, H100, 1)
    shift = link_seconds(4 * 2 * n * k * 4 / 4, "cp", layout, H100, 1)
    for attention in (0.0, gather * 2, gather * 8):  # none, some, all of it hidden
        fwd, bwd = cp_exposed(spec, layout, work, H100, attention, titan)
        step = attention / 4
        assert fwd == pytest.approx(max(0.0, gather - step))
        want = max(0.0, gather - 2 * step) + 3 * max(0.0, shift - 2 * step) + shift
        assert bwd == pytest.approx(want)
        plain = cp_exposed(spec, layout, work, H100, attention)  # plait's: exposed whole
        assert plain[0] == pytest.approx(link_seconds(plait_t.forward, "cp", layout, H100, 1))


def test_hidden_exchange_slows_the_attention_beside_it() -> None:
    """What of a ring's (or torch's all-gather's) exchange attention hides still holds
    NCCL's thread blocks: ``contention`` of it is added, as for data-parallel collectives;
    an exchange exposed whole adds nothing more."""
    spec = preset("llama3-8b")
    work = Workload(seq_len=LONG, global_batch=1)
    contention = interference(H100)
    for method, software in (("ring", Software()), ("allgather", Software("torchtitan"))):
        layout = Layout(cp=4, cp_method=method)
        t = cp_traffic(spec, layout, work, software)
        total = link_seconds(t.forward, "cp", layout, H100, t.forward_calls)
        attention = total / 2  # hides half of a ring's forward exchange
        bare = cp_exposed(spec, layout, work, H100, attention, software)
        slowed = cp_exposed(spec, layout, work, H100, attention, software, contention)
        assert 0 < bare[0] < total
        assert slowed[0] == pytest.approx(bare[0] + contention * (total - bare[0]))
    whole = Layout(cp=4, cp_method="allgather")  # plait's: nothing hidden
    assert cp_exposed(spec, whole, work, H100, 1.0, None, contention) == cp_exposed(
        spec, whole, work, H100, 1.0
    )


def test_block_merges_cost_what_each_code_moves() -> None:
    """The memory-bound passes of block-wise attention (``plait.plan.stacks``' docstring,
    by hand): none without cp or under Ulysses; torch's eager merges and accumulations
    more than its compiled ones (torchtitan's blocks), Transformer Engine's fused ones as
    torch's compiled all-gather; plait's own, eager, more than any fused code."""
    titan, te, mine = STACKS["torchtitan"], STACKS["megatron-core"], STACKS["plait"]
    for kernels in (titan, te, mine):
        assert cp_pass_bytes(kernels, "ring", 1, 1.0, False) == (0.0, 0.0)
        assert cp_pass_bytes(kernels, "alltoall", 8, 1.0, False) == (0.0, 0.0)
    # torch eager at cp 8, keys repeated: casts 12, seven merges of 38, seven key cats of 8
    eager = cp_pass_bytes(titan, "allgather", 8, 1.0, False)
    assert eager == (12 + 7 * 38 + 7 * 8, 30 + 8 * 46 + 7 * 8)
    fused = cp_pass_bytes(titan, "allgather", 8, 1.0, True)
    assert fused == (7 * 10, 8 * 30)  # one pass per merge; dk, dv added into the shift
    assert cp_pass_bytes(te, "allgather", 8, 1.0, False) == fused
    assert cp_pass_bytes(titan, "ring", 8, 1.0, True)[0] > fused[0]  # the ring's cats stay
    for method in ("ring", "allgather"):
        ours = cp_pass_bytes(mine, method, 8, 0.25, False)
        theirs = cp_pass_bytes(te, method, 8, 0.25, False)
        assert ours[0] > theirs[0] and ours[1] > theirs[1]


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_block_merges_add_their_bandwidth_time(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the whole prediction: a step of plait's Llama 3 8B at cp 4 takes, beyond the
    same step without them, its blocks' merge and accumulation bytes at the roofline's
    bandwidth (forward and backward of every block, one microbatch, no recompute)."""
    spec, cp = preset("llama3-8b"), 4
    work = Workload(seq_len=LONG, global_batch=1)
    layout = Layout(cp=cp, cp_method=method, ac="none")
    priced = evaluate(spec, layout, work, H100).timing.step_time
    monkeypatch.setattr(compute_time, "cp_pass_bytes", lambda *_: (0.0, 0.0))
    unpriced = evaluate(spec, layout, work, H100).timing.step_time
    fwd, bwd = cp_pass_bytes(STACKS["plait"], method, cp, spec.kv_width / spec.q_width, False)
    outputs = LONG / cp * spec.q_width  # the rank's attention output, elements per block
    scale = EFFICIENCY * stack_scale("plait") * device_scale(H100)
    per_block = elementwise_seconds(outputs * (fwd + bwd), profile(H100)) / scale
    assert priced - unpriced == pytest.approx(spec.layers * per_block, rel=0.02)


def test_plait_compile_runs_context_parallel_attention_eagerly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``plait train --compile`` under cp compiles a block's norms and MLP, not its attention
    (``plait.train.compiled``); the planner prices that: rope as eager, no residual fused,
    23 launches, so a step between the eager one and a whole-block compile's."""
    block = Block(GPTConfig(vocab_size=32, seq_len=16, n_layer=1, n_head=2, d_model=16))
    assert block.attn not in compiled_parts(block, context_parallel=True)
    assert compiled_parts(block, context_parallel=False) == [block]
    part = compiled(STACKS["plait"], attention=False)
    assert (part.norm, part.activation, part.rope) == ("fused", "fused", "eager-fp32")
    assert (part.fused_residuals, part.kernels) == (0, 23)

    spec, work = preset("llama3-8b"), Workload(seq_len=LONG, global_batch=1)
    layout = Layout(cp=2, cp_method="ring", ac="none")
    eager = evaluate(spec, layout, work, H100).timing.step_time
    partial = evaluate(spec, layout, work, H100, software=Software(compiled=True))
    monkeypatch.setattr(compute_time, "compiled", lambda kernels, attention=True: compiled(kernels))
    whole = evaluate(spec, layout, work, H100, software=Software(compiled=True))
    assert whole.timing.step_time < partial.timing.step_time < eager
