"""The autograd seams the plait APIs share.

Kept tiny on purpose: every API hooks into the same few places of a training step, and
naming them once makes the APIs read alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

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


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def outside_graphs(hook: _Hook) -> _Hook:
    """``hook`` as it must be registered: never traced by ``torch.compile``, always eager.

    The APIs' hooks swap parameters, resize storage and talk to peers; dynamo must not
    trace them (it would fail on, or worse silently bake in, that state). Called from a
    compiled region, the hook becomes a graph break. Registered on a module that
    ``torch.compile(module, fullgraph=True)`` wraps, it is a frame of its own that dynamo
    skips, so the module's forward still compiles as one graph. Applied when a hook is
    registered rather than when plait is imported: importing dynamo costs about a second.
    """
    disabled: _Hook = torch.compiler.disable(
        hook, recursive=True, reason="plait hooks run eagerly, outside compiled graphs"
    )
    return disabled
