"""Shared pytest setup: per-test seed reset and the lifetime of the rank pools."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch

from harness import shutdown_pools


@pytest.fixture(autouse=True, scope="session")
def _token_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``plait train``'s token cache (plait.train.data) in a temporary folder, never the
    user's ~/.cache; set before any rank pool starts, so its workers inherit it."""
    before = os.environ.get("PLAIT_DATA_CACHE")
    os.environ["PLAIT_DATA_CACHE"] = str(tmp_path_factory.mktemp("plait-data-cache"))
    yield
    if before is None:
        os.environ.pop("PLAIT_DATA_CACHE", None)
    else:
        os.environ["PLAIT_DATA_CACHE"] = before


@pytest.fixture(autouse=True)
def _fresh_process_state() -> Iterator[None]:
    """Every single-process test starts from the same seeds and default settings."""
    torch.manual_seed(0)
    random.seed(0)
    torch.set_grad_enabled(True)
    yield
    torch.set_default_dtype(torch.float32)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two test processes on a small machine, at most four on a large one.
    Each runs its own rank pools (up to 8 workers each), so more would crowd the cores and
    memory with processes waiting on each other's collectives."""
    from plait.train.cores import usable_cores

    return max(2, min(4, usable_cores() // 2))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pools()


#: The slowest files (``--durations`` on 2 cores, 2026-11-28: 40-90 s each, most of them
#: ``plait train`` subprocesses or 8-rank pools), slowest first. ``--dist loadfile`` with
#: ``--no-loadscope-reorder`` (pyproject.toml) hands files out in collection order, so
#: these go first: collected alphabetically they came last (``test_train_*``), and one
#: worker ran the last of them for minutes while the other sat idle; xdist's default
#: reorder (most tests first) had put them last again, all together.
SLOWEST_FIRST = (
    "test_train_replicas.py",
    "test_train_replica_layouts.py",
    "test_train_restart.py",
    "test_train_compile.py",
    "test_train_tp.py",
    "test_train_faults.py",
    "test_pipeline_tp.py",
    "test_plan_memory.py",
    "test_train.py",
    "test_fsdp_tp.py",
    "test_train_moe.py",
    "test_readme_finetune.py",
    "test_train_float8.py",
    "test_plan_calibrate_runs.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put :data:`SLOWEST_FIRST`'s files first (a stable sort: every worker collects the
    same order, as xdist requires; tests within a file keep theirs)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
