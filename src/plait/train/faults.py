"""Test-only fault injection: make one rank die, raise or hang in the middle of a step, or
die while it writes a checkpoint.

For tests and the failure drill of what ``plait train`` does when a worker fails (never
for real runs). Set one of these in the environment of ``plait train``; its workers
inherit it::

    PLAIT_TEST_KILL_RANK_AT_STEP="1:5"          rank 1 SIGKILLs itself in step 5
    PLAIT_TEST_RAISE_RANK_AT_STEP="1:5"         rank 1 raises RuntimeError in step 5
    PLAIT_TEST_HANG_RANK_AT_STEP="1:5"          rank 1 sleeps for good in step 5
    PLAIT_TEST_STALL_RANK_AT_STEP="1:5"         rank 1 sleeps PLAIT_TEST_STALL_SECONDS
                                                (default 5) in step 5, then goes on
    PLAIT_TEST_KILL_RANK_IN_CHECKPOINT="1:4"    rank 1 SIGKILLs itself while writing the
                                                checkpoint (or snapshot) of step 4
    PLAIT_TEST_LOSE_SNAPSHOTS_AT_ATTEMPT="1"    in attempt 1, this machine's snapshots are
                                                gone (its workers only: a replaced machine)

The value is ``RANK:STEP`` (global rank; step as the progress output counts them, from 1),
or ``RANK:STEP:ATTEMPT`` to strike in that attempt of a run that restarts
(``--max-restarts``: attempt 0 is the first, attempt ``n`` its ``n``-th restart), or a
comma-separated list of those (``"1:5,0:9:1"``). ``RANK:STEP`` strikes in attempt 0 only,
so a restarted run does not fail again at the same place. A step fault strikes right
after the rank's first forward of that step, before its backward, so its peers are left
waiting in the step's collectives; a checkpoint fault strikes once the checkpoint's data
files are written, before its manifest, so the checkpoint is left half-written (on the
background thread with ``--async-checkpoint``, while training goes on). Before striking,
the rank prints ``plait: test fault: ... at <unix time>`` on stderr, so a test can time
the reaction.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

__all__ = ["FaultInjector", "attempt", "lose_snapshots", "strike_in_checkpoint"]

_VARIABLES = {
    "kill": "PLAIT_TEST_KILL_RANK_AT_STEP",
    "raise": "PLAIT_TEST_RAISE_RANK_AT_STEP",
    "hang": "PLAIT_TEST_HANG_RANK_AT_STEP",
    "stall": "PLAIT_TEST_STALL_RANK_AT_STEP",
}
_IN_CHECKPOINT = "PLAIT_TEST_KILL_RANK_IN_CHECKPOINT"
_LOSE_SNAPSHOTS = "PLAIT_TEST_LOSE_SNAPSHOTS_AT_ATTEMPT"


@dataclass(frozen=True)
class _Fault:
    kind: str  # a key of _VARIABLES
    step: int


def attempt() -> int:
    """Which attempt of the run this worker belongs to: the elastic agent's restart count
    (0 without restarts, or outside a launcher)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _steps_planned(variable: str, rank: int, this_attempt: int) -> list[int]:
    """The steps at which ``variable`` plans a fault for ``rank`` in ``this_attempt``."""
    value = os.environ.get(variable, "")
    steps = []
    for entry in filter(None, (part.strip() for part in value.split(","))):
        try:
            target, step, *when = (int(part) for part in entry.split(":"))
        except ValueError:
            when = [-1, -1]  # refused below
        if len(when) > 1:
            raise ValueError(
                f"{variable}={value!r}: expected RANK:STEP or RANK:STEP:ATTEMPT (a list "
                f"separated by commas), e.g. {variable}=1:5"
            )
        if target == rank and (when[0] if when else 0) == this_attempt:
            steps.append(step)
    return steps


def _planned(rank: int, this_attempt: int) -> _Fault | None:
    """The step fault the environment plans for ``rank`` in ``this_attempt``, if any."""
    for kind, variable in _VARIABLES.items():
        steps = _steps_planned(variable, rank, this_attempt)
        if steps:
            return _Fault(kind, steps[0])
    return None


def _announce(what: str) -> None:
    print(f"plait: test fault: {what} at {time.time():.3f}", file=sys.stderr, flush=True)


class FaultInjector:
    """Strikes this rank's planned fault (if any) during training step ``step``.

    The loop sets :attr:`step` to the step being trained (0 outside training steps, so
    validation forwards never strike).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.fault = _planned(rank, attempt())
        _steps_planned(_IN_CHECKPOINT, rank, 0)  # a malformed value fails at the start
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
        _announce(what)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "hang":
            while True:
                time.sleep(60)
        if fault.kind == "stall":  # a slow rank, as compiling or loading makes one
            time.sleep(float(os.environ.get("PLAIT_TEST_STALL_SECONDS", "5")))
            return
        raise RuntimeError(f"plait: test fault ({_VARIABLES[fault.kind]}): {what}")


def strike_in_checkpoint(step: int) -> None:
    """SIGKILL this rank if ``PLAIT_TEST_KILL_RANK_IN_CHECKPOINT`` plans it for the
    checkpoint of ``step`` (called once that checkpoint's data files are written)."""
    if not os.environ.get(_IN_CHECKPOINT):
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if step in _steps_planned(_IN_CHECKPOINT, rank, attempt()):
        _announce(f"rank {rank} is killed writing the checkpoint of step {step}")
        os.kill(os.getpid(), signal.SIGKILL)


def lose_snapshots(root: Path) -> None:
    """Remove this machine's snapshot directory ``root`` if ``PLAIT_TEST_LOSE_SNAPSHOTS_AT_ATTEMPT``
    names this attempt: the machine of a restarted worker was replaced, its memory empty
    (set for one machine's workers only)."""
    if os.environ.get(_LOSE_SNAPSHOTS) == str(attempt()) and root.exists():
        _announce(f"this machine's snapshots are lost ({root})")
        shutil.rmtree(root, ignore_errors=True)
