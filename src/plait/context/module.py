"""The module form: ``apply_context_parallel(module, mesh)`` makes every SDPA call made
inside ``module``'s forward context-parallel, for models that shard their own inputs
(``shard_sequence``) instead of handing buffers to ``context_parallel``.

Forward hooks (:class:`~plait.context.mode.ModeScope`) enter
:class:`~plait.context.mode.ContextParallelMode` when the first hooked module of a call
starts and leave it when that module ends. The hooks sit on ``module`` *and on every
submodule*: a checkpointed block re-runs its forward during backward, outside the root's
forward (and autograd does not carry modes into backward), and its own hooks then put its
recomputed attention back under the mode (the same method and layout, so the recompute
matches the forward). Nothing
else about the module changes, so it composes with ``fully_shard``, tensor parallelism,
pipeline stages and activation checkpointing. Submodules added after the call are not
hooked.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.context.attention import Method, check_method
from plait.context.collectives import cp_group
from plait.context.mode import ContextParallelMode, ModeScope
from plait.context.options import defaults
from plait.context.sequence import SequenceLayout
from plait.contract import APIState, contract
from plait.hooks import outside_graphs

__all__ = ["ContextParallelState", "apply_context_parallel"]


class ContextParallelState(APIState):
    """What :func:`apply_context_parallel` keeps on the module it was applied to."""

    def __init__(self) -> None:
        self.method: Method = "allgather"
        self.layout: SequenceLayout | None = None
        self.scope: ModeScope | None = None  # the mode, and the hooks that enter it


@contract(state_cls=ContextParallelState)
def apply_context_parallel(
    module: nn.Module,
    mesh: DeviceMesh | dist.ProcessGroup,
    *,
    method: Method | None = None,
    load_balance: bool | None = None,
) -> nn.Module:
    """Make SDPA inside ``module``'s forward context-parallel over the 1-D ``mesh``.

    ``method`` (default: ``set_rotate_method``'s) and ``load_balance`` (default True)
    as for ``context_parallel``; the caller shards the inputs in that layout
    (``shard_sequence``) and, for packed sequences, opens ``packed_documents`` around the
    forward and backward. Returns ``module``; applying it twice raises ``AssertionError``.
    """
    group = cp_group(mesh, "apply_context_parallel")
    state = apply_context_parallel.state(module)
    state.method = check_method(defaults().method if method is None else method)
    balanced = defaults().load_balance if load_balance is None else load_balance
    state.layout = SequenceLayout(dist.get_world_size(group), balanced)
    state.scope = ModeScope(ContextParallelMode(group, state.method, balanced))
    pre, post = outside_graphs(state.scope.before), outside_graphs(state.scope.after)
    for sub in module.modules():
        # Outermost of the hooks already there: the mode spans theirs (LIFO with any mode
        # they enter). always_call: an exception still leaves the mode.
        sub.register_forward_pre_hook(pre, prepend=True)
        sub.register_forward_hook(post, always_call=True)
    return module
