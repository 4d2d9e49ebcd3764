"""``plait train --tp``: tensor parallelism (with and without sequence parallelism) composed
with replicate, fully_shard and pipelines trains like one process; checkpoints of a TP run
resume exactly and load into other layouts; what cannot be split is refused before launch.

A run at ``--tp 2`` must give the losses of the same run in one process (same seed, same
global batch), to float32 rounding: the tp ranks of a data-parallel rank share its batch, and
the loss is averaged over the data-parallel ranks only. Runs use the tiny model of
``test_train.py`` for a few steps, inside the harness's gloo workers.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from plait.train.cli import main
from plait.train.config import TrainConfig
from plait.train.loop import TrainResult, model_config
from plait.train.metrics import read_metrics
from plait.train.model import GPT
from plait.train.parallelize import build_mesh, parallelize
from plait.train.resolve import resolve
from plait.train.sample import load_model

from harness import run_on_ranks
from train_helpers import TINY, forbid_launch, run_train
from train_helpers import assert_losses_close as _assert_close
from train_helpers import train_on_rank as _train_on_rank

#: A few steps with gradient clipping active (the tiny model's gradient norm exceeds 0.5
#: in the first steps), so clipping over DTensor gradients is part of every comparison.
TP_TINY = TINY.replace(grad_clip=0.5)


@functools.cache
def _reference(tmp: str) -> TrainResult:
    """The single-process run of TP_TINY (cached)."""
    return run_train(TP_TINY, 1, Path(tmp) / "reference")


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("train_tp"))


def _assert_trains_like_one_process(results: list[TrainResult], expected: TrainResult) -> None:
    for result in results:  # every rank reports the global loss
        _assert_close(result.losses, expected.losses)
        assert result.val_losses.keys() == expected.val_losses.keys()
        _assert_close(list(result.val_losses.values()), list(expected.val_losses.values()))


# ----------------------------------------------------------------------------------------
# Every layout with --tp trains like one process
# ----------------------------------------------------------------------------------------

#: (world size, layout). The acceptance layouts of issue 15 are the 4-rank ones.
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "tp2": (2, {"tp": 2}),
    "tp2_no_sp": (2, {"tp": 2, "sequence_parallel": False}),
    "tp2_ac_full": (2, {"tp": 2, "ac": "full"}),
    "dp_replicate2_tp2": (4, {"dp_replicate": 2, "tp": 2}),
    "dp_shard2_tp2": (4, {"dp_shard": 2, "tp": 2}),
    "dp_shard2_tp2_no_sp": (4, {"dp_shard": 2, "tp": 2, "sequence_parallel": False}),
    "pp2_tp2_1f1b": (4, {"pp": 2, "tp": 2, "schedule": "1F1B"}),
    "pp2_tp2_interleaved_no_sp": (
        4,
        {"pp": 2, "tp": 2, "schedule": "Interleaved1F1B", "sequence_parallel": False},
    ),
    "tp2_accumulate2": (2, {"tp": 2, "microbatches": 2}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tp_layout_matches_single_process(name: str, shared_tmp: str, tmp_path: Path) -> None:
    world, layout = LAYOUTS[name]
    results = run_on_ranks(world, _train_on_rank, TP_TINY.replace(**layout), str(tmp_path))
    _assert_trains_like_one_process(results, _reference(shared_tmp))


def test_bf16_with_tp_trains_close_to_fp32(shared_tmp: str, tmp_path: Path) -> None:
    cfg = TP_TINY.replace(dp_shard=2, tp=2, mp="bf16")  # fully_shard's bf16 policy over TP
    results = run_on_ranks(4, _train_on_rank, cfg, str(tmp_path))
    for result in results:
        _assert_close(result.losses, _reference(shared_tmp).losses, tol=1e-2)


def _parameter_layouts(cfg: TrainConfig) -> dict[str, tuple[str, ...]]:
    """The placements of this rank's parameters after ``parallelize`` (by name)."""
    cfg = resolve(cfg, dist.get_world_size())
    torch.manual_seed(0)
    model = GPT(model_config(cfg))
    stages = parallelize(model, cfg, build_mesh(cfg))
    return {
        name: tuple(str(p) for p in param.placements) if isinstance(param, DTensor) else ()
        for stage in stages
        for name, param in stage.module.named_parameters()
    }


