"""What a ``fully_shard`` unit was asked to do: one settings object per unit.

``fully_shard(...)`` creates it from its arguments, ``FSDPModule``'s setters change it, and
the runtime only reads it. The unit's state and its parameter group hold the same object
(``state.settings is state.unit.settings``), so a setter writes in one place and every
reader sees the change at once.

It is not frozen on purpose: the pipeline's gradient sync turns a unit's flags off for a
step and back on after it (``pipeline/grad_sync.py``), through the parameter group, and
both holders must see that change; a frozen object would need both references replaced
together every time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from plait.fsdp.collectives import Comm
from plait.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy


@dataclass(slots=True)
class UnitSettings:
    """One unit's settings. Fixed at ``fully_shard`` (or ``replicate``): ``mp_policy``,
    ``offload_policy``, ``conditional``, ``api_name``, ``bucket_cap_bytes`` (the mesh's groups
    live in ``collectives.Groups``); the rest through the ``FSDPModule`` setter of the same
    name.

    ``reshard_after_forward`` is ``True`` / ``False`` once resolved: ``fully_shard`` turns
    an int group size into ``True`` (plus a post-forward group) or ``False`` (see
    :func:`resolve_reshard_after_forward`); ``None`` (not given) stays until the root's
    lazy initialisation, which resolves it once: ``False`` for the root (its parameters
    are needed again at once by backward), ``True`` for every other unit.
    """

    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    reshard_after_forward: bool | None
    # True: the unit may not run on every rank in a step. Its collectives then run at
    # fixed points instead: all-gather when its parent unit unshards, reduce-scatter
    # (zeros where it did not run) at the end of backward.
    conditional: bool = False
    api_name: str = "fully_shard"  # the API that made the unit ("replicate"), for messages
    # replicate: the unit's gradients are reduced in buckets of at most this many bytes,
    # each launched as soon as its gradients are ready; None: one reduction per dtype.
    bucket_cap_bytes: int | None = None
    # --- when the unit is gathered and freed in backward ---
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    # --- gradient reduction ---
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True  # HSDP: False defers the cross-replica all-reduce
    reduce_scatter_unused_params: bool = False
    max_input_buffers: int = 1  # reductions in flight at once (the root takes the largest)
    gradient_divide_factor: float | None = None  # None: average over the ranks
    force_sum_reduction_for_comms: bool = False
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: Any = None  # a device stream to run the hook on
    all_gather_comm: Comm | None = None  # torch's AllGather protocol
    reduce_scatter_comm: Comm | None = None  # torch's ReduceScatter protocol


def resolve_reshard_after_forward(value: bool | int | None, world: int) -> bool | None:
    """``fully_shard``'s ``reshard_after_forward`` in the form the runtime reads.

    An int is the size of the group the parameters are resharded to after forward
    (``collectives.Groups.post_forward`` holds that group): any size other than 1 frees
    the full parameters, 1 keeps them (unless the shard group has one rank: then there
    is nothing to keep). ``None`` is left for the root's lazy initialisation to decide.
    """
    if value is None or isinstance(value, bool):
        return value
    return value != 1 or world == 1
