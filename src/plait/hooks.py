"""The autograd seams the plait APIs share.

Kept tiny on purpose: every API hooks into the same few places of a training step, and
naming them once makes the APIs read alike.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from plait.logs import apply_torch_logs

apply_torch_logs()  # TORCH_LOGS="+fsdp" and the like, read when an API is first imported


def queue_end_of_backward(callback: Callable[[], None], api: str) -> None:
    """Run ``callback`` once the current backward pass has finished all its work.

    Must be called from inside a backward pass (a tensor or parameter hook). The callback
    runs on the autograd thread after every gradient of this backward has been accumulated,
    before ``loss.backward()`` returns: the place to wait for outstanding gradient
    reductions.

    Raises :class:`CompiledAutogradError` (naming ``api``) under compiled autograd, before
    queueing anything: see ``refuse_compiled_autograd``.
    """
    refuse_compiled_autograd(api)
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class CompiledAutogradError(RuntimeError):
    """A plait API's backward ran under compiled autograd (see ``refuse_compiled_autograd``)."""


def _in_compiled_autograd() -> bool:
    """True while compiled autograd runs a captured backward graph (whose eager hooks, such
    as plait's, are called from inside it)."""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")  # not imported here
    return compiled_autograd is not None and bool(compiled_autograd.in_compiled_autograd_region)


def refuse_compiled_autograd(api: str) -> None:
    """Raise if this backward runs under compiled autograd, which plait cannot support.

    Compiled autograd (``torch._dynamo.config.compiled_autograd = True``, or
    ``torch._dynamo.compiled_autograd._enable``) captures the whole backward as one graph
    and runs it through ``torch.compile``. plait's backward hooks run eagerly in that graph
    (graph breaks), but callbacks they queue on the autograd engine are silently dropped:
    the end of backward, where gradients are reduced and parameters resharded, would never
    run. (With ``fullgraph=True`` the hooks cannot be captured at all.) torch's own
    ``fully_shard`` runs on in that case and trains wrong; plait stops at the first
    backward, before any collective of it, with the fix.

    Why not support it: only callbacks queued from *traced* code survive in a compiled
    autograd graph, and only with ``fullgraph=True``; that would need hooks dynamo can
    trace whole (functional collectives, no storage swaps), a different design. Compiled
    autograd left on around a forward whose backward runs outside it is not refused: plain
    autograd runs that backward.
    """
    if _in_compiled_autograd():
        raise CompiledAutogradError(
            f"{api}: this backward runs under compiled autograd "
            "(torch._dynamo.config.compiled_autograd = True, or inside "
            "torch._dynamo.compiled_autograd._enable(...)), which plait does not support: "
            "it drops the end-of-backward callbacks that reduce gradients and reshard "
            "parameters, and replays checkpoint recomputation inside its graph, so training "
            "would silently go wrong. Turn compiled autograd "
            "off for models that plait parallelizes: set "
            "torch._dynamo.config.compiled_autograd = False before calling torch.compile "
            "(or call loss.backward() outside the compiled autograd context). "
            "torch.compile still compiles the model's forward and backward graphs."
        )


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


def traced(label: str, detail: str = "") -> contextlib.AbstractContextManager[object]:
    """A ``record_function`` label while a profiler runs; free (a shared no-op) otherwise.
    Also a DEBUG line ``label (detail)`` to the API's logger (:func:`action_logger`), when
    that is on (``TORCH_LOGS="+fsdp"``, :mod:`plait.logs`); ``detail`` names what acts
    (a ``fully_shard`` unit), in the profile's label too.

    The APIs label every unshard, reduction and pipeline action so a profile reads
    naturally, but entering ``record_function`` costs microseconds even with no profiler,
    which adds up over hundreds of small units per step.
    """
    if action_logger(label).isEnabledFor(logging.DEBUG):
        action_logger(label).debug("%s (%s)" if detail else "%s%s", label, detail)
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"{label} ({detail})" if detail else label)
    return _NO_LABEL


_ACTION_LOGGERS: dict[str, logging.Logger] = {}


def action_logger(label: str) -> logging.Logger:
    """The logger of the API a :func:`traced` label belongs to: ``plait.<api>`` from the
    label's first name after ``plait.`` (``"plait.fsdp.pre_forward"``: ``plait.fsdp``;
    ``"checkpoint.recompute:x"``: ``plait.checkpoint``)."""
    logger = _ACTION_LOGGERS.get(label)  # by label: most are constants, the rest few
    if logger is None:
        api = label.removeprefix("plait.").split(".", 1)[0]
        logger = _ACTION_LOGGERS[label] = logging.getLogger(f"plait.{api}")
    return logger


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


_EAGER = "plait hooks run eagerly, outside compiled graphs"
_EAGER_IN_BACKWARD = (
    f"{_EAGER}; compiled autograd cannot capture plait's backward hooks: set "
    "torch._dynamo.config.compiled_autograd = False for models that plait parallelizes"
)


def outside_graphs(hook: _Hook, *, backward: bool = False) -> _Hook:
    """``hook`` as it must be registered: never traced by ``torch.compile``, always eager.

    The APIs' hooks swap parameters, resize storage and talk to peers; dynamo must not
    trace them (it would fail on, or worse silently bake in, that state). Called from a
    compiled region, the hook becomes a graph break. Registered on a module that
    ``torch.compile(module, fullgraph=True)`` wraps, it is a frame of its own that dynamo
    skips, so the module's forward still compiles as one graph. Applied when a hook is
    registered rather than when plait is imported: importing dynamo costs about a second.

    ``backward``: a hook that autograd calls (tensor, post-accumulate-grad, or a custom
    ``Function``'s backward). Autograd calls it eagerly, except under compiled autograd,
    which hands it to dynamo: there it must not be traced either (it is a graph break that
    runs eagerly and then refuses compiled autograd, see ``refuse_compiled_autograd``; with
    ``fullgraph=True`` dynamo refuses it with this reason, which names the fix).
    """
    disabled: _Hook = torch.compiler.disable(
        hook, recursive=True, reason=_EAGER_IN_BACKWARD if backward else _EAGER
    )
    return disabled
