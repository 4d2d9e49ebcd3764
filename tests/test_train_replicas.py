"""``plait train --replica-groups``: fault-tolerant replica groups over torchft.

The acceptance run: 2 groups x ``--dp-shard 2`` of a tiny GPT; rank 0 of group 1 (global
rank 2) is SIGKILLed in the forward of step 3; the launcher restarts group 1 while group 0
trains on alone; the new group 1 heals from group 0 and rejoins at step 5 (the test-only
``PLAIT_TEST_REPLICAS_REJOIN_AT_STEP`` makes group 0 wait before step 5 for it, so the
steps with one group are the same in every run). Then training went on without a stop,
group 1 holds group 0's weights bitwise, and every step's loss of each group equals the
one torch's ``fully_shard`` under torchft gives with the same failure
(``replica_reference.py``, run here as its own 2 x 2 processes). The checks and the
configuration are tested without processes. Every process has a deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from plait.train.checkpointing import latest_checkpoint, load_weights
from plait.train.config import ConfigError, TrainConfig
from plait.train.loop import model_config
from plait.train.metrics import read_metrics
from plait.train.model import GPT
from plait.train.replicas import _kill, _start_lighthouse, check_replica_groups
from plait.train.resolve import resolve

HERE = Path(__file__).resolve().parent
FLAGS = "--device cpu --seq-len 32 --n-layer 2 --n-head 2 --d-model 32 --batch-size 8 "
FLAGS += "--steps 6 --warmup 1 --eval-every 0 --eval-batches 1 --ckpt-every 0 --grad-clip 0 "
FLAGS += "--fault-timeout 20 --replica-groups 2 --dp-shard 2 --max-restarts 1"
MODEL = TrainConfig(seq_len=32, n_layer=2, n_head=2, d_model=32, vocab_size=256)
DEADLINE = 240  # seconds a whole run may take (a few, on a loaded machine)
KILL_STEP, REJOIN_STEP = 3, 5


def losses(run_dir: Path) -> dict[int, tuple[float, int]]:
    """step -> (loss, groups in the step) of a group's metrics.jsonl."""
    return {
        r["step"]: (r["loss"], r["groups_in_step"]) for r in read_metrics(run_dir) if "loss" in r
    }


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    path = latest_checkpoint(run_dir)
    assert path is not None and path.name == "step_000006"
    model = GPT(model_config(MODEL))
    load_weights(path, model)
    return model.state_dict()


def run_reference(config: Path, out: Path) -> dict[tuple[int, int], dict[int, tuple[float, int]]]:
    """torch's fully_shard under torchft, 2 groups of 2 ranks, group 1 killed at
    KILL_STEP and restarted (rejoining at REJOIN_STEP). (group, life) -> step -> (loss,
    groups in the step), of rank 0."""
    lighthouse, url = _start_lighthouse(out / "lighthouse.log")
    procs: dict[tuple[int, int], list[subprocess.Popen[bytes]]] = {}

    def start(group: int, life: int, *flags: str) -> None:
        port = str(9000 + (os.getpid() % 20000) + 10 * group + life)
        procs[group, life] = []
        for rank in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank))
            env.update(WORLD_SIZE="2", TORCHFT_LIGHTHOUSE=url, GLOO_SOCKET_IFNAME="lo")
            env.update(RUST_LOG="warn", OMP_NUM_THREADS="1")
            command = [sys.executable, str(HERE / "replica_reference.py"), str(config)]
            command += [str(out / f"g{group}-l{life}.json"), "--group", str(group)]
            command += ["--life", str(life), *flags]
            procs[group, life].append(subprocess.Popen(command, env=env, start_new_session=True))

    deadline = time.monotonic() + DEADLINE
    try:
        start(0, 0, "--start-groups", "2", "--hold", str(REJOIN_STEP))
        start(1, 0, "--start-groups", "2", "--die-at", str(KILL_STEP))
        while all(p.poll() is None for p in procs[1, 0]):
            assert time.monotonic() < deadline, "the reference's group 1 never died"
            time.sleep(0.05)
        _kill(procs[1, 0])  # its other rank waits in the group's collectives
        start(1, 1)
        for key in [(0, 0), (1, 1)]:
            for proc in procs[key]:
                assert proc.wait(timeout=max(deadline - time.monotonic(), 1)) == 0, key
    finally:
        _kill([p for ps in procs.values() for p in ps] + [lighthouse])
    found = {}
    for key in [(0, 0), (1, 1)]:
        records = json.loads((out / f"g{key[0]}-l{key[1]}.json").read_text())
        found[key] = {r["step"]: (r["loss"], r["groups"]) for r in records}
    return found


def test_group_killed_heals_and_matches_torch(tmp_path: Path) -> None:
    run_dir = tmp_path / "plait"
    command = [sys.executable, "-m", "plait", "train", *FLAGS.split(), "--run-dir", str(run_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PLAIT_TEST_KILL_RANK_AT_STEP"] = f"2:{KILL_STEP}"  # group 1's rank 0
    env["PLAIT_TEST_REPLICAS_REJOIN_AT_STEP"] = str(REJOIN_STEP)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=DEADLINE)
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "replica group 1 failed (rank 0 (killed by SIGKILL)): restarting it" in done.stderr

    # Training went on without a stop: group 0 committed every step, alone in 3 and 4.
    group0, group1 = losses(run_dir / "group0"), losses(run_dir / "group1")
    assert sorted(group0) == [1, 2, 3, 4, 5, 6]
    assert [group0[s][1] for s in range(1, 7)] == [2, 2, 1, 1, 2, 2]
    assert sorted(group1) == [REJOIN_STEP, 6]  # the new group 1: healed, then trained
    assert all(group1[s][1] == 2 for s in group1)

    # The healed group holds the live group's weights bitwise.
    weights0, weights1 = final_weights(run_dir / "group0"), final_weights(run_dir / "group1")
    for name, value in weights0.items():
        assert torch.equal(value, weights1[name]), name

    # Every step's loss equals torch's fully_shard under torchft with the same failure.
    reference = run_reference(run_dir / "replicas" / "config.json", tmp_path)
    assert group0 == reference[0, 0]
    assert group1 == reference[1, 1]


def test_checks_refuse_unsupported_layouts() -> None:
    base = MODEL.replace(device="cpu", batch_size=8, replica_groups=2)
    check_replica_groups(resolve(base.replace(dp_shard=2), 2))  # fine
    with pytest.raises(ConfigError, match="--tp 2"):
        resolve(base.replace(dp_shard=2, tp=2), 4)
    with pytest.raises(ConfigError, match="at least 2 ranks"):
        resolve(base.replace(dp_shard=1), 1)
    with pytest.raises(ConfigError, match="multiple of 8"):
        resolve(base.replace(dp_shard=4, batch_size=4), 4)
