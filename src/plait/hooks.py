"""The autograd seams the plait APIs share.

Kept tiny on purpose: every API hooks into the same few places of a training step, and
naming them once makes the APIs read alike.
"""

from __future__ import annotations

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
