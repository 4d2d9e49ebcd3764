"""pytest plugin for the runs of torch's multi-process tests: a timed-out test ends its class.

torch's ``MultiProcContinuousTest`` keeps one set of worker processes per test class and
already skips the rest of a class after a worker fails ("Previous test failed"): the
workers may be out of step. A test stopped by pytest-timeout leaves them in the same
state, so this plugin treats it alike: it kills the class's workers and sets the class's
poison pill. check.py runs the skipped tests again in a fresh pytest.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator:
    outcome = yield
    report = outcome.get_result()
    cls = getattr(item, "cls", None)
    if not report.failed or cls is None or call.excinfo is None:
        return
    if "Timeout" not in str(call.excinfo.value):
        return
    for process in getattr(cls, "processes", []):
        process.kill()
        process.join(timeout=10)
    cls.poison_pill = True
