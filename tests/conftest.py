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
