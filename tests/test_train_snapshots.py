"""``plait train --snapshot-every``: checkpoints in this machine's memory that a resumed or
restarted session continues from, and what refuses them.

In this process (one rank, a tiny model; faults injected with plait.train.faults' test
variables, or a snapshot's write patched to fail), against the uninterrupted run, bitwise.
A restart after a killed worker, across processes, is in tests/test_train_restart.py.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.cli import main
from plait.train import snapshots
from plait.train.checkpointer import Checkpointer
from plait.train.checkpointing import (
    CheckpointDamaged,
    checkpoint_state,
    list_checkpoints,
    load_weights,
)
from plait.train.config import ConfigError, TrainConfig
from plait.train.launch import WorkerFailed
from plait.train.loop import model_config
from plait.train.metrics import read_metrics
from plait.train.model import GPT
from plait.train.optimizer import build_optimizer
from plait.train.restart import resumable
from plait.train.snapshots import (
    check_snapshots,
    clear_snapshots,
    latest_snapshot,
    load_snapshot,
    snapshot_root,
    write_snapshot,
)

import train_helpers
from harness import run_on_ranks
from train_helpers import run_train

TINY = train_helpers.TINY.replace(
    seq_len=16, n_layer=2, d_model=16, steps=6, batch_size=4, ckpt_every=0, snapshot_every=1
)

PATIENCE = 60  # seconds a background write may take before the test fails


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """A run directory whose snapshots (in /dev/shm) are removed after the test."""
    yield tmp_path / "run"
    clear_snapshots(tmp_path / "run")


def _settle(run_dir: Path, step: int) -> None:
    """Wait until ``run_dir``'s snapshot of ``step`` is published (asynchronous: its write,
    begun before the failure, outlives the session's exception in this process)."""
    deadline = time.monotonic() + PATIENCE
    while (latest := latest_snapshot(run_dir)) is None or latest.name != f"step_{step:06d}":
        assert time.monotonic() < deadline, f"no snapshot of step {step} was published"
        time.sleep(0.01)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    model = GPT(model_config(TINY.replace(vocab_size=256)))
    load_weights(path, model)
    return model.state_dict()


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_failed_session_resumes_from_its_snapshot_exactly(
    tmp_path: Path, run_dir: Path, background: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = TINY.replace(async_checkpoint=background)
    reference = run_train(cfg, 1, tmp_path / "reference")
    assert latest_snapshot(tmp_path / "reference") is None  # removed as the run ended

    monkeypatch.setenv("PLAIT_TEST_RAISE_RANK_AT_STEP", "0:5")
    with pytest.raises(RuntimeError, match="test fault"):
        run_train(cfg, 1, run_dir)
    monkeypatch.delenv("PLAIT_TEST_RAISE_RANK_AT_STEP")
    _settle(run_dir, 4)
    # No checkpoint was due before step 6; the snapshot of step 4 is the newest, alone.
    assert list_checkpoints(run_dir) == []
    snapshot = latest_snapshot(run_dir)
    assert snapshot is not None and snapshot.name == "step_000004"
    assert [p.name for p in list_checkpoints(snapshot_root(run_dir))] == ["step_000004"]
    assert resumable(run_dir) == [snapshot]

    resumed = run_train(cfg.replace(resume=True), 1, run_dir)
    assert resumed.start_step == 4
    assert resumed.losses == reference.losses[4:]  # bitwise: the same steps 5 and 6
    mine, theirs = (
        _weights(d / "checkpoints" / "step_000006") for d in (run_dir, tmp_path / "reference")
    )
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert latest_snapshot(run_dir) is None
    events = [(r["step"], r["event"]) for r in read_metrics(run_dir) if "event" in r]
    assert (3, "snapshot") in events and (6, "checkpoint") in events
    assert (6, "snapshot") not in events  # a step due for both gets the checkpoint


def test_a_checkpoint_outranks_a_snapshot_of_its_step(run_dir: Path) -> None:
    for root, steps in ((snapshot_root(run_dir), (4, 5)), (run_dir, (2, 4))):
        for step in steps:
            (root / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    disk, memory = run_dir / "checkpoints", snapshot_root(run_dir) / "checkpoints"
    expected = [disk / "step_000002", memory / "step_000004", disk / "step_000004"]
    assert resumable(run_dir) == [*expected, memory / "step_000005"]


def test_snapshots_are_refused_beside_replica_groups() -> None:
    cfg = TrainConfig(snapshot_every=5)
    check_snapshots(cfg)
    check_snapshots(cfg.replace(snapshot_every=0, replica_groups=2))  # none asked for
    with pytest.raises(ConfigError, match="--snapshot-every 5 with --replica-groups 2"):
        check_snapshots(cfg.replace(replica_groups=2))


def test_the_command_resumes_from_a_snapshot_and_will_not_start_over_it(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (snapshot_root(run_dir) / "checkpoints" / "step_000003").mkdir(parents=True)
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")  # a run that failed before any checkpoint
    launched: list[TrainConfig] = []
    monkeypatch.setattr("plait.train.cli.launch", launched.append)
    assert main(["train", "--run-dir", str(run_dir)]) == 2
    assert f"already holds a run's snapshot {snapshot_root(run_dir)}" in capsys.readouterr().err
    assert main(["train", "--run-dir", str(run_dir), "--resume"]) == 0
    assert [cfg.resume for cfg in launched] == [True]

    def fails(cfg: TrainConfig) -> None:
        raise WorkerFailed("plait train: worker rank 1 failed")

    monkeypatch.setattr("plait.train.cli.launch", fails)  # the resumed run fails too
    assert main(["train", "--run-dir", str(run_dir), "--resume"]) != 0
    snapshot = snapshot_root(run_dir) / "checkpoints" / "step_000003"
    assert f"the last snapshot is {snapshot} (in this machine's memory" in capsys.readouterr().err


def test_a_memory_without_room_for_two_snapshots_is_refused_before_the_first(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = TINY.replace(vocab_size=256, device="cpu")
    model = GPT(model_config(cfg))
    state = sum(p.numel() * 4 * 3 for p in model.parameters())  # weights, Adam's 2 moments
    root = snapshot_root(run_dir)
    saver = Checkpointer(run_dir, [model], build_optimizer([model], cfg), cfg.to_dict(), 2, None,
                         background=False, snapshots=root)  # fmt: skip
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    saver.optimizer.step()  # Adam's moments exist: the state is whole
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    usage = shutil.disk_usage(root.parent.parent)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=8 * state - 1))
    with pytest.raises(ConfigError, match=r"snapshots of this machine's 4 rank\(s\) need"):
        saver.save(1, snapshot=True)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=8 * state + 2**20))
    saver2 = Checkpointer(run_dir, [model], saver.optimizer, cfg.to_dict(), 2, None,
                          background=False, snapshots=root)  # fmt: skip
    assert saver2.save(1, snapshot=True)[0].path == root / "checkpoints" / "step_000001"


