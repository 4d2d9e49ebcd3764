"""``plait train`` under faults: a worker that dies, raises or hangs fails the run fast,
naming its rank, leaving no process behind and its checkpoints intact; damaged
checkpoints and checkpoints of another model are refused before anything is loaded.

The worker faults go through the real command and launcher (2 workers, a tiny model),
injected with the test-only ``PLAIT_TEST_*_RANK_AT_STEP`` variables (plait.train.faults).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plait.train import checkpointing
from plait.train.checkpointing import list_checkpoints, load_checkpoint, verify_checkpoint
from plait.train.cli import main
from plait.train.config import ConfigError
from plait.train.loop import TrainResult, model_config
from plait.train.manifest import MANIFEST, CheckpointDamaged
from plait.train.metrics import read_metrics
from plait.train.model import GPT
from plait.train.optimizer import build_optimizer
from plait.train.sample import load_model

import train_helpers
from train_helpers import forbid_launch, run_train

# ----------------------------------------------------------------------------------------
# Worker faults, through the command
# ----------------------------------------------------------------------------------------

FLAGS = "--nproc 2 --device cpu --seq-len 32 --n-layer 2 --n-head 2 --d-model 32 "
FLAGS += "--batch-size 4 --steps 4 --ckpt-every 2 --eval-every 0 --eval-batches 1"

#: Seconds from a dead or raising worker to the command's exit that still count as "at
#: once": below the default fault timeout (30 s), which a run that waited for its collectives
#: to time out would take, with room for a slow, loaded machine (here it takes 1-3 s).
PROMPT = 25.0


class Finished:
    def __init__(self, done: subprocess.CompletedProcess[str], ended: float, marker: str):
        self.returncode = done.returncode
        self.stderr = done.stderr
        self.ended = ended
        self.marker = marker

    def seconds_after_fault(self) -> float:
        """From the fault injector's report of striking to the command's exit."""
        struck = re.search(r"plait: test fault: .* at (\d+\.\d+)", self.stderr)
        assert struck, self.stderr
        return self.ended - float(struck.group(1))


def _plait_train(run_dir: Path, *flags: str, **env: str) -> Finished:
    """Run ``plait train`` with ``flags`` and ``env`` added; its workers carry a marker in
    their environment, to find any left behind."""
    marker = uuid.uuid4().hex
    command = [sys.executable, "-m", "plait", "train", *FLAGS.split(), "--run-dir", str(run_dir)]
    environment = {**os.environ, "PLAIT_TEST_MARKER": marker, **env}
    done = subprocess.run(
        [*command, *flags], env=environment, capture_output=True, text=True, timeout=180
    )
    return Finished(done, time.time(), marker)


def _processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``marker`` (reads /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environment = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone, or not ours
            continue
        if f"PLAIT_TEST_MARKER={marker}".encode() in environment and state != "Z":
            found.append(int(entry.name))
    return found


def _assert_no_process_left(marker: str) -> None:
    deadline = time.monotonic() + 5  # the launcher's resource tracker exits just after it
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker) == []


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


def test_killed_worker_fails_the_run_and_resume_continues_exactly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    killed = _plait_train(run, PLAIT_TEST_KILL_RANK_AT_STEP="1:3")
    assert killed.returncode == 1, killed.stderr
    assert "worker 1 failed (exit code -9): killed by SIGKILL" in killed.stderr
    assert f"the last checkpoint is {run}/checkpoints/step_000002" in killed.stderr
    assert killed.seconds_after_fault() < PROMPT
    _assert_no_process_left(killed.marker)
    # Its checkpoint is intact and loadable; no half-written one is published.
    assert [p.name for p in list_checkpoints(run)] == ["step_000002"]
    verify_checkpoint(list_checkpoints(run)[0])
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert [step for step, _ in _losses(run)] == [1, 2]

    resumed = _plait_train(run, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    _assert_no_process_left(resumed.marker)
    # The same run uninterrupted, with divergence checking on: the same losses, bitwise.
    uninterrupted = _plait_train(tmp_path / "uninterrupted", PLAIT_CHECK_SPMD="1")
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    assert [step for step, _ in _losses(run)] == [1, 2, 3, 4]
    assert _losses(run) == _losses(tmp_path / "uninterrupted")


def test_raising_worker_shows_its_traceback(tmp_path: Path) -> None:
    raised = _plait_train(tmp_path / "run", PLAIT_TEST_RAISE_RANK_AT_STEP="1:2")
    assert raised.returncode == 1, raised.stderr
    assert "worker 1 failed (exit code 1): RuntimeError: plait: test fault" in raised.stderr
    assert "Traceback (most recent call last)" in raised.stderr
    assert 'faults.py", line' in raised.stderr  # the frame that raised
    assert raised.seconds_after_fault() < PROMPT
    _assert_no_process_left(raised.marker)


def test_hung_worker_fails_the_run_within_the_fault_timeout(tmp_path: Path) -> None:
    hung = _plait_train(
        tmp_path / "run", "--fault-timeout", "3", PLAIT_TEST_HANG_RANK_AT_STEP="1:2"
    )
    assert hung.returncode == 1, hung.stderr
    # Rank 0's collective times out (3 s), it waits 3 s for rank 1 to report, names it.
    assert "worker 0 failed" in hung.stderr and "RankLostError" in hung.stderr
    assert "rank(s) [1] did not answer within 3 s" in hung.stderr
    assert 6 < hung.seconds_after_fault() < 6 + PROMPT  # not the 180 s hang of no timeout
    _assert_no_process_left(hung.marker)


def test_a_slow_first_step_is_not_a_fault(tmp_path: Path) -> None:
    """Until the first step is done a peer may lag far beyond --fault-timeout (compiling,
    loading, ranks starting apart: plait.train.worker.SETUP_TIMEOUT); after it a hang is
    caught within the timeout (test_hung_worker_fails_the_run_within_the_fault_timeout)."""
    first = _plait_train(
        tmp_path / "first",
        "--fault-timeout",
        "2",
        "--steps",
        "2",
        PLAIT_TEST_STALL_RANK_AT_STEP="1:1",
        PLAIT_TEST_STALL_SECONDS="5",
    )
    assert first.returncode == 0, first.stderr


def test_killed_launcher_leaves_no_worker_behind(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    command = [sys.executable, "-m", "plait", "train", *FLAGS.split(), "--steps", "500"]
    launcher = subprocess.Popen(
        [*command, "--run-dir", str(tmp_path / "run")],
        env={**os.environ, "PLAIT_TEST_MARKER": marker},
        stderr=subprocess.PIPE,
        text=True,
    )
    assert launcher.stderr is not None
    for line in launcher.stderr:  # the workers are training once validation is reported
        if line.startswith("step 0: validation loss"):
            break
    assert len(_processes_with(marker)) >= 3  # the launcher and its 2 workers
    launcher.kill()  # SIGKILL: it cannot stop its workers itself
    launcher.wait()
    launcher.stderr.close()
    _assert_no_process_left(marker)


def test_fault_injection_variable_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.train.faults import FaultInjector

    monkeypatch.setenv("PLAIT_TEST_KILL_RANK_AT_STEP", "five")
    with pytest.raises(ValueError, match="expected RANK:STEP"):
        FaultInjector(0)
    monkeypatch.setenv("PLAIT_TEST_KILL_RANK_AT_STEP", "1:5")
    assert FaultInjector(0).fault is None


# ----------------------------------------------------------------------------------------
# Damaged checkpoints
# ----------------------------------------------------------------------------------------

# Smaller still than the other tests' model, with checkpoints at steps 2 and 4.
TINY = train_helpers.TINY.replace(
    seq_len=16, n_layer=2, d_model=16, steps=4, batch_size=4, ckpt_every=2, keep=5
)


def _run(run_dir: Path, **changes: Any) -> TrainResult:
    return run_train(TINY.replace(**changes), 1, run_dir)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainResult]:
    """A finished run with checkpoints at steps 2 and 4 (copied, never damaged)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    return run_dir, _run(run_dir)