def test_the_plan_splits_attention_by_heads_and_the_vocabulary() -> None:
    sp = run_on_ranks(2, _parameter_layouts, TINY.replace(tp=2))[0]
    no_sp = run_on_ranks(2, _parameter_layouts, TINY.replace(tp=2, sequence_parallel=False))[0]
    col, row, rep = (str(Shard(0)),), (str(Shard(1)),), (str(Replicate()),)
    for plan in (sp, no_sp):
        for name in ("q", "k", "v"):  # column-wise: output features (heads) split
            assert plan[f"blocks.0.attn.{name}.weight"] == col
        assert plan["blocks.0.attn.proj.weight"] == row  # row-wise: input features split
        assert plan["blocks.0.attn.proj.bias"] == rep
        assert plan["blocks.0.mlp.fc.weight"] == col and plan["blocks.0.mlp.proj.weight"] == row
        assert plan["tok_emb.weight"] == col  # row-wise embedding: vocabulary split
        assert plan["head.weight"] == col  # column-wise head: vocabulary split
    # Sequence parallel: norms replicated DTensors, positions split like the sequence.
    assert sp["blocks.0.ln1.weight"] == rep and sp["ln_f.weight"] == rep
    assert sp["pos_emb.weight"] == col
    # Without: they stay plain parameters (every rank runs them on the whole sequence).
    assert no_sp["blocks.0.ln1.weight"] == () and no_sp["pos_emb.weight"] == ()


def _local_heads_forward() -> tuple[int, ...]:
    """The shape of this rank's q projection output: (B, T, d_model / tp)."""
    cfg = resolve(TINY.replace(tp=2), 2)
    model = GPT(model_config(cfg))
    (stage,) = parallelize(model, cfg, build_mesh(cfg))
    seen: list[tuple[int, ...]] = []
    q = stage.module.blocks[0].attn.q  # type: ignore[union-attr]
    q.register_forward_hook(lambda m, i, out: seen.append(tuple(out.shape)))
    stage.module(torch.zeros(2, cfg.seq_len, dtype=torch.long))
    return seen[0]


