"""``plait train``'s logging: TensorBoard and W&B (offline) receive what metrics.jsonl
holds, a resumed run duplicates no step, the progress display shows MFU, MFU's FLOP count
matches a hand count, and a missing optional package names the extra that installs it.

Runs are tiny single-process ``train`` calls in this process (a few steps, no workers).
"""

from __future__ import annotations

import io
import json
import math
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from plait.train import flops
from plait.train.cli import main
from plait.train.config import ConfigError, TrainConfig
from plait.train.flops import cuda_peak, flops_per_token
from plait.train.loggers import check_logging, require
from plait.train.loop import build_model, model_flops_per_token
from plait.train.metrics import read_metrics
from plait.train.model import GPT, GPTConfig
from plait.train.progress import Progress
from plait.train.resolve import resolve

from train_helpers import TINY, forbid_launch, run_train

#: One device's peak given to the runs, so their MFU is known exactly (no benchmark).
PEAK = 1e12


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> TrainConfig:
    """The runs' configuration: TINY with two blocks, on a small text file (loading the
    default corpus costs more than the runs: these tests check logging, not training)."""
    data = tmp_path_factory.mktemp("data") / "text.py"
    data.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(3000)))
    return TINY.replace(n_layer=2, peak_flops=PEAK, data=str(data))


def _train_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def _close32(a: float, b: float) -> bool:
    """Equal up to float32 rounding (TensorBoard and W&B histories store float32)."""
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


# ----------------------------------------------------------------------------------------
# TensorBoard
# ----------------------------------------------------------------------------------------


def _read_tensorboard(run_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return events


def _assert_tensorboard_matches_metrics(run_dir: Path) -> None:
    events = _read_tensorboard(run_dir)
    records = read_metrics(run_dir)
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time", "val_loss"):
        expected = [(r["step"], r[tag]) for r in records if tag in r]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in expected], (tag, got, expected)
        for (_, value), (_, want) in zip(got, expected, strict=True):
            assert _close32(value, want), (tag, got, expected)
    assert "config/text_summary" in events.Tags()["tensors"]


def test_tensorboard_matches_metrics_and_resume_purges(
    small: TrainConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = small.replace(steps=4, ckpt_every=2, keep=5, eval_every=3, tensorboard=True)
    run_train(cfg.replace(stop_after=3), 1, tmp_path)  # checkpoints after steps 2 and 3
    _assert_tensorboard_matches_metrics(tmp_path)
    assert [e.step for e in _read_tensorboard(tmp_path).Scalars("loss")] == [1, 2, 3]
    # MFU: in every step record, from the model's FLOPs per token and the given peak; in
    # the start note, the progress lines and the summary.
    per_token = model_flops_per_token(cfg)
    for r in _train_records(tmp_path).values():
        assert math.isclose(r["mfu"], r["tokens_per_s"] * per_token / PEAK, rel_tol=1e-12)
    out, err = capsys.readouterr()
    assert "MFU " in out and "(--peak-flops)" in out, out  # the summary's rows
    assert "model FLOPs per token" in err and "| MFU " in err, err
    # A crash after step 3 whose checkpoint was lost: resuming from step 2 retrains step 3
    # (and validates after it again); TensorBoard must show each step once, as
    # metrics.jsonl does.
    shutil.rmtree(tmp_path / "checkpoints" / "step_000003")
    resumed = run_train(cfg.replace(resume=True), 1, tmp_path)
    assert resumed.start_step == 2
    _assert_tensorboard_matches_metrics(tmp_path)
    events = _read_tensorboard(tmp_path)
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("val_loss")] == [0, 3, 4]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2


# ----------------------------------------------------------------------------------------
# Weights & Biases, offline
# ----------------------------------------------------------------------------------------


