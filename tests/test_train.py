"""``plait train``: every composition trains like one process; resume is exact; bad
configurations are refused before any worker starts.

Runs use a tiny model for a few steps. Multi-process runs call the training loop inside the
harness's gloo workers (the launcher itself is covered by one end-to-end test).
"""

from __future__ import annotations

import functools
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from plait.train import checkpointing
from plait.train.checkpointing import latest_checkpoint, list_checkpoints
from plait.train.cli import build_config, main
from plait.train.config import ConfigError, TrainConfig, load_toml
from plait.train.loop import TrainResult, train
from plait.train.manifest import write_manifest
from plait.train.metrics import read_metrics
from plait.train.resolve import resolve

from harness import run_on_ranks
from train_helpers import TINY, forbid_launch, run_train


def _train_on_rank(cfg: TrainConfig, run_dir: str) -> TrainResult:
    import torch.distributed as dist

    return run_train(cfg, dist.get_world_size(), Path(run_dir))


@functools.cache
def _reference(n_layer: int, tmp: str) -> TrainResult:
    """The single-process run of TINY with ``n_layer`` blocks (cached)."""
    return run_train(TINY.replace(n_layer=n_layer), 1, Path(tmp) / f"reference-{n_layer}")


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("train"))


def _assert_close(actual: list[float], expected: list[float], tol: float) -> None:
    assert len(actual) == len(expected)
    for step, (a, e) in enumerate(zip(actual, expected, strict=True), start=1):
        assert math.isclose(a, e, rel_tol=tol, abs_tol=tol), (step, a, e, actual, expected)


# ----------------------------------------------------------------------------------------
# Every composition trains like one process
# ----------------------------------------------------------------------------------------

COMPOSITIONS: dict[str, dict[str, Any]] = {
    "dp_shard4": {"dp_shard": 4},
    "dp_replicate4": {"dp_replicate": 4},
    "hsdp_2x2": {"dp_replicate": 2, "dp_shard": 2},
    "pp2_dp_shard2_1f1b": {"pp": 2, "dp_shard": 2, "schedule": "1F1B"},
    "pp4_interleaved_1f1b": {"pp": 4, "schedule": "Interleaved1F1B", "n_layer": 8},
    # 4 stages over 2 blocks, the embedding and the head each weighing one: the first stage
    # holds the embeddings alone, the last the final norm and head alone.
    "pp2_interleaved_end_blocks": {
        "pp": 2,
        "dp_shard": 2,
        "schedule": "Interleaved1F1B",
        "n_layer": 2,
        "end_blocks": 1,
    },
    # Two stages per rank, one gathered at a time: each is gathered again when it comes back.
    "pp2_interleaved_one_active_stage": {
        "pp": 2,
        "dp_shard": 2,
        "schedule": "Interleaved1F1B",
        "n_layer": 4,
        "max_active_stages": 1,
    },
    # The V: rank 0 holds the first and the last stage, so neither block.
    "pp2_zbv_end_blocks": {
        "pp": 2,
        "dp_shard": 2,
        "schedule": "ZBVZeroBubble",
        "n_layer": 2,
        "end_blocks": 1,
    },
    "dp_shard4_ac_full": {"dp_shard": 4, "ac": "full"},
    "dp_shard4_offload_keep_gathered": {
        "dp_shard": 4,
        "cpu_offload": True,
        "reshard_after_forward": False,
    },
    "pp2_dp_replicate2_zbv": {"pp": 2, "dp_replicate": 2, "schedule": "ZBVZeroBubble"},
}


@pytest.mark.parametrize("name", sorted(COMPOSITIONS))
def test_composition_matches_single_process(name: str, shared_tmp: str, tmp_path: Path) -> None:
    cfg = TINY.replace(**COMPOSITIONS[name])
    expected = _reference(cfg.n_layer, shared_tmp)
    results = run_on_ranks(4, _train_on_rank, cfg, str(tmp_path))
    for result in results:  # every rank agrees on the global loss
        _assert_close(result.losses, expected.losses, 1e-5)
        assert result.val_losses.keys() == expected.val_losses.keys()
        _assert_close(list(result.val_losses.values()), list(expected.val_losses.values()), 1e-5)


