"""``plait train --max-restarts``: a killed worker restarts the job from the latest intact
checkpoint, and the run ends with the losses and weights of an uninterrupted one.

Through the real command and launchers (plait's own, and torchrun), 2 workers of a tiny
model sharded over both (fully_shard: DTensor checkpoints), faults injected with the
test-only ``PLAIT_TEST_*`` variables (plait.train.faults); every run has a deadline and a
failed one shows its stderr. The pieces (restart rows, the torchrun checks, what a
restarted session keeps of metrics.jsonl) are tested without processes.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plait.train.checkpointing import latest_checkpoint, list_checkpoints, load_weights
from plait.train.config import ConfigError, TrainConfig
from plait.train.faults import FaultInjector
from plait.train.loop import model_config
from plait.train.metrics import MetricsLog, read_metrics
from plait.train.model import GPT
from plait.train.report import summary_table
from plait.train.restart import (
    UNSHARED_STORE,
    check_torchrun_restarts,
    restart_record,
    restart_summary,
    restarted,
)
from plait.train.snapshots import SNAPSHOT_DIR, latest_snapshot

from harness import run_on_ranks

FLAGS = "--device cpu --seq-len 32 --n-layer 2 --n-head 2 --d-model 32 --batch-size 4 "
FLAGS += "--steps 6 --ckpt-every 2 --keep 5 --eval-every 0 --eval-batches 1"
MODEL = TrainConfig(seq_len=32, n_layer=2, n_head=2, d_model=32, vocab_size=256)
DEADLINE = 180  # seconds a whole run may take (a few, on a loaded machine)


def plait_train(
    run_dir: Path, *flags: str, torchrun: bool = False, **env: str
) -> subprocess.CompletedProcess[str]:
    """``plait train`` of 2 workers with ``flags`` and ``env`` added; fails the test, with
    the command's output, if it does not succeed."""
    command = [sys.executable, "-m", "plait", "train", "--nproc", "2"]
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", "2", "--max-restarts", "1", "-m", "plait", "train"]
    command += [*FLAGS.split(), "--run-dir", str(run_dir), *flags]
    done = subprocess.run(
        command, env={**os.environ, **env}, capture_output=True, text=True, timeout=DEADLINE
    )
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


