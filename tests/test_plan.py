"""``plait plan``: the cost model's closed forms, its monotonic sanity, the search, the
command's errors and output. Single process, no communication (the search's timings:
``benchmarks/plan_speed.py``)."""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.plan import (
    Layout,
    PlanError,
    Workload,
    device,
    evaluate,
    from_hf_config,
    gpt,
    plan,
    predict_memory,
    preset,
)
from plait.plan.calibration import CALIBRATION_RUN, calibrate
from plait.plan.cli import main
from plait.plan.comm import communication, link_bandwidth
from plait.plan.memory import activation_elems_per_token
from plait.plan.models import flops_per_token, param_counts
from plait.plan.schedule import pipeline_shape
from plait.plan.timing import EFFICIENCY

LLAMA8 = preset("llama3-8b")
H100 = device("h100")
GIB = 2.0**30


def params(name: str) -> int:
    m = preset(name)
    return param_counts(m).total(m.layers)


# --- models ------------------------------------------------------------------------------


def test_llama_parameter_counts_match_published_sizes() -> None:
    assert params("llama3-8b") == pytest.approx(8.03e9, rel=1e-3)
    assert params("llama3-70b") == pytest.approx(70.55e9, rel=1e-3)
    assert params("llama3-405b") == pytest.approx(405.85e9, rel=1e-3)


def test_gpt_parameter_count_equals_plait_train_model() -> None:
    from plait.train.model import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=3, n_head=4, d_model=64, seq_len=32))
    expected = sum(p.numel() for p in model.parameters())
    spec = gpt(3, 4, 64, seq_len=32)
    assert param_counts(spec).total(spec.layers) == expected


def test_flops_per_token_closed_form() -> None:
    # 6 x (non-embedding parameters + head) + 12 L d T, Llama 3.1 8B at 8192 tokens.
    non_embedding = params("llama3-8b") - 2 * 128256 * 4096 - 33 * 4096  # norms: negligible
    expected = 6 * (non_embedding + 128256 * 4096) + 12 * 32 * 4096 * 8192
    assert flops_per_token(LLAMA8, 8192) == pytest.approx(expected, rel=1e-4)


def test_hf_config_reads_llama_shapes(tmp_path: Path) -> None:
    config = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = from_hf_config(path)
    assert spec.source == str(path)  # what plait train --model-config builds it from
    assert dataclasses.replace(spec, name=LLAMA8.name, source=LLAMA8.source) == LLAMA8
    del config["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size missing"):
        from_hf_config(config)


# --- memory ------------------------------------------------------------------------------


def mem(layout: Layout, batch: int = 16, model: str = "llama3-8b") -> float:
    return predict_memory(preset(model), layout, Workload(8192, batch)).total


def test_fsdp_states_are_sixteen_bytes_per_parameter_over_the_shards() -> None:
    m = predict_memory(LLAMA8, Layout(dp_shard=8), Workload(8192, 16))
    per_rank = params("llama3-8b") / 8
    assert m.params == pytest.approx(4 * per_rank)
    assert m.grads + m.optimizer == pytest.approx(12 * per_rank)


def test_more_tensor_parallelism_means_fewer_parameter_bytes_per_rank() -> None:
    work = Workload(8192, 16)
    sizes = [predict_memory(LLAMA8, Layout(dp_shard=2, tp=tp), work).params for tp in (1, 2, 4)]
    assert sizes[0] > sizes[1] > sizes[2]
    assert sizes[0] / sizes[2] == pytest.approx(4, rel=0.01)  # norms stay whole: about 4x


def test_checkpointing_saves_activations_in_order() -> None:
    work = Workload(8192, 16)
    acts = {
        ac: predict_memory(LLAMA8, Layout(dp_shard=8, ac=ac), work).activations
        for ac in ("none", "selective", "full")
    }
    assert acts["none"] > acts["selective"] > acts["full"]
    # full: the block input only, d bf16 values per token and block, 2 x 8192 tokens.
    assert acts["full"] == pytest.approx(32 * 2 * 8192 * 4096 * 2)