def _wandb_history(path: Path) -> list[dict[str, float]]:
    """The history rows in a W&B run file (``run-<id>.wandb``): a LevelDB-style log of
    32 KiB blocks, each record a 7-byte header (crc, length, type) and a protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:16]
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}
                )
    return rows


def test_wandb_offline_run_resumes_the_same_run(
    small: TrainConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    home = tmp_path / "wandb-home"
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(home))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "run"
    cfg = small.replace(steps=2, keep=5, wandb=True, wandb_project="plait-test")
    try:
        run_train(cfg.replace(stop_after=1), 1, run_dir)
    except Exception as err:
        if type(err).__module__.startswith("wandb"):
            pytest.skip(f"wandb cannot start its service in this sandbox: {err}")
        raise
    # W&B names a session's offline folder by the second it starts: two sessions within
    # one second would share a folder (no real resume is that quick).
    time.sleep(1.1)
    run_train(cfg.replace(resume=True), 1, run_dir)
    run_id = (run_dir / "wandb_id").read_text().strip()
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), runs
    records = _train_records(run_dir)
    # W&B's service process writes the run files: on a loaded machine the last history
    # row reached the file after finish() returned (CI, once). Read until both are there.
    deadline = time.monotonic() + 20
    while True:
        try:
            rows = [row for r in runs for row in _wandb_history(r / f"run-{run_id}.wandb")]
        except Exception:  # a record half written: read again, until the deadline
            if time.monotonic() > deadline:
                raise
            rows = []
        logged = {int(row["_step"]): row for row in rows if "loss" in row}
        if sorted(logged) == [1, 2] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(logged) == sorted(records) == [1, 2]
    for step, r in records.items():
        for name in ("loss", "lr", "grad_norm", "mfu"):
            assert _close32(logged[step][name], r[name]), (step, name, logged[step], r)


# ----------------------------------------------------------------------------------------
# The progress display
# ----------------------------------------------------------------------------------------


def test_plain_progress_prints_periodic_lines_with_mfu() -> None:
    stream = io.StringIO()  # not a terminal: plain lines
    progress = Progress(40, start=0, stream=stream)
    assert not progress.live
    progress.note("a note")
    for step in range(1, 41):
        progress.update(step, loss=2.5, tokens_per_s=12345.0, mfu=0.0342)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "a note"
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 20  # about every 5% of the run
    assert steps[-1].startswith("step 40/40 loss 2.500 | 12,345 tok/s | MFU 3.42% | ETA ")


def test_rich_progress_on_a_terminal_shows_mfu() -> None:
    pytest.importorskip("rich")
    stream = io.StringIO()
    progress = Progress(10, start=0, stream=stream, live=True)  # as on a terminal
    assert progress.live
    progress.update(1, loss=2.5, tokens_per_s=1000.0, mfu=0.5)
    progress.note("step 1: validation loss 2.4000 [not markup]")
    progress.close()
    text = stream.getvalue()
    assert "MFU 50%" in text and "1,000 tok/s" in text and "1/10" in text, text
    assert "[not markup]" in text


def test_progress_without_rich_falls_back_to_plain_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "rich" or n.startswith("rich.")] + ["rich"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it now fails
    stream = io.StringIO()
    progress = Progress(2, stream=stream, live=True)
    assert not progress.live
    progress.update(2, loss=1.0, tokens_per_s=10.0, mfu=None)
    assert stream.getvalue() == "step 2/2 loss 1.000 | 10 tok/s | MFU - | ETA 0:00\n"


# ----------------------------------------------------------------------------------------
# MFU: FLOPs per token by hand, and the peak table
# ----------------------------------------------------------------------------------------


def test_gpt_flops_per_token_equal_a_hand_count() -> None:
    d, layers, t, vocab = 32, 2, 16, 256
    gpt = GPT(GPTConfig(n_layer=layers, n_head=2, d_model=d, seq_len=t))
    # Per block: 2 LayerNorms (2d each), q k v proj (d*d + d each), fc (d*4d + 4d),
    # proj (4d*d + d); then the final LayerNorm and the head (d*vocab, no bias). The
    # token and position embeddings are lookups: not counted.
    per_block = 2 * 2 * d + 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    n = layers * per_block + 2 * d + d * vocab
    expected = 6 * n + 12 * layers * d * t
    assert flops_per_token(gpt, t) == expected
    tied = GPT(GPTConfig(n_layer=layers, n_head=2, d_model=d, seq_len=t, tie_weights=True))
    assert flops_per_token(tied, t) == expected  # the head is a matmul, tied or not


def test_moe_gpt_counts_only_the_active_experts() -> None:
    d, layers, t, experts, top_k, shared = 32, 2, 16, 4, 2, 1
    cfg = GPTConfig(
        n_layer=layers, n_head=2, d_model=d, seq_len=t, experts=experts, top_k=top_k,
        shared_experts=shared,
    )  # fmt: skip
    hidden = cfg.d_expert
    # Per block: LayerNorms, attention as the dense GPT; the router (d*E), top_k of the E
    # routed SwiGLU experts (3*d*hidden each) and the shared one (3*d*hidden*shared).
    per_block = 2 * 2 * d + 4 * (d * d + d) + d * experts + 3 * d * hidden * (top_k + shared)
    n = layers * per_block + 2 * d + d * 256
    assert flops_per_token(GPT(cfg), t) == 6 * n + 12 * layers * d * t


def test_llama_flops_per_token_equal_a_hand_count(tmp_path: Path) -> None:
    c, layers, heads, kv, head_dim, inner, vocab, t = 32, 2, 4, 2, 16, 64, 300, 16
    config = {
        "model_type": "llama",
        "hidden_size": c,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,  # queries 4 x 16 = 64 wide, not hidden_size
        "intermediate_size": inner,
        "vocab_size": vocab,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    cfg = resolve(TrainConfig(model_config=str(path), seq_len=t, nproc=1, device="cpu"), 1)
    q_width, kv_width = heads * head_dim, kv * head_dim
    # Per block: 2 RMSNorm gains (c each), q, k, v, o (no biases), gate, up, down; then
    # the final norm and the untied head. The embedding is a lookup: not counted.
    per_block = 2 * c + c * q_width + 2 * c * kv_width + q_width * c + 3 * c * inner
    n = layers * per_block + c + c * vocab
    expected = 6 * n + 12 * layers * q_width * t
    assert model_flops_per_token(cfg) == expected
    assert flops_per_token(build_model(cfg), t) == expected  # meta or real: the same


def test_flops_ignore_modules_without_weights_to_multiply() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))
    assert flops_per_token(model, 8) == 6 * (4 * 3 + 3)  # no attention found: no T term


def test_cuda_peak_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flops, "_tf32_allowed", lambda: False)
    assert cuda_peak("NVIDIA H100 80GB HBM3", "bf16") == (989e12, "bf16")
    assert cuda_peak("NVIDIA H200", "bf16") == (989e12, "bf16")
    assert cuda_peak("NVIDIA H100 PCIe", "bf16") == (756e12, "bf16")
    assert cuda_peak("NVIDIA A100-SXM4-80GB", "bf16") == (312e12, "bf16")
    assert cuda_peak("NVIDIA A100-SXM4-80GB", "fp32") == (19.5e12, "fp32")
    monkeypatch.setattr(flops, "_tf32_allowed", lambda: True)
    assert cuda_peak("NVIDIA A100-SXM4-80GB", "fp32") == (156e12, "tf32")
    assert cuda_peak("Tesla T4", "bf16") is None


def test_cpu_peak_is_measured_and_overridable() -> None:
    rate, source = flops.device_peak("cpu", "fp32")
    assert rate > 1e6 and "measured fp32 matmuls" in source
    assert flops.device_peak("cpu", "bf16", override=5e11) == (5e11, "--peak-flops")


# ----------------------------------------------------------------------------------------
# Missing optional packages, bad settings
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "module", "extra"),
    [("--tensorboard", "tensorboard", "train"), ("--wandb", "wandb", "wandb")],
)
def test_missing_package_names_the_extra(
    flag: str,
    module: str,
    extra: str,
    small: TrainConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    hint = f"pip install 'plait[{extra}]'"
    with pytest.raises(ConfigError, match=hint.replace("[", r"\[").replace("]", r"\]")):
        require(flag)
    cfg = small.replace(**{flag[2:]: True})
    with pytest.raises(ConfigError, match=f"{flag} needs the {module} package"):
        check_logging(cfg)
    with pytest.raises(ConfigError, match=f"{flag} needs the {module} package"):
        run_train(cfg, 1, tmp_path / "in-process")  # where the logger opens
    forbid_launch(monkeypatch, "a worker was started without the logging package")
    assert main(["train", flag, "--run-dir", str(tmp_path / "run"), "--device", "cpu"]) == 2
    assert hint in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--peak-flops", "-1"], "--peak-flops -1: must be one device's peak FLOP/s"),
        (["--wandb-mode", "sometimes"], "argument --wandb-mode: invalid choice"),
    ],
)
def test_bad_logging_flags_are_refused(
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    forbid_launch(monkeypatch, "a worker was started for bad logging flags")
    try:
        status = main(["train", *argv, "--run-dir", str(tmp_path), "--device", "cpu"])
    except SystemExit as exit_:  # argparse refuses a bad choice itself
        status = int(str(exit_.code))
    assert status == 2
    assert message in capsys.readouterr().err