def restart_rows(run_dir: Path) -> list[dict[str, object]]:
    return [r for r in read_metrics(run_dir) if r.get("event") == "restart"]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of the run's last checkpoint, gathered into one process's model."""
    path = latest_checkpoint(run_dir)
    assert path is not None and path.name == "step_000006"
    model = GPT(model_config(MODEL))
    load_weights(path, model)
    return model.state_dict()


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Bitwise the uninterrupted run's losses and final weights."""
    assert [step for step, _ in losses(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert losses(run_dir) == losses(reference)
    mine, theirs = final_weights(run_dir), final_weights(reference)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run without faults (synchronous checkpoints)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    plait_train(run_dir)
    return run_dir


def test_killed_worker_restarts_and_ends_like_the_uninterrupted_run(
    tmp_path: Path, uninterrupted: Path
) -> None:
    # Rank 1 dies in step 4's forward: rank 0 has logged step 3, past the checkpoint of 2.
    done = plait_train(tmp_path, "--max-restarts", "1", PLAIT_TEST_KILL_RANK_AT_STEP="1:4")
    assert "rank 1 kills in step 4" in done.stderr
    restart = "restart 1 of 1 (--max-restarts) after a failed worker: continuing from step 2"
    assert f"{restart}; step 3 redone" in done.stderr
    assert_same_run(tmp_path, uninterrupted)
    [row] = restart_rows(tmp_path)
    assert row["step"] == 2 and row["restart"] == 1
    assert row["redone"] == [3, 3] and row["redone_steps"] == 1
    assert re.search(r"\nrestarts +1: step 3 redone \(1 in all, ", done.stdout), done.stdout


def test_a_restart_continues_from_the_snapshot_in_memory(
    tmp_path: Path, uninterrupted: Path
) -> None:
    # Snapshots after every step, no checkpoint before the last: rank 1 dies in step 5's
    # forward, and the restart continues from the snapshot of step 4, nothing redone.
    flags = ("--max-restarts", "1", "--ckpt-every", "0", "--snapshot-every", "1")
    done = plait_train(tmp_path, *flags, PLAIT_TEST_KILL_RANK_AT_STEP="1:5")
    assert "restart 1 of 1 (--max-restarts) after a failed worker: continuing from step 4\n" in (
        done.stderr
    )
    assert_same_run(tmp_path, uninterrupted)
    [row] = restart_rows(tmp_path)
    assert row["step"] == 4 and row["redone_steps"] == 0
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000006"]
    assert latest_snapshot(tmp_path) is None  # removed as the run ended
    assert re.search(r"\nsnapshots +\d+ sync, training waited", done.stdout), done.stdout


def two_machines(
    tmp_path: Path, name: str, second: dict[str, str] | None = None, **env: str
) -> Path:
    """``plait train`` under two torchrun agents, as two machines of one worker each (each
    its own snapshot directory, PLAIT_SNAPSHOT_DIR), snapshotting every step and
    checkpointing only at the end, ``env`` in both agents' environment and ``second`` in
    the second's only; its run directory. Fails the test, with the agents' output, if
    either fails."""
    run_dir = tmp_path / name
    with socket.socket() as probe:  # a free port for the agents' rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    command += ["--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d"]
    command += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name]
    command += ["-m", "plait", "train", *FLAGS.split(), "--run-dir", str(run_dir)]
    command += ["--ckpt-every", "0", "--snapshot-every", "1"]
    agents = [
        subprocess.Popen(
            command,
            env={
                **os.environ,
                UNSHARED_STORE: "1",
                **env,
                **((second or {}) if i else {}),
                SNAPSHOT_DIR: str(run_dir) + f"-{i}",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]
    try:
        outputs = [agent.communicate(timeout=DEADLINE)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    for agent, output in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, output
    for i in (0, 1):  # each machine's first rank removed its snapshots at the end
        assert list(Path(str(run_dir) + f"-{i}").rglob("*.pt")) == []
    (run_dir / "agents.log").write_text("".join(outputs))
    return run_dir


def test_two_machines_restart_from_their_snapshots(tmp_path: Path) -> None:
    """Rank 1 dies in step 5, and its machine comes back empty (replaced): both agents
    restart their workers (the other one without counting a restart: torch's agent does
    not count a new rendezvous), rank 0 continues from its machine's snapshot of step 4 and
    rank 1 from the copy of its file that rank 0's machine keeps, as the uninterrupted run
    of the same two machines trains (one thread per worker there, so not bitwise the
    2-worker launch's)."""
    reference = two_machines(tmp_path, "uninterrupted")
    lost = {"PLAIT_TEST_LOSE_SNAPSHOTS_AT_ATTEMPT": "1"}
    run_dir = two_machines(tmp_path, "replaced", lost, PLAIT_TEST_KILL_RANK_AT_STEP="1:5")
    log = (run_dir / "agents.log").read_text()
    assert "rank 1 kills in step 5" in log and "this machine's snapshots are lost" in log
    assert [r["step"] for r in restart_rows(run_dir)] == [4]
    assert_same_run(run_dir, reference)


def test_kill_during_an_async_write_restarts_from_the_previous_checkpoint(
    tmp_path: Path, uninterrupted: Path
) -> None:
    # Rank 1 dies writing checkpoint 4 in the background (its data files written, not its
    # manifest): it is never published, and the restart continues from checkpoint 2.
    done = plait_train(
        tmp_path,
        "--max-restarts",
        "1",
        "--async-checkpoint",
        PLAIT_TEST_KILL_RANK_IN_CHECKPOINT="1:4",
    )
    assert "rank 1 is killed writing the checkpoint of step 4" in done.stderr
    assert "continuing from step 2" in done.stderr
    [row] = restart_rows(tmp_path)
    assert row["step"] == 2
    # Asynchronous checkpoints hold what synchronous ones do: the same final weights.
    assert_same_run(tmp_path, uninterrupted)
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step_00000{s}" for s in (2, 4, 6)]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_torchrun_max_restarts_restarts_the_workers(tmp_path: Path, uninterrupted: Path) -> None:
    done = plait_train(
        tmp_path,
        torchrun=True,
        PLAIT_TEST_KILL_RANK_AT_STEP="1:4",
        **{UNSHARED_STORE: "1"},
    )
    assert "continuing from step 2" in done.stderr
    assert [r["step"] for r in restart_rows(tmp_path)] == [2]
    assert_same_run(tmp_path, uninterrupted)


# ----------------------------------------------------------------------------------------
# The pieces, without processes
# ----------------------------------------------------------------------------------------


def test_torchrun_restarts_are_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = TrainConfig(run_dir=str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert check_torchrun_restarts(cfg).max_restarts == 3
    assert check_torchrun_restarts(cfg.replace(max_restarts=3)).max_restarts == 3
    with pytest.raises(ConfigError, match="give the number to torchrun, torchrun --max-restarts 2"):
        check_torchrun_restarts(cfg.replace(max_restarts=2))
    with pytest.raises(ConfigError, match="give one: --run-dir DIR"):
        check_torchrun_restarts(TrainConfig())
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(ConfigError, match=f"needs {UNSHARED_STORE}=1"):
        check_torchrun_restarts(cfg)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # no restarts: nothing to check
    assert check_torchrun_restarts(TrainConfig()).max_restarts == 0


def test_a_restarted_worker_resumes_when_there_is_a_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cfg = TrainConfig(run_dir=str(tmp_path))
    assert restarted(cfg) == cfg  # the first attempt: as given
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not restarted(cfg).resume  # nothing saved yet: from step 0
    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    assert restarted(cfg).resume


def _write(run_dir: Path, *records: dict[str, object]) -> None:
    log = MetricsLog(run_dir, None)
    for record in records:
        log.write(**record)
    log.close()


def test_restart_rows_say_which_steps_were_redone(tmp_path: Path) -> None:
    steps = [{"step": s, "loss": 5.0, "step_time": 0.5} for s in (1, 2, 3, 4, 5)]
    _write(tmp_path, {"step": 0, "val_loss": 5.5}, *steps)
    row = restart_record(tmp_path, 2, 1)
    assert row == {
        "step": 2,
        "event": "restart",
        "restart": 1,
        "redone": [3, 5],
        "redone_steps": 3,
        "lost_step_time": 1.5,
    }
    before_any = restart_record(tmp_path, 5, 2)
    assert before_any["redone"] == [] and before_any["redone_steps"] == 0
    second = {**row, "restart": 2, "step": 4, "redone": [5, 6], "redone_steps": 2}
    summary = restart_summary([row, second])
    assert summary == "2: steps 3-5, steps 5-6 redone (5 in all, 3.0 s of step time)"
    assert restart_summary(steps) is None
    table = summary_table(MODEL.replace(nproc=2, device="cpu"), [*steps, row], steps, [0], tmp_path)
    assert "restarts" in table and "steps 3-5 redone" in table


def test_a_session_restarted_at_step_0_validates_again(tmp_path: Path) -> None:
    restart = {"step": 0, "event": "restart", "restart": 1, "redone": [1, 1]}
    _write(tmp_path, {"step": 0, "val_loss": 5.5}, restart, {"step": 1, "loss": 5.0})
    MetricsLog(tmp_path, 0).close()  # a restart before the first checkpoint
    assert read_metrics(tmp_path) == [restart]
    _write(tmp_path, {"step": 0, "val_loss": 5.5}, restart, {"step": 2, "loss": 5.0})
    MetricsLog(tmp_path, 2).close()  # a resume at step 2 keeps everything up to it
    kept = [{"step": 0, "val_loss": 5.5}, restart, {"step": 2, "loss": 5.0}]
    assert read_metrics(tmp_path) == kept


def test_faults_strike_in_the_attempt_they_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_TEST_KILL_RANK_AT_STEP", "1:5, 0:7:1, 1:9:2")
    assert (FaultInjector(1).fault, FaultInjector(0).fault) == (FaultInjector(1).fault, None)
    assert FaultInjector(1).fault is not None and FaultInjector(1).fault.step == 5
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert FaultInjector(1).fault is None
    fault = FaultInjector(0).fault
    assert fault is not None and fault.step == 7
    monkeypatch.setenv("PLAIT_TEST_KILL_RANK_IN_CHECKPOINT", "1:5:1:2")
    with pytest.raises(ValueError, match="expected RANK:STEP or RANK:STEP:ATTEMPT"):
        FaultInjector(0)


def _stale_listing(run_dir: str) -> list[str]:
    """Rank 1 sees the run directory as a network file system may for a while (no
    checkpoints yet); both ranks must still resume from rank 0's choice."""
    import torch.distributed as dist

    import plait.train.restart as restart

    if dist.get_rank() == 0:
        for step in (2, 4):
            (Path(run_dir) / "checkpoints" / f"step_{step}").mkdir(parents=True)
    dist.barrier()
    listing = restart.list_checkpoints
    if dist.get_rank() == 1:
        restart.list_checkpoints = lambda _run_dir: []  # type: ignore[assignment]
    try:
        return [p.name for p in restart.agreed_checkpoints(run_dir)]
    finally:
        restart.list_checkpoints = listing  # type: ignore[assignment]


def test_ranks_agree_on_the_checkpoints_to_resume_from(tmp_path: Path) -> None:
    names = run_on_ranks(2, _stale_listing, str(tmp_path))
    assert names == [["step_2", "step_4"]] * 2
