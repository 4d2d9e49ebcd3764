"""Test-only fault injection: make one rank die, raise or hang in the middle of a step.

For tests of what ``plait train`` does when a worker fails (never for real runs). Set one
of these in the environment of ``plait train``; its workers inherit it::

    PLAIT_TEST_KILL_RANK_AT_STEP="1:5"    rank 1 SIGKILLs itself in step 5
    PLAIT_TEST_RAISE_RANK_AT_STEP="1:5"   rank 1 raises RuntimeError in step 5
    PLAIT_TEST_HANG_RANK_AT_STEP="1:5"    rank 1 sleeps for good in step 5

The value is ``RANK:STEP`` (global rank; step as the progress output counts them, from 1).
The fault strikes right after the rank's first forward of that step, before its backward,
so its peers are left waiting in the step's collectives. Before striking, the rank prints
``plait: test fault: ... at <unix time>`` on stderr, so a test can time the reaction.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["FaultInjector"]

_VARIABLES = {
    "kill": "PLAIT_TEST_KILL_RANK_AT_STEP",
    "raise": "PLAIT_TEST_RAISE_RANK_AT_STEP",
    "hang": "PLAIT_TEST_HANG_RANK_AT_STEP",
}


@dataclass(frozen=True)
class _Fault:
    kind: str  # a key of _VARIABLES
    step: int


def _planned(rank: int) -> _Fault | None:
    """The fault the environment plans for ``rank``, if any."""
    for kind, variable in _VARIABLES.items():
        value = os.environ.get(variable, "")
        if not value:
            continue
        try:
            target, step = (int(part) for part in value.split(":"))
        except ValueError:
            raise ValueError(
                f"{variable}={value!r}: expected RANK:STEP, e.g. {variable}=1:5"
            ) from None
        if target == rank:
            return _Fault(kind, step)
    return None


class FaultInjector:
    """Strikes this rank's planned fault (if any) during training step ``step``.

    The loop sets :attr:`step` to the step being trained (0 outside training steps, so
    validation forwards never strike).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.fault = _planned(rank)
        self.step = 0

    def arm(self, module: nn.Module) -> None:
        """Strike after ``module``'s forward (the first stage this rank holds)."""
        if self.fault is not None:
            module.register_forward_hook(self._after_forward)

    def _after_forward(self, *_: Any) -> None:
        fault = self.fault
        if fault is None or fault.step != self.step:
            return
        what = f"rank {self.rank} {fault.kind}s in step {fault.step}"
        print(f"plait: test fault: {what} at {time.time():.3f}", file=sys.stderr, flush=True)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "hang":
            while True:
                time.sleep(60)
        raise RuntimeError(f"plait: test fault ({_VARIABLES[fault.kind]}): {what}")
