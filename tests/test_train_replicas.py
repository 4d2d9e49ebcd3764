"""``plait train --replica-groups``: fault-tolerant replica groups over torchft.

The acceptance run: 2 groups x ``--dp-shard 2`` of a tiny GPT; rank 0 of group 1 (global
rank 2) is SIGKILLed in the forward of step 3; the launcher restarts group 1 while group 0
trains on alone; the new group 1 heals from group 0 and rejoins at step 5 (the test-only
``PLAIT_TEST_REPLICAS_REJOIN_AT_STEP`` makes group 0 wait before step 5 for it, so the
steps with one group are the same in every run). Then training went on without a stop,
group 1 holds group 0's weights bitwise, and every step's loss of each group equals the
one torch's ``fully_shard`` under torchft gives with the same failure
(``replica_reference.py``, run here as its own 2 x 2 processes); the run resumed with
``--resume --steps 8`` continues both groups as torch's reference trains the 8 steps in one
go (``tests/test_train_replica_layouts.py``: groups of other layouts). The checks
and the configuration are tested without processes. Every process has a deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from replica_reference import run_groups  # tests/, beside this file

from plait.train.checkpointing import latest_checkpoint, load_weights
from plait.train.config import ConfigError, TrainConfig
from plait.train.loop import model_config
from plait.train.metrics import read_metrics
from plait.train.model import GPT
from plait.train.replicas import check_replica_groups, replicas_config
from plait.train.resolve import resolve

FLAGS = "--device cpu --seq-len 32 --n-layer 2 --n-head 2 --d-model 32 --batch-size 8 "
FLAGS += "--steps 6 --warmup 1 --eval-every 0 --eval-batches 1 --ckpt-every 0 --grad-clip 0 "
FLAGS += "--min-lr-ratio 1 "  # a constant rate after warm-up: a longer resumed run has the same
FLAGS += "--fault-timeout 60 --replica-groups 2 --dp-shard 2 --max-restarts 1"
MODEL = TrainConfig(seq_len=32, n_layer=2, n_head=2, d_model=32, vocab_size=256)
DEADLINE = 240  # seconds a whole run may take (a few, on a loaded machine)
KILL_STEP, REJOIN_STEP = 3, 5


def losses(run_dir: Path) -> dict[int, tuple[float, int]]:
    """step -> (loss, groups in the step) of a group's metrics.jsonl."""
    return {
        r["step"]: (r["loss"], r["groups_in_step"]) for r in read_metrics(run_dir) if "loss" in r
    }


def grad_norms(run_dir: Path) -> dict[int, float]:
    """step -> gradient norm before clipping, of a run's metrics.jsonl."""
    return {r["step"]: r["grad_norm"] for r in read_metrics(run_dir) if "grad_norm" in r}


def final_weights(
    run_dir: Path, step: int, model_cfg: TrainConfig = MODEL, latest: bool = True
) -> dict[str, torch.Tensor]:
    """The weights of ``run_dir``'s checkpoint of ``step`` (``latest``: its newest) in a
    one-process model of ``model_cfg``."""
    path = latest_checkpoint(run_dir)
    assert path is not None and (not latest or path.name == f"step_{step:06d}")
    path = path.parent / f"step_{step:06d}"
    model = GPT(model_config(model_cfg))
    load_weights(path, model)
    return model.state_dict()


def plait_train(
    run_dir: Path, *flags: str, deadline: float = DEADLINE, **env: str
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "plait", "train", *flags, "--run-dir", str(run_dir)]
    environment = dict(os.environ, OMP_NUM_THREADS="1", **env)
    done = subprocess.run(
        command, env=environment, capture_output=True, text=True, timeout=deadline
    )
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def assert_groups_equal(run_dir: Path, step: int, model_cfg: TrainConfig = MODEL) -> None:
    """The two groups' checkpoints of ``step`` hold bitwise the same weights."""
    weights0, weights1 = (final_weights(run_dir / f"group{g}", step, model_cfg) for g in (0, 1))
    for name, value in weights0.items():
        assert torch.equal(value, weights1[name]), name