@pytest.fixture
def run(trained: tuple[Path, TrainResult], tmp_path: Path) -> Path:
    """A copy of the trained run, to damage."""
    import shutil

    return Path(shutil.copytree(trained[0], tmp_path / "run"))


def _data_file(checkpoint: Path) -> Path:
    return next(checkpoint.glob("*.distcp"))


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:06d}"


def _load(path: Path) -> None:
    model = GPT(model_config(TINY))
    load_checkpoint(path, [model], build_optimizer([model], TINY), "cpu")


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES: dict[str, tuple[Callable[[Path], object], str]] = {
    "truncated": (
        lambda p: _data_file(p).write_bytes(_data_file(p).read_bytes()[:1000]),
        r"__0_0\.distcp: 1000 bytes, but manifest\.json says \d+: the file is truncated",
    ),
    "corrupted": (
        lambda p: _flip_a_byte(_data_file(p)),
        r"__0_0\.distcp: its SHA-256 differs from manifest\.json's: the file is corrupted",
    ),
    "file missing": (lambda p: _data_file(p).unlink(), r"__0_0\.distcp: missing"),
    "metadata corrupted": (
        lambda p: _flip_a_byte(p / ".metadata"),
        r"/\.metadata: its SHA-256 differs",
    ),
    "no manifest": (lambda p: (p / MANIFEST).unlink(), r"has no manifest\.json: it is incomplete"),
    "manifest damaged": (
        lambda p: (p / MANIFEST).write_text('{"files": '),
        r"manifest\.json is damaged \(JSONDecodeError",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_checkpoint_is_refused_naming_the_file(run: Path, damage: str) -> None:
    harm, message = DAMAGES[damage]
    harm(_step(run, 4))
    with pytest.raises(CheckpointDamaged, match=message):
        _load(_step(run, 4))
    _load(_step(run, 2))  # the other checkpoint is untouched
    with pytest.raises(CheckpointDamaged, match=message):
        load_model(_step(run, 4))  # plait sample checks too


def test_resume_falls_back_to_the_previous_intact_checkpoint(
    run: Path, trained: tuple[Path, TrainResult], capsys: pytest.CaptureFixture[str]
) -> None:
    _flip_a_byte(_data_file(_step(run, 4)))
    resumed = _run(run, resume=True)
    err = capsys.readouterr().err
    assert "warning: checkpoint" in err and "the file is corrupted" in err
    assert "falling back to the previous checkpoint" in err
    assert "resuming from" in err and "step_000002 (step 2)" in err
    assert resumed.start_step == 2
    assert resumed.losses == trained[1].losses[2:]  # never the damaged weights
    verify_checkpoint(_step(run, 4))  # saved again, whole


def test_resume_without_an_intact_checkpoint_is_refused(run: Path) -> None:
    _data_file(_step(run, 2)).unlink()
    _flip_a_byte(_step(run, 4) / ".metadata")
    with pytest.raises(ConfigError, match="holds no intact checkpoint: .*corrupted.*missing"):
        _run(run, resume=True)


# ----------------------------------------------------------------------------------------
# A checkpoint of another model
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"d_model": 32}, r"d_model 16 \(this run: --d-model 32\)"),
        ({"n_layer": 3}, r"n_layer 2 \(this run: --n-layer 3\)"),
        ({"n_head": 4, "seq_len": 8}, r"seq_len 16 \(this run: --seq-len 8\), n_head 2"),
    ],
)
def test_checkpoint_of_another_model_is_refused_before_loading(
    run: Path, change: dict[str, int], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("weights were loaded from a checkpoint of another model")

    monkeypatch.setattr(checkpointing, "dcp_load", no_load)
    with pytest.raises(ConfigError, match=rf"saved from a different model: .*{message}"):
        _run(run, resume=True, **change)


def test_command_refuses_another_model_before_launching(
    run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    forbid_launch(monkeypatch, "a worker was started to load a checkpoint of another model")
    assert main(["train", "--run-dir", str(run), "--resume", "--n-layer", "4"]) == 2
    assert "n_layer 2 (this run: --n-layer 4)" in capsys.readouterr().err
