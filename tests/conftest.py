"""Shared pytest setup: per-test seed reset and the lifetime of the rank pools."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from harness import shutdown_pools


@pytest.fixture(autouse=True)
def _fresh_process_state() -> Iterator[None]:
    """Every single-process test starts from the same seeds and default settings."""
    torch.manual_seed(0)
    random.seed(0)
    torch.set_grad_enabled(True)
    yield
    torch.set_default_dtype(torch.float32)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pools()