def test_attention_runs_the_local_heads() -> None:
    for shape in run_on_ranks(2, _local_heads_forward):
        assert shape == (2, TINY.seq_len, TINY.d_model // 2)  # n_head / tp heads of head_dim


# ----------------------------------------------------------------------------------------
# Checkpoints of a TP run
# ----------------------------------------------------------------------------------------


def _stop_and_resume(cfg: TrainConfig, run_dir: str, stop: int) -> list[float]:
    first = _train_on_rank(cfg.replace(stop_after=stop), run_dir).losses
    return first + _train_on_rank(cfg.replace(resume=True), run_dir).losses


def test_tp_checkpoint_resumes_exactly_and_loads_anywhere(tmp_path: Path) -> None:
    cfg = TP_TINY.replace(steps=4, keep=5, tp=2)
    full = run_on_ranks(2, _train_on_rank, cfg, str(tmp_path / "full"))[0]
    for losses in run_on_ranks(2, _stop_and_resume, cfg, str(tmp_path / "resumed"), 2):
        assert losses == full.losses  # same layout: bitwise (weights, moments, data)
    # The TP checkpoint continued by one process: DCP gathers the TP shards.
    run_on_ranks(2, _train_on_rank, cfg.replace(stop_after=2), str(tmp_path / "one"))
    one = run_train(cfg.replace(resume=True, tp=1, nproc=0, dp_shard=0), 1, tmp_path / "one")
    _assert_close(one.losses, full.losses[2:])
    # ... and read by `plait sample` into a plain model.
    model = load_model(tmp_path / "full" / "checkpoints" / "step_000004")
    assert model.blocks[0].attn.q.weight.shape == (TINY.d_model, TINY.d_model)  # type: ignore[union-attr]


def test_fsdp_tp_checkpoint_continues_at_other_layouts(tmp_path: Path) -> None:
    cfg = TP_TINY.replace(steps=4, keep=5, n_head=4)  # 4 heads: --tp 4 divides them
    expected = run_train(cfg, 1, tmp_path / "one").losses
    saved = cfg.replace(dp_shard=2, tp=2, stop_after=2)  # parameters: (_StridedShard, Shard)
    run_on_ranks(4, _train_on_rank, saved, str(tmp_path / "run"))
    # The same checkpoint continued at three other layouts (each from its own copy).
    layouts = {
        "pp2_tp2": cfg.replace(pp=2, tp=2),  # each rank loads its stage's TP shards
        "tp4": cfg.replace(tp=4),
        "dp4": cfg.replace(dp_shard=4),
    }
    for name, layout in layouts.items():
        shutil.copytree(tmp_path / "run", tmp_path / name)
        resumed = layout.replace(resume=True)
        for result in run_on_ranks(4, _train_on_rank, resumed, str(tmp_path / name)):
            assert result.start_step == 2, name
            _assert_close(result.losses, expected[2:])


# ----------------------------------------------------------------------------------------
# Refused before launch
# ----------------------------------------------------------------------------------------

REFUSED = [
    (["--tp", "3", "--nproc", "3", "--n-head", "4"], "--tp 3 splits the 4 attention heads"),
    (
        ["--tp", "2", "--nproc", "2", "--n-head", "3", "--d-model", "96"],
        "--tp 2 splits the 3 attention heads 2 ways",
    ),
    (
        ["--tp", "2", "--nproc", "2", "--seq-len", "33"],
        "--tp 2 splits each sequence of 33 tokens (sequence parallelism) 2 ways",
    ),
    (
        ["--tp", "3", "--nproc", "3", "--n-head", "6", "--d-model", "96"],
        "--tp 3 splits the vocabulary of 256 byte tokens (embedding and head) 3 ways, but 256 "
        "does not divide by 3: use --tp 2",
    ),
    (["--tp", "2", "--nproc", "4", "--dp-shard", "3"], "--pp 1 x --tp 2 = 6 processes"),
    (["--tp", "0"], "--tp 0: must be at least 1"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_impossible_tp_is_refused_before_launch(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    forbid_launch(monkeypatch, "a worker was started for an impossible --tp")
    assert main(["train", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_tp3_on_four_heads_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    forbid_launch(monkeypatch, "--tp 3 on 4 heads must be refused before launch")
    assert main(["train", "--device", "cpu", "--tp", "3", "--nproc", "3"]) == 2
    err = capsys.readouterr().err
    assert "--tp 3 splits the 4 attention heads 3 ways, but 4 does not divide by 3" in err
    assert "use --tp 2, or set --n-head to a multiple of 3" in err


def test_no_sequence_parallel_lifts_the_sequence_length_rule() -> None:
    cfg = resolve(TINY.replace(tp=2, seq_len=33, sequence_parallel=False), 2)
    assert cfg.mesh_dims == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2}


# ----------------------------------------------------------------------------------------
# The acceptance commands, end to end through the launcher (4 CPU workers)
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout", [["--tp", "2", "--dp-shard", "2"], ["--pp", "2", "--tp", "2"]], ids=" ".join
)
def test_command_trains_with_tp(layout: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    toml = tmp_path / "tiny.toml"
    toml.write_text(
        "seq_len = 32\nn_layer = 2\nn_head = 2\nd_model = 32\nbatch_size = 8\n"
        "steps = 8\nwarmup = 1\nlr = 1e-2\neval_every = 0\neval_batches = 2\n"
    )
    command = [sys.executable, "-m", "plait", "train", "--config", str(toml), *layout]
    command += ["--nproc", "4", "--run-dir", str(run_dir), "--device", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    dims = dict(zip(("pp", "dp_shard"), (2, 1) if "--pp" in layout else (1, 2), strict=True))
    mesh = f"pp={dims['pp']} x dp_replicate=1 x dp_shard={dims['dp_shard']} x tp=2"
    assert f"4 x cpu ({mesh}, sequence parallel)" in done.stdout, done.stdout
    saved = json.loads((run_dir / "config.json").read_text())
    assert (saved["tp"], saved["sequence_parallel"], saved["pp"]) == (2, True, dims["pp"])
    val = [r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0] - 0.3, val  # the loss falls