@pytest.mark.parametrize("ac", ["full", "selective", "offload"])
def test_activation_checkpointing_single_process(ac: str, shared_tmp: str, tmp_path: Path) -> None:
    expected = _reference(TINY.n_layer, shared_tmp)
    result = run_train(TINY.replace(ac=ac), 1, tmp_path)
    _assert_close(result.losses, expected.losses, 1e-6)


def _with_divergence_checking(cfg: TrainConfig, run_dir: str) -> tuple[list[float], int]:
    """Train with plait.spmd checking on; the losses, and how many step checks ran."""
    from plait import spmd

    checks = []
    real_check = spmd.check

    def counting_check(where: str = "end of step") -> None:
        checks.append(where)
        real_check(where)

    spmd.enable(timeout=30)
    spmd.check = counting_check
    try:
        losses = _train_on_rank(cfg, run_dir).losses
    finally:
        spmd.check = real_check
        spmd.disable()
    return losses, checks.count("end of a training step")


def test_divergence_checking_changes_nothing(tmp_path: Path) -> None:
    cfg = TINY.replace(pp=2, dp_shard=2, schedule="1F1B")
    plain = run_on_ranks(4, _train_on_rank, cfg, str(tmp_path / "plain"))[0]
    checked = run_on_ranks(4, _with_divergence_checking, cfg, str(tmp_path / "checked"))
    for losses, step_checks in checked:
        assert losses == plain.losses
        assert step_checks == cfg.steps


def test_bf16_trains_close_to_fp32(shared_tmp: str, tmp_path: Path) -> None:
    cfg = TINY.replace(dp_shard=4, mp="bf16")
    expected = _reference(TINY.n_layer, shared_tmp)
    results = run_on_ranks(4, _train_on_rank, cfg, str(tmp_path))
    for result in results:
        assert all(math.isfinite(loss) for loss in result.losses)
        _assert_close(result.losses, expected.losses, 2e-2)


def test_bf16_single_process_uses_autocast(shared_tmp: str, tmp_path: Path) -> None:
    expected = _reference(TINY.n_layer, shared_tmp)
    result = run_train(TINY.replace(mp="bf16"), 1, tmp_path)
    _assert_close(result.losses, expected.losses, 2e-2)


def test_training_lowers_the_loss(tmp_path: Path) -> None:
    cfg = TINY.replace(steps=30, lr=1e-2, warmup=3, eval_every=30)
    result = run_train(cfg, 1, tmp_path)
    assert result.val_losses[30] < result.val_losses[0] - 1.0, result.val_losses


# ----------------------------------------------------------------------------------------
# The run directory
# ----------------------------------------------------------------------------------------


def test_run_directory_contents(shared_tmp: str) -> None:
    run_dir = Path(shared_tmp) / "reference-4"
    _reference(TINY.n_layer, shared_tmp)
    assert (run_dir / "config.json").is_file()
    assert (run_dir / "loss.png").stat().st_size > 0
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 3]
    saved = build_config({"run_dir": str(run_dir), "resume": True})
    assert saved == resolve(TINY.replace(run_dir=str(run_dir), nproc=1, resume=True), 1)


