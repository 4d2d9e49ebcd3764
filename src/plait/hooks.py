"""The autograd seams the plait APIs share.

Kept tiny on purpose: every API hooks into the same few places of a training step, and
naming them once makes the APIs read alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished all its work.

    Must be called from inside a backward pass (a tensor or parameter hook). The callback
    runs on the autograd thread after every gradient of this backward has been accumulated,
    before ``loss.backward()`` returns: the place to wait for outstanding gradient
    reductions.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def backward_pass_id() -> int | None:
    """Autograd's id for the backward pass running on this thread, or ``None`` outside one."""
    graph_task = torch._C._current_graph_task_id()
    return None if graph_task == -1 else graph_task


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread.

    Forwards run inside backward (activation-checkpoint recomputation) must not redo the
    per-step work of an API's forward hooks.
    """
    return backward_pass_id() is not None


_NO_LABEL = contextlib.nullcontext()


def traced(label: str) -> contextlib.AbstractContextManager[object]:
    """A ``record_function`` label while a profiler runs; free (a shared no-op) otherwise.

    The APIs label every unshard, reduction and pipeline action so a profile reads
    naturally, but entering ``record_function`` costs microseconds even with no profiler,
    which adds up over hundreds of small units per step.
    """
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(label)
    return _NO_LABEL