def test_a_snapshot_torn_by_a_failure_leaves_the_one_before(
    tmp_path: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newest snapshot is removed only once the next is published: a failure while the
    snapshot of step 4 is written (its rank's file there, not yet published) leaves step
    3's, and the run resumed from it ends as the uninterrupted one."""
    reference = run_train(TINY, 1, tmp_path / "reference")

    def fails_at_4(step: int) -> None:
        if step == 4:
            raise OSError("test: the machine failed writing snapshot 4")

    monkeypatch.setattr(snapshots, "strike_in_checkpoint", fails_at_4)
    with pytest.raises(OSError, match="snapshot 4"):
        run_train(TINY, 1, run_dir)
    monkeypatch.undo()
    assert (snapshot_root(run_dir) / "checkpoints" / ".tmp-step_000004" / "rank_00000.pt").exists()
    assert [p.name for p in list_checkpoints(snapshot_root(run_dir))] == ["step_000003"]
    resumed = run_train(TINY.replace(resume=True), 1, run_dir)
    assert resumed.start_step == 3 and resumed.losses == reference.losses[3:]


def _one_rank_lost_its_snapshot(base: str) -> str:
    """On 2 ranks, each its machine's first: write a snapshot, lose rank 1's file (its
    machine replaced), and try to load it on both."""
    rank = dist.get_rank()
    cfg = TINY.replace(vocab_size=256, device="cpu")
    model = GPT(model_config(cfg))
    optimizer = build_optimizer([model], cfg)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()  # the state a snapshot after a step holds
    root = Path(base) / f"machine{rank}"
    state = checkpoint_state([model], optimizer, "cpu")
    path = write_snapshot(root, 7, state, cfg.to_dict(), dist.group.WORLD)
    if rank == 1:
        (path / "rank_00001.pt").unlink()
    with pytest.raises(CheckpointDamaged) as error:
        load_snapshot(path, [model], optimizer, "cpu", group=dist.group.WORLD)
    return str(error.value)


def test_a_snapshot_some_rank_lacks_is_loaded_by_none(tmp_path: Path) -> None:
    for message in run_on_ranks(2, _one_rank_lost_its_snapshot, str(tmp_path), timeout=60):
        assert "cannot be loaded here (rank 1: FileNotFoundError: " in message