def test_keeps_the_last_checkpoints(tmp_path: Path) -> None:
    run_train(TINY.replace(steps=5, ckpt_every=1, keep=2), 1, tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004", "step_000005"]


# ----------------------------------------------------------------------------------------
# Resume
# ----------------------------------------------------------------------------------------


def test_stop_after_then_resume_continues_exactly(tmp_path: Path) -> None:
    cfg = TINY.replace(steps=6, ckpt_every=0, keep=5, eval_every=3, dropout=0.1)
    full = run_train(cfg, 1, tmp_path / "full")
    stopped = run_train(cfg.replace(stop_after=4), 1, tmp_path / "resumed")
    assert stopped.losses == full.losses[:4]  # the schedule still spans --steps 6
    assert [p.name for p in list_checkpoints(tmp_path / "resumed")] == ["step_000004"]
    resumed = run_train(cfg.replace(resume=True), 1, tmp_path / "resumed")
    assert resumed.start_step == 4
    assert resumed.losses == full.losses[4:]  # bitwise: same weights, moments, data, RNG
    assert resumed.val_losses == {6: full.val_losses[6]}
    records = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records if "loss" in r] == full.losses


def test_stop_after_applies_to_its_session_only(tmp_path: Path) -> None:
    run_train(TINY.replace(stop_after=2), 1, tmp_path)
    assert build_config({"run_dir": str(tmp_path), "resume": True}).stop_after == 0
    again = build_config({"run_dir": str(tmp_path), "resume": True, "stop_after": 2})
    with pytest.raises(ConfigError, match="--stop-after 2: the run is already at step 2"):
        train(again)


def _stop_and_resume(cfg: TrainConfig, run_dir: str, stop: int) -> list[float]:
    first = _train_on_rank(cfg.replace(stop_after=stop), run_dir).losses
    return first + _train_on_rank(cfg.replace(resume=True), run_dir).losses


def test_resume_sharded_run_and_reshard_to_one_process(tmp_path: Path) -> None:
    cfg = TINY.replace(steps=4, ckpt_every=0, keep=5, dp_shard=4)
    full = run_on_ranks(4, _train_on_rank, cfg, str(tmp_path / "full"))[0]
    resumed = run_on_ranks(4, _stop_and_resume, cfg, str(tmp_path / "resumed"), 2)
    for losses in resumed:
        assert losses == full.losses  # same layout: bitwise
    # A checkpoint of the sharded run continued by one process: DCP gathers the shards.
    run_on_ranks(4, _train_on_rank, cfg.replace(stop_after=2), str(tmp_path / "one"))
    one = run_train(cfg.replace(resume=True, dp_shard=0, nproc=0), 1, tmp_path / "one")
    _assert_close(one.losses, full.losses[2:], 1e-5)


class _Killed(Exception):
    pass


def test_killed_save_leaves_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = TINY.replace(steps=4, ckpt_every=2, keep=5)
    real_save = dcp_save
    calls = []

    def dying_save(state: Any, checkpoint_id: str, **kwargs: Any) -> None:
        calls.append(checkpoint_id)
        real_save(state, checkpoint_id=checkpoint_id, **kwargs)
        if len(calls) == 2:  # the second save dies after writing its files
            raise _Killed

    monkeypatch.setattr(checkpointing, "dcp_save", dying_save)
    with pytest.raises(_Killed):
        run_train(cfg, 1, tmp_path)
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000002"
    assert (tmp_path / "checkpoints" / ".tmp-step_000004").is_dir()
    monkeypatch.setattr(checkpointing, "dcp_save", real_save)
    resumed = run_train(cfg.replace(resume=True), 1, tmp_path)
    uninterrupted = run_train(cfg, 1, tmp_path / "uninterrupted")
    assert resumed.losses == uninterrupted.losses[2:]
    assert not (tmp_path / "checkpoints" / ".tmp-step_000004").exists()


def test_loading_refuses_pickled_objects(tmp_path: Path) -> None:
    run_train(TINY.replace(steps=1), 1, tmp_path)
    path = latest_checkpoint(tmp_path)
    assert path is not None
    import os
    import pickle

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("echo pwned",))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ConfigError, match=r"\.metadata: .* the file is (truncated|corrupted)"):
        run_train(TINY.replace(steps=2, resume=True), 1, tmp_path)
    # Even with a manifest rewritten to match, the metadata is not unpickled.
    write_manifest(path)
    with pytest.raises(pickle.UnpicklingError, match=r"posix\.system.*refusing"):
        run_train(TINY.replace(steps=2, resume=True), 1, tmp_path)


