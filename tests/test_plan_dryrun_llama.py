"""Dry runs of plait train's Llama-family models (:func:`plait.plan.dryrun.dry_run` builds
what ``plait train --model-config`` builds) against the planner's memory model of them
(SwiGLU, grouped-query attention, RMSNorm, rotary embeddings, head_dim, q/k norms, tied
heads), and ``plait plan --dry-run`` with a Hugging Face config or a preset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plait.plan.devices import device
from plait.plan.dryrun import dry_run
from plait.plan.models import from_hf_config, param_counts
from plait.plan.train_plan import plan_of_config
from plait.train.config import TrainConfig
from plait.train.resolve import resolve

#: A small Llama: grouped-query attention (8 heads, 2 KV heads), a 32,000-token vocabulary
#: (the loss's full-vocabulary tensors are a visible part), untied head.
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "max_position_embeddings": 4096,
    "num_attention_heads": 8,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
#: Qwen3's attention: heads wider than hidden_size / heads, per-head q and k norms, a tied
#: head.
QWEN3 = {
    **LLAMA,
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "head_dim": 64,
    "tie_word_embeddings": True,
    "vocab_size": 4096,
}


def _write(tmp_path: Path, values: dict[str, Any]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    return str(path)


CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {"dp_shard": 4}),
    ("llama", {"dp_shard": 4, "mp": "bf16"}),
    ("llama", {"dp_shard": 4, "ac": "full"}),
    ("llama", {"dp_replicate": 4, "dp_shard": 1}),
    ("llama", {"dp_shard": 2, "tp": 2, "mp": "bf16"}),
    ("qwen3", {"dp_shard": 4, "mp": "bf16"}),
]


@pytest.mark.parametrize(
    ("family", "layout"),
    CASES,
    ids=[f"{f}-" + "-".join(f"{k}={v}" for k, v in lay.items()) for f, lay in CASES],
)
def test_llama_dry_run_within_5_percent_of_prediction(
    tmp_path: Path, family: str, layout: dict[str, Any]
) -> None:
    config = _write(tmp_path, LLAMA if family == "llama" else QWEN3)
    cfg = TrainConfig(model_config=config, seq_len=512, batch_size=8, **layout)
    measured = dry_run(cfg, 4)
    resolved = resolve(cfg.replace(nproc=4, device="cpu"), world_size=4)
    predicted = plan_of_config(resolved, device("h100")).memory.total
    assert predicted == pytest.approx(measured.peak, rel=0.05), (
        f"{family} {layout}: predicted {predicted:,.0f} B, dry run {measured.peak:,.0f} B"
    )


#: A Llama whose matrices do not divide by 96 ranks (512 and 1,376 rows, k and v 128) and a
#: small vocabulary: blocks, not the root, dominate the gathered and reduced buffers.
WIDE = {**LLAMA, "hidden_size": 512, "intermediate_size": 1376, "vocab_size": 512}


def test_dry_run_pads_shards_over_a_group_that_does_not_divide_the_matrices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fully_shard pads each parameter's dim 0 to a multiple of its 96 ranks (plait.plan.
    # shards, "Padding"): ~10% more in the gathered blocks and the reduce-scatter buffers.
    from plait.plan import shards
    from plait.plan.schedule import layout_shape

    config = _write(tmp_path, WIDE)
    cfg = TrainConfig(model_config=config, seq_len=128, batch_size=96, dp_shard=96, mp="bf16")
    measured = dry_run(cfg, 96)
    resolved = resolve(cfg.replace(nproc=96, device="cpu"), world_size=96)
    model = from_hf_config(WIDE)
    rank0 = layout_shape(model, resolved.layout).ranks[0]
    assert shards.shard_padding(model, resolved.layout, rank0).dense > 1.05
    predicted = plan_of_config(resolved, device("h100")).memory.total
    assert predicted == pytest.approx(measured.peak, rel=0.05), (
        f"predicted {predicted:,.0f} B, dry run {measured.peak:,.0f} B"
    )
    monkeypatch.setattr(shards, "shard_padding", lambda *_: shards.ShardPadding())
    unpadded = plan_of_config(resolved, device("h100")).memory.total
    assert unpadded < 0.95 * measured.peak, f"unpadded {unpadded:,.0f} B"


def test_hf_config_counts_head_dim_qk_norms_and_the_tied_head() -> None:
    import torch

    from plait.train.llama import Llama, LlamaConfig

    spec = from_hf_config(QWEN3)
    assert (spec.dim_head, spec.q_width, spec.kv_width, spec.qk_norm) == (64, 512, 128, True)
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_hf(QWEN3), 512)
    built = sum(p.numel() for p in model.parameters())  # the tied matrix once
    assert param_counts(spec).total(spec.layers) == built


def test_plan_command_dry_runs_a_config_and_a_preset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from plait.plan.cli import main

    config = _write(tmp_path, LLAMA)
    args = ["--hf-config", config, "--seq-len", "512", "--gpus", "4", "--device", "cpu"]
    assert main([*args, "--top", "1", "--dry-run"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("dry run of ") and "(rank 0 of 4" in line and "predicted" in line
    change = float(line.rsplit("(", 1)[1].rstrip("%)"))
    assert abs(change) < 5
    # A planner preset with a train preset of its shapes (llama3-8b: llama3.1-8b): fake
    # tensors, so an 8B model at 64 ranks takes no memory.
    preset = ["--preset", "llama3-8b", "--seq-len", "1024", "--gpus", "64", "--top", "1"]
    assert main([*preset, "--dry-run"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("dry run of ") and "(rank 0 of 64" in line
    assert abs(float(line.rsplit("(", 1)[1].rstrip("%)"))) < 5


def test_plan_command_refuses_what_it_cannot_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from plait.plan.cli import main

    # A config's MoE is dry-run (tests/test_plan_moe.py); MoE flags on a dense config
    # describe a model plait train does not build from it: refused.
    dense = _write(tmp_path, LLAMA)
    moe_flags = ["--hf-config", dense, "--experts", "4", "--gpus", "4", "--device", "cpu"]
    assert main([*moe_flags, "--seq-len", "512", "--top", "1", "--dry-run"]) == 2
    assert "from its config.json only" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "gpus", "want", "fixed"),
    [
        ("tiny-mixtral", 2, "--ep 2", "--ep 2"),  # a MoE layout, asked for
        ("tiny-qwen3", 2, "--dp", ""),
        ("llama3-8b", 64, "--dp", ""),
        ("llama3-8b", 64, "--end-blocks 1", "--pp 4 --end-blocks 1"),
    ],
)
def test_plan_of_a_preset_prints_the_train_command_that_builds_it(
    name: str, gpus: int, want: str, fixed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``plait plan --preset`` takes plait train's presets (and the llama3-* names); the
    command it prints builds that very model (``--model-config``, not the GPT's shape
    flags), and plait train accepts it as printed."""
    import argparse
    import shlex

    from plait.plan.cli import main
    from plait.train.cli import add_parsers, build_config
    from plait.train.hf import with_default_model_config

    device_flags = ["--device", "cpu", "--seq-len", "64"] if gpus == 2 else ["--seq-len", "4096"]
    argv_ = ["--preset", name, "--gpus", str(gpus), "--top", "1", *device_flags, *fixed.split()]
    assert main(argv_) == 0
    out = capsys.readouterr().out
    command = next(line.strip() for line in out.splitlines() if "plait train" in line)
    source = "llama3.1-8b" if name == "llama3-8b" else name
    assert f"--model-config {source}" in command and want in command
    assert "--n-layer" not in command and "builds its GPT" not in out
    parser = argparse.ArgumentParser(prog="plait")
    add_parsers(parser.add_subparsers(dest="command"))
    argv = shlex.split(command.replace("--device cuda", "--device cpu"))  # no GPU here
    flags = vars(parser.parse_args(argv[1:]))
    del flags["command"]
    flags.pop("plan", None)
    cfg = resolve(with_default_model_config(build_config(flags)), None)
    assert cfg.model_config == source and cfg.layout.world == gpus
    assert cfg.layout.end_blocks == (1 if "--end-blocks" in fixed else 0)


def test_planner_reads_presets_as_plait_train_builds_them() -> None:
    from plait.plan.models import preset

    mixtral = preset("mixtral-8x7b")
    assert (mixtral.layers, mixtral.experts, mixtral.top_k, mixtral.expert_hidden) == (
        32,
        8,
        2,
        14336,
    )
    assert preset("tiny-qwen3-moe").dense_layers == 1  # Qwen3-MoE's mlp_only_layers [0]
    assert preset("qwen3-30b-a3b").qk_norm and preset("qwen3-30b-a3b").experts == 128
    for old, new in (("llama3-8b", "llama3.1-8b"), ("llama3-405b", "llama3.1-405b")):
        a, b = preset(old), preset(new)
        assert a.source == new and b.source == new
        assert (a.layers, a.d_model, a.heads, a.kv_heads, a.ffn_hidden, a.vocab, a.tied) == (
            b.layers,
            b.d_model,
            b.heads,
            b.kv_heads,
            b.ffn_hidden,
            b.vocab,
            b.tied,
        )