def test_resharding_and_microbatches_trade_memory() -> None:
    assert mem(Layout(dp_shard=8, reshard_after_forward=False)) > mem(Layout(dp_shard=8))
    one = predict_memory(LLAMA8, Layout(dp_shard=8), Workload(8192, 16))
    two = predict_memory(LLAMA8, Layout(dp_shard=8, microbatches=2), Workload(8192, 16))
    assert two.activations == pytest.approx(one.activations / 2)
    assert "accumulated_grads" in two.extra and "accumulated_grads" not in one.extra


def test_pipeline_in_flight_microbatches_come_from_the_simulator() -> None:
    one_f_one_b = pipeline_shape(32, 4, "1F1B", 1, 8)
    assert max(r.in_flight for r in one_f_one_b.ranks) == 4  # rank 0 holds pp microbatches
    assert pipeline_shape(32, 4, "GPipe", 1, 8).ranks[0].in_flight == 8  # all of them
    # 1F1B's bubble: (p - 1) / (m + p - 1) with B = 2F.
    assert one_f_one_b.bubble == pytest.approx(3 / 11)


# --- communication and time ----------------------------------------------------------------


def test_fsdp_all_gather_bytes_and_links() -> None:
    layout, work = Layout(dp_shard=8), Workload(8192, 16)
    load = pipeline_shape(32, 1).ranks[0]
    kinds = {(c.dim, c.op): c for c in communication(LLAMA8, layout, work, H100, load)}
    c = param_counts(LLAMA8)
    root = c.embedding + c.head + c.final_norm
    block = c.block_split + c.block_replicated
    gathered = (root + 2 * 32 * block) * 2 * 7 / 8  # bf16, blocks forward and backward
    assert kinds["dp_shard", "all_gather"].bytes == pytest.approx(gathered)
    assert kinds["dp_shard", "reduce_scatter"].bytes == pytest.approx(
        params("llama3-8b") * 4 * 7 / 8
    )
    assert link_bandwidth("dp_shard", layout, H100) == H100.intra_node_bw
    assert link_bandwidth("dp_shard", Layout(dp_shard=16), H100) == H100.inter_node_bw
    assert link_bandwidth("dp_shard", Layout(dp_shard=2, tp=8), H100) == H100.inter_node_bw


def test_efficiency_is_fitted_to_the_published_calibration_runs() -> None:
    assert calibrate() == pytest.approx(EFFICIENCY, rel=0.01)
    run = CALIBRATION_RUN
    got = evaluate(LLAMA8, run.layout, run.work, H100)
    # One constant over four calibration runs (plait.plan.calibration): torchtitan's eager
    # 8B run (5,762 tokens/s, 34% MFU) is slower than the roofline prices its kernels.
    assert got.timing.tokens_per_s_per_device == pytest.approx(5762, rel=0.5)
    assert 0.3 < got.timing.mfu < 0.55


def test_checkpointing_costs_time_and_pipelines_report_their_bubble() -> None:
    work = Workload(8192, 16)
    none, full = (
        evaluate(LLAMA8, Layout(dp_shard=8, ac=ac), work, H100) for ac in ("none", "full")
    )
    assert full.timing.step_time > none.timing.step_time
    piped = evaluate(LLAMA8, Layout(dp_shard=2, pp=4, microbatches=8), work, H100)
    assert piped.timing.bubble == pytest.approx(3 / 11)


# --- search --------------------------------------------------------------------------------


def test_search_of_1024_gpus_ranks_by_throughput() -> None:
    ranked = plan(LLAMA8, Workload(8192, 1024), H100, 1024)
    speeds = [c.timing.tokens_per_s_per_device for c in ranked]
    assert speeds == sorted(speeds, reverse=True) and len(ranked) > 100
    assert all(c.fits and c.memory.total <= 0.9 * H100.memory for c in ranked)
    assert all(c.layout.world == 1024 and c.layout.tp <= 8 for c in ranked)


def test_fixed_flags_constrain_the_search() -> None:
    ranked = plan(LLAMA8, Workload(8192, 256), H100, 256, tp=4, ac="full")
    assert ranked and all(c.layout.tp == 4 and c.layout.ac == "full" for c in ranked)