# ----------------------------------------------------------------------------------------
# Configuration: TOML, flags, and the refusals
# ----------------------------------------------------------------------------------------


def test_flags_override_toml(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 7\nlr = 1\nschedule = "GPipe"\ndp-shard = 2\n')
    cfg = build_config({"config": str(toml), "steps": 9})
    assert (cfg.steps, cfg.lr, cfg.schedule, cfg.dp_shard) == (9, 1.0, "GPipe", 2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stepz = 3\n", "unknown config key 'stepz'"),
        ('steps = "3"\n', "must be a int"),
        ("[model]\nn_layer = 2\n", "tables"),
        ("steps = \n", "not valid TOML"),
    ],
)
def test_bad_toml_is_refused(tmp_path: Path, text: str, message: str) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_toml(toml)


REFUSED = [
    (["--nproc", "4", "--dp-shard", "3"], "= 3 processes, but 4 will run"),
    (["--nproc", "4", "--pp", "3"], "does not divide the 4 processes"),
    (["--nproc", "4", "--dp-replicate", "2", "--dp-shard", "4"], "--dp-shard 4 x --pp 1 = 8"),
    (
        ["--nproc", "4", "--pp", "4", "--schedule", "Interleaved1F1B", "--n-layer", "4"],
        "8 pipeline stages, but the model has only --n-layer 4",
    ),
    (["--nproc", "4", "--batch-size", "6"], "--batch-size 6 does not split evenly over 4"),
    (
        ["--nproc", "2", "--pp", "2", "--schedule", "DualPipeV", "--microbatches", "2"],
        "DualPipeV over 4 pipeline stages needs at least 4 microbatches",
    ),
    (
        ["--nproc", "2", "--pp", "2", "--batch-size", "8", "--microbatches", "3"],
        "--microbatches 3 does not divide the 8 sequences",
    ),
    (["--nproc", "2", "--pp", "2", "--schedule", "Zigzag"], "--schedule Zigzag: Unknown schedule"),
    (["--nproc", "2", "--pp", "2", "--max-active-stages", "-1"], "-1: must be 0 or more"),
    (
        ["--nproc", "2", "--pp", "2", "--schedule", "Interleaved1F1B", "--stages-per-rank", "1"],
        "interleaves several stages per rank, but --stages-per-rank is 1",
    ),
    (
        ["--nproc", "2", "--pp", "2", "--schedule", "1F1B", "--stages-per-rank", "2"],
        "runs exactly 1 stage(s) per rank",
    ),
    (["--nproc", "2", "--stages-per-rank", "2"], "needs a pipeline"),
    (
        ["--nproc", "2", "--pp", "2", "--schedule", "Interleaved1F1B", "--n-layer", "4"]
        + ["--end-blocks", "3"],
        "--end-blocks 3: each end counts as 3 blocks, more than one of the 4 pipeline stages",
    ),
    (["--nproc", "2", "--pp", "2", "--end-blocks", "-1"], "--end-blocks -1"),
    (["--nproc", "2", "--dp-replicate", "2", "--cpu-offload"], "--cpu-offload"),
    (["--d-model", "30", "--n-head", "4"], "--d-model 30 is not divisible by --n-head 4"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--steps", "5", "--stop-after", "6"], "--stop-after 6 is past --steps 5"),
    (["--fault-timeout", "0"], "--fault-timeout 0.0: must be positive seconds"),
    (["--resume"], "--resume needs --run-dir"),
    (["--data", "/no/such/dir"], "--data /no/such/dir: no such file or directory"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_impossible_configuration_is_refused_before_launch(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    forbid_launch(monkeypatch, "a worker was started for an impossible configuration")
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_cuda_refused_without_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("plait.train.cli.launch", lambda cfg: None)
    assert main(["train", "--device", "cuda"]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err


def test_more_cuda_workers_than_gpus_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    monkeypatch.setattr("plait.train.cli.launch", lambda cfg: None)
    assert main(["train", "--device", "cuda", "--nproc", "2"]) == 2
    assert "--nproc 2 CUDA workers but this machine has 1 GPU(s)" in capsys.readouterr().err


def test_run_directory_is_not_overwritten(
    shared_tmp: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _reference(TINY.n_layer, shared_tmp)
    monkeypatch.setattr("plait.train.cli.launch", lambda cfg: None)
    assert main(["train", "--run-dir", str(Path(shared_tmp) / "reference-4")]) == 2
    assert "add --resume" in capsys.readouterr().err
    empty = Path(shared_tmp) / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert main(["train", "--run-dir", str(empty), "--resume"]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------
# The command itself: the elastic launcher, the progress output, sampling
# ----------------------------------------------------------------------------------------


def test_command_end_to_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    toml = tmp_path / "tiny.toml"
    toml.write_text("seq_len = 32\nn_layer = 2\nn_head = 2\nd_model = 32\nbatch_size = 4\n")
    command = [sys.executable, "-m", "plait", "train", "--config", str(toml), "--nproc", "2"]
    command += ["--steps", "2", "--run-dir", str(run_dir), "--device", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "step 2/2 loss" in done.stderr  # the non-tty progress lines
    assert "median step time" in done.stdout and "peak RSS, rank 1" in done.stdout
    assert (run_dir / "loss.png").is_file()
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step_000002"
    sample = [sys.executable, "-m", "plait", "sample", "--run-dir", str(run_dir)]
    sampled = subprocess.run(
        [*sample, "--prompt", "import ", "--tokens", "20"], capture_output=True, timeout=120
    )
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith(b"import ") and len(sampled.stdout) >= 20


def test_worker_failure_is_reported(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("too short")
    command = [sys.executable, "-m", "plait", "train", "--data", str(empty), "--nproc", "2"]
    command += ["--run-dir", str(tmp_path / "run"), "--device", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 1
    assert "worker 0 failed" in done.stderr or "worker 1 failed" in done.stderr
    assert "give more text" in done.stderr


def test_steps_read_one_step_late_report_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the loop reads a step's loss after queueing the next step
    (``plait.train.loop._Queued``); made to do so on the CPU, the run's records are the
    same steps, losses and norms in the same order, validations and checkpoints after
    their step's record."""
    import plait.train.loop as loop

    cfg = TINY.replace(steps=7, eval_every=4, ckpt_every=5)  # steps 2, 3 and 6 read late

    def records(run_dir: Path) -> list[tuple[Any, ...]]:
        run_train(cfg, 1, run_dir)
        return [
            (r.get("step"), r.get("loss"), r.get("grad_norm"), r.get("val_loss"), r.get("event"))
            for r in read_metrics(run_dir)
        ]

    at_once = records(tmp_path / "at_once")
    original = loop._Queued.__init__

    def lagging(self: Any, *args: Any) -> None:
        original(self, *args)
        self.on_device = True  # read as on a GPU; the values are on the CPU already

    events: list[tuple[str, int]] = []
    queue, read = loop._Session.train_step, loop._Queued.read

    def queued(self: Any, step: int) -> Any:
        events.append(("queue", step + 1))
        return queue(self, step)

    def reading(self: Any) -> Any:
        events.append(("read", self.step))
        return read(self)

    monkeypatch.setattr(loop._Queued, "__init__", lagging)
    monkeypatch.setattr(loop._Session, "train_step", queued)
    monkeypatch.setattr(loop._Queued, "read", reading)
    late = records(tmp_path / "late")
    assert late == at_once
    for step in (2, 3, 6):  # read while the next step is queued
        assert events.index(("queue", step + 1)) < events.index(("read", step)), events
    assert [r[0] for r in late if r[1] is not None] == [1, 2, 3, 4, 5, 6, 7]
