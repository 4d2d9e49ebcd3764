"""``plait train --cp``: context parallelism (each sequence split over the cp ranks, every
attention exact from the local tokens), alone with each method and composed with
fully_shard, tensor parallelism, pipelines, activation checkpointing and experts, trains
like one process; a checkpoint saved at cp 2 resumes at cp 1; what cannot be split is
refused before launch.

Every layout must give the single-process run's losses (same seed, same global batch) to
float32 rounding: the cp ranks of a data-parallel rank share its batch, each computes the
loss of its own tokens (a head and a tail chunk of every sequence), and fully_shard
averages gradients over ``dp_shard x cp``.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import pytest

from plait.train.cli import main
from plait.train.loop import TrainResult

from harness import run_on_ranks
from train_helpers import TINY, assert_losses_close, forbid_launch, run_train, train_on_rank

#: Gradient clipping active, as in the TP tests; 32-token sequences split into 2 x cp chunks.
CP_TINY = TINY.replace(grad_clip=0.5, steps=3)

#: A few float32 roundings of a loss near 5.
TOLERANCE = 5e-6


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("train_cp"))


@functools.cache
def _reference(tmp: str, steps: int = CP_TINY.steps, **model: Any) -> TrainResult:
    """The single-process run of CP_TINY (cached)."""
    run_dir = Path(tmp) / f"reference-{steps}-{sorted(model.items())}"
    return run_train(CP_TINY.replace(steps=steps, **model), 1, run_dir)


def _assert_close(actual: list[float], expected: list[float]) -> None:
    assert_losses_close(actual, expected, TOLERANCE)


#: (world size, layout). The issue's acceptance layouts: cp 2 x dp_shard 2, cp 2 x tp 2,
#: pp 2 x cp 2; and each method alone.
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "cp2_allgather": (2, {"cp": 2, "cp_method": "allgather"}),
    "cp2_ring": (2, {"cp": 2, "cp_method": "ring"}),
    "cp2_alltoall": (2, {"cp": 2, "cp_method": "alltoall"}),
    "cp2_dp_shard2_ring": (4, {"cp": 2, "dp_shard": 2, "cp_method": "ring"}),
    "cp2_tp2": (4, {"cp": 2, "tp": 2, "cp_method": "allgather"}),
    "pp2_cp2_ring": (4, {"pp": 2, "cp": 2, "schedule": "1F1B", "cp_method": "ring"}),
    "cp2_ac_full_alltoall": (2, {"cp": 2, "ac": "full", "cp_method": "alltoall"}),
    "cp2_replicate2": (4, {"cp": 2, "dp_replicate": 2, "dp_shard": 1}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_layout_matches_single_process(name: str, shared_tmp: str, tmp_path: Path) -> None:
    world, layout = LAYOUTS[name]
    layout.setdefault("dp_shard", 1)
    results = run_on_ranks(world, train_on_rank, CP_TINY.replace(**layout), str(tmp_path))
    expected = _reference(shared_tmp)
    for result in results:  # every rank reports the global loss
        _assert_close(result.losses, expected.losses)
        _assert_close(list(result.val_losses.values()), list(expected.val_losses.values()))


def test_cp_with_expert_parallelism(shared_tmp: str, tmp_path: Path) -> None:
    """cp 2 x ep 2: the experts take their ranks from dp_shard x cp (here the cp ranks),
    the load is summed over them, and the balance loss is the global-batch one."""
    moe = {"experts": 4, "top_k": 2, "aux_loss_type": "global"}
    cfg = CP_TINY.replace(cp=2, ep=2, dp_shard=1, **moe)
    results = run_on_ranks(2, train_on_rank, cfg, str(tmp_path))
    expected = _reference(shared_tmp, **moe)
    for result in results:
        _assert_close(result.losses, expected.losses)


def test_checkpoint_at_cp2_resumes_at_cp1(shared_tmp: str, tmp_path: Path) -> None:
    steps = 4
    expected = _reference(shared_tmp, steps)
    saved = tmp_path / "run"
    cfg = CP_TINY.replace(steps=steps, stop_after=2, cp=2, dp_shard=1, cp_method="ring")
    run_on_ranks(2, train_on_rank, cfg, str(saved))
    resumed = run_train(CP_TINY.replace(steps=steps, resume=True, cp=1, dp_shard=1), 1, saved)
    assert resumed.start_step == 2
    _assert_close(resumed.losses, expected.losses[2:])
    shutil.rmtree(saved)


REFUSALS = [
    (["--cp", "3", "--seq-len", "32", "--nproc", "3"], "--cp 3 splits each sequence into 6"),
    (
        ["--cp", "2", "--cp-method", "alltoall", "--n-head", "1", "--nproc", "2"],
        "--cp-method alltoall splits the 1 attention heads",
    ),
    (["--cp", "0"], "--cp 0: must be at least 1"),
    (["--cp", "2", "--dropout", "0.1", "--nproc", "2"], "--dropout 0.1 with --cp 2"),
    (
        ["--cp", "2", "--experts", "4", "--nproc", "2"],
        "--aux-loss-type sequence balances each whole sequence",
    ),
]


@pytest.mark.parametrize(("argv", "message"), REFUSALS)
def test_cp_refusals_name_the_flag(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    forbid_launch(monkeypatch, "a refused configuration must not start workers")
    assert main(["train", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err