def test_errors_name_the_fix() -> None:
    with pytest.raises(PlanError, match="--tp 3 does not divide --gpus 1000"):
        plan(LLAMA8, Workload(8192, 1000), H100, 1000, tp=3)
    with pytest.raises(PlanError, match="does not divide the 8 KV heads"):
        plan(LLAMA8, Workload(8192, 64), H100, 64, tp=16)
    with pytest.raises(PlanError, match=r"fits in no layout.*smallest peak memory per rank is"):
        plan(preset("llama3-405b"), Workload(8192, 8), H100, 8)
    with pytest.raises(PlanError, match="--global-batch 3"):
        plan(LLAMA8, Workload(8192, 3), H100, 8, dp_shard=8)


# --- the command -----------------------------------------------------------------------------


def test_command_json_lists_layouts_with_their_parts(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--preset", "llama3-8b", "--gpus", "64", "--seq-len", "8192", "--json", "--top", "3"]
    assert main(args) == 0
    layouts = json.loads(capsys.readouterr().out)
    assert len(layouts) == 3
    first = layouts[0]
    assert set(first) >= {"layout", "memory", "communication", "bubble", "mfu", "command"}
    assert first["tokens_per_s_per_device"] >= layouts[1]["tokens_per_s_per_device"]
    parts = first["memory"]
    summed = sum(parts[k] for k in ("params", "grads", "optimizer", "unsharded", "activations"))
    assert parts["total"] == pytest.approx(summed + parts["buffers"] + sum(parts["extra"].values()))
    assert {c["dim"] for c in first["communication"]} <= {"dp_shard", "dp_replicate", "tp", "pp"}
    assert first["command"].startswith("plait train --dp-replicate")  # 8 nodes: no --nproc
    assert first["torchrun"].startswith("torchrun --nnodes 8 --nproc-per-node 8")


def test_command_table_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--n-layer", "4", "--d-model", "128", "--gpus", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s/dev" in out and "plait train --nproc 4 --dp-replicate" in out
    assert main(["--preset", "llama3-8b", "--gpus", "1000", "--tp", "3"]) == 2
    assert "--tp 3 does not divide --gpus 1000" in capsys.readouterr().err
    assert main(["--n-layer", "4", "--n-head", "4", "--gpus", "8", "--tp", "8"]) == 2
    assert "does not divide the 4 attention heads" in capsys.readouterr().err


def test_plan_of_a_train_configuration() -> None:
    from plait.plan.train_plan import plan_of_config, plan_summary
    from plait.train.config import TrainConfig
    from plait.train.resolve import resolve

    cfg = resolve(TrainConfig(nproc=4, pp=2, device="cpu", microbatches=4))
    c = plan_of_config(cfg)
    assert (c.layout.pp, c.layout.dp_shard, c.layout.microbatches) == (2, 2, 4)
    assert c.timing.bubble == pytest.approx(1 / 5)  # 1F1B, 2 ranks, 4 microbatches
    assert "tokens/s per device" in plan_summary(cfg)
    tiny = dataclasses.replace(device("cpu"), memory=1024.0)
    assert "will not fit" in plan_summary(cfg, tiny)


def test_plait_command_dispatches_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from plait.cli import main as plait_main

    assert plait_main(["plan", "--preset", "llama3-8b", "--gpus", "8", "--top", "1"]) == 0
    assert "plait train --nproc 8 " in capsys.readouterr().out


def _kept_bytes(block: torch.nn.Module, x: torch.Tensor, checkpointed: bool) -> int:
    """Bytes one block keeps for backward besides its parameters: its input (held by the
    caller), the tensors autograd saves (read from the graph; not for checkpointed blocks,
    where reading them would recompute), and tensors newly alive after forward (what
    selective checkpointing keeps)."""

    def live() -> dict[int, int]:
        found = {}
        for o in gc.get_objects():
            if type(o) is torch.Tensor:
                found[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        return found

    gc.collect()
    before = live()
    out = block(x)
    gc.collect()
    kept = {k: v for k, v in live().items() if k not in before}
    stack, seen = [] if checkpointed else [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in [n for n in dir(fn) if n.startswith("_saved_")]:
            t = getattr(fn, name)
            if isinstance(t, torch.Tensor):
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack += [f for f, _ in fn.next_functions]
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
    skip |= {x.untyped_storage().data_ptr(), out.untyped_storage().data_ptr()}
    return sum(v for k, v in kept.items() if k not in skip) + x.numel() * x.element_size()


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_block_activations_match_what_plait_keeps(ac: str) -> None:
    from plait.train.model import GPT, GPTConfig
    from plait.train.parallelize import _checkpoint

    torch.manual_seed(0)
    layers, heads, width, seq, batch = 2, 4, 64, 128, 4
    model = GPT(GPTConfig(n_layer=layers, n_head=heads, d_model=width, seq_len=seq))
    _checkpoint(model, ac)
    x = torch.randn(batch, seq, width, requires_grad=True)
    measured = _kept_bytes(model.blocks[0], x, checkpointed=ac != "none")
    spec = gpt(layers, heads, width, seq)
    predicted = activation_elems_per_token(spec, Layout(ac=ac)) * batch * seq * 4
    # full checkpointing keeps a few KiB of bookkeeping (RNG states, frames) per block.
    assert measured == pytest.approx(predicted, rel=0.05 if ac == "full" else 0.02)


def test_plait_train_plan_prints_the_plan_before_launching(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import plait.train.cli as train_cli
    from plait.cli import main as plait_main

    launched = []
    monkeypatch.setattr(train_cli, "launch", launched.append)
    flags = ["--nproc", "2", "--device", "cpu", "--run-dir", str(tmp_path / "run")]
    assert plait_main(["train", "--plan", "--n-layer", "2", *flags]) == 0
    err = capsys.readouterr().err
    assert "plan (dp_shard=2 ac=none on cpu): peak memory per rank" in err
    assert "tokens/s per device" in err and len(launched) == 1
    # Without --plan, no prediction; a layout the planner does not model says so.
    assert plait_main(["train", "--n-layer", "2", *flags]) == 0
    assert "peak memory per rank" not in capsys.readouterr().err
    assert plait_main(["train", "--plan", "--ac", "offload", *flags]) == 0
    assert "--plan: no prediction: --plan: --ac offload is not modelled" in capsys.readouterr().err


def test_plait_train_plan_compares_the_prediction_with_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import plait.train.cli as train_cli
    from plait.cli import main as plait_main
    from plait.plan.train_plan import local_device, plan_of_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = {"step": 1, "step_time": 100.0}  # an earlier session's: not this one's
    (run_dir / "metrics.jsonl").write_text(json.dumps(earlier) + "\n")
    launched = []

    def fake_launch(cfg: Any) -> None:  # the session's steps: a slow first, then 2.0, 4.0
        launched.append(cfg)
        rows = [{"step": 1, "step_time": 9.0}, {"step": 1, "val_loss": 5.0}]
        rows += [{"step": 2, "step_time": 2.0}, {"step": 3, "step_time": 4.0}]
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)

    monkeypatch.setattr(train_cli, "launch", fake_launch)
    flags = ["--nproc", "2", "--device", "cpu", "--run-dir", str(run_dir), "--n-layer", "2"]
    assert plait_main(["train", "--plan", *flags]) == 0
    err = capsys.readouterr().err
    predicted = plan_of_config(launched[0], local_device("cpu")).timing
    tokens = launched[0].batch_size * launched[0].seq_len / 3.0 / 2  # median 3 s, 2 ranks
    assert (
        f"plan vs run on cpu: step {predicted.step_time:.3g} s predicted, 3 s measured "
        f"(median of 2 step(s), the first left out), measured / predicted "
        f"{3.0 / predicted.step_time:.2f}x; {predicted.tokens_per_s_per_device:,.0f} tokens/s "
        f"per device predicted, {tokens:,.0f} measured"
    ) in err
    # Without --plan, no comparison.
    assert plait_main(["train", *flags]) == 0
    assert "plan vs run" not in capsys.readouterr().err