def test_group_killed_heals_and_matches_torch(tmp_path: Path) -> None:
    """Also: the whole run, resumed with ``--resume --steps 8``, continues both groups
    exactly (torch's reference trains the 8 steps in one go)."""
    run_dir = tmp_path / "plait"
    done = plait_train(
        run_dir,
        *FLAGS.split(),
        PLAIT_TEST_KILL_RANK_AT_STEP=f"2:{KILL_STEP}",  # group 1's rank 0
        PLAIT_TEST_REPLICAS_REJOIN_AT_STEP=str(REJOIN_STEP),
    )
    assert "replica group 1 failed (rank 0 (killed by SIGKILL)): restarting it" in done.stderr

    # Training went on without a stop: group 0 committed every step, alone in 3 and 4.
    group0, group1 = losses(run_dir / "group0"), losses(run_dir / "group1")
    assert sorted(group0) == [1, 2, 3, 4, 5, 6]
    assert [group0[s][1] for s in range(1, 7)] == [2, 2, 1, 1, 2, 2]
    assert sorted(group1) == [REJOIN_STEP, 6]  # the new group 1: healed, then trained
    assert all(group1[s][1] == 2 for s in group1)

    assert_groups_equal(run_dir, 6)  # the healed group holds the live group's weights

    # Resumed (the run directory's saved configuration, two more steps): both groups go on.
    plait_train(run_dir, "--resume", "--steps", "8")
    group0, group1 = losses(run_dir / "group0"), losses(run_dir / "group1")
    assert sorted(group0) == [*range(1, 9)] and sorted(group1) == [REJOIN_STEP, *range(6, 9)]
    assert group0[7][1] == group0[8][1] == group1[7][1] == group1[8][1] == 2
    assert_groups_equal(run_dir, 8)

    # Every step's loss equals torch's fully_shard under torchft with the same failure.
    reference = run_groups(replicas_config(run_dir), tmp_path, [(0, KILL_STEP)], DEADLINE)
    assert group0 == reference[0, 0]
    assert group1 == reference[1, 1]


def test_checks_refuse_unsupported_layouts() -> None:
    base = MODEL.replace(device="cpu", batch_size=8, replica_groups=2)
    check_replica_groups(resolve(base.replace(dp_shard=2), 2))  # fine
    check_replica_groups(resolve(base.replace(dp_shard=1, cp=2, tp=2, float8=True), 4))
    check_replica_groups(resolve(base.replace(dp_shard=2, pp=2), 4))
    with pytest.raises(ConfigError, match="--dp-replicate 2: the groups are the data-parallel"):
        resolve(base.replace(dp_shard=2, dp_replicate=2), 4)
    check_replica_groups(resolve(base.replace(dp_shard=2, experts=4, top_k=2, ep=2), 2))
    with pytest.raises(ConfigError, match="at least 2 ranks"):
        resolve(base.replace(dp_shard=1, tp=2), 2)
    with pytest.raises(ConfigError, match="multiple of 8"):
        resolve(base.replace(dp_shard=4, batch_size=4), 4)


def test_resume_finds_the_configuration_of_a_replica_groups_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--resume reads the run's saved configuration: a replica-groups run has none at the
    top of its run directory, but the launcher's copy, or (under torchrun, each group
    started by hand) the group's own."""
    from plait.train.cli import build_config

    saved = MODEL.replace(device="cpu", batch_size=8, replica_groups=2, dp_shard=2, steps=9)
    monkeypatch.delenv("PLAIT_REPLICA_GROUP", raising=False)
    with pytest.raises(ConfigError, match="is .* a plait run"):
        build_config({"run_dir": str(tmp_path), "resume": True})
    group = tmp_path / "group1" / "config.json"
    group.parent.mkdir()
    group.write_text(json.dumps(saved.replace(run_dir=str(group.parent)).to_dict()))
    monkeypatch.setenv("PLAIT_REPLICA_GROUP", "1")
    cfg = build_config({"run_dir": str(tmp_path), "resume": True, "steps": 12})
    assert (cfg.replica_groups, cfg.steps, cfg.run_dir) == (2, 12, str(tmp_path))
    launched = tmp_path / "replicas" / "config.json"
    launched.parent.mkdir()
    launched.write_text(json.dumps(saved.replace(run_dir=str(tmp_path), seed=7).to_dict()))
    assert build_config({"run_dir": str(tmp_path), "resume": True}).seed == 7


def test_local_groups_share_the_gpus_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replica groups launched on one machine each get GPUs of their own (NCCL refuses two
    ranks on one GPU), the default workers split the GPUs, and too few GPUs is an error."""
    import plait.train.replicas as replicas
    import plait.train.resolve as resolve_module

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [replicas._Group(i).gpus(2) for i in (0, 1)] == [["4", "5"], ["6", "7"]]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(replicas, "_gpu_count", lambda: 4)
    assert replicas._Group(1).gpus(2) == ["2", "3"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    resolve_module._check_local_gpus("cuda", 2, 2)
    with pytest.raises(ConfigError, match="--nproc 3 CUDA workers in each of 2 replica groups"):
        resolve_module._check_local_gpus("cuda", 3, 2)
