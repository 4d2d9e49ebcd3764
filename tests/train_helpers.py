"""What the ``plait train`` tests share: a tiny configuration, training it in this process,
and a launcher that must not be reached."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.train.config import TrainConfig
from plait.train.loop import TrainResult, train
from plait.train.resolve import resolve

#: A few steps of a small model on CPU: no evaluation between the first and the last step,
#: a checkpoint only at the end.
TINY = TrainConfig(
    seq_len=32,
    n_layer=4,
    n_head=2,
    d_model=32,
    steps=3,
    batch_size=8,
    warmup=1,
    eval_every=0,
    eval_batches=1,
    ckpt_every=0,
    device="cpu",
)


def run_train(cfg: TrainConfig, world: int, run_dir: Path) -> TrainResult:
    """Resolve ``cfg`` for ``world`` processes and train it in this process."""
    return train(resolve(cfg.replace(run_dir=str(run_dir)), world))


def forbid_launch(monkeypatch: pytest.MonkeyPatch, reason: str) -> None:
    """Make ``plait train`` fail the test if it starts a worker (``reason``: why not)."""

    def no_launch(cfg: TrainConfig) -> None:
        raise AssertionError(reason)

    monkeypatch.setattr("plait.train.cli.launch", no_launch)


#: How far a loss may be from the single-process run's: a few float32 roundings of a loss
#: near 5 (2.4e-7 apart). Enough to catch a gradient clipped wrongly in one step (1e-5).
TOLERANCE = 3e-6


def train_on_rank(cfg: TrainConfig, run_dir: str) -> TrainResult:
    """Train ``cfg`` in a harness worker, over the worker processes' world."""
    return run_train(cfg, dist.get_world_size(), Path(run_dir))


def assert_losses_close(actual: list[float], expected: list[float], tol: float = TOLERANCE) -> None:
    """Every loss within ``tol`` of the expected one, step by step."""
    assert len(actual) == len(expected)
    for step, (a, e) in enumerate(zip(actual, expected, strict=True), start=1):
        assert math.isclose(a, e, rel_tol=0, abs_tol=tol), (step, a, e, actual, expected)


def documents_of(starts: tuple[tuple[int, ...], ...], t: int) -> torch.Tensor:
    """Document ids ``(rows, t)`` of rows whose documents start at ``starts`` (per row,
    ascending, the first 0): ids count up from 0 in each row."""
    rows = []
    for row in starts:
        ids = torch.zeros(t, dtype=torch.int64)
        for s in row[1:]:
            ids[s:] += 1
        rows.append(ids)
    return torch.stack(rows)
