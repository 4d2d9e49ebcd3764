"""``fully_shard``: sharded data parallelism.

Layers, each importing only those before it (tests/test_fsdp_api.py checks it):

* policies, collectives (stateless collectives; ``Groups``), cast, tp, rows (a shard's
  row layout): the leaves;
* param: one parameter's sharded / padded / unsharded forms;
* settings: ``UnitSettings``, what one unit was asked to do;
* extensions (all-gather hooks) and reduce (gradient reduction, ``fully_shard``'s and
  ``replicate``'s) <- group: a unit's parameters, gathered and freed together
  (``FSDPParamGroup``, ``ShardedState``); placement (``ShardPlacement``: a parameter's
  dim and mesh) <- mesh_groups (``MeshGroups``: a unit with one group per mesh); replica
  beside it: a ``replicate`` unit's
  parameters (a unit whose shard group is this rank alone);
* root (the root's bookkeeping of a pass) <- state: per-unit state and the four hooks
  (``FSDPState``, ``TrainingState``); replica_state beside it (``ReplicateState``);
  backward_hooks: where a unit's backward begins and ends in the autograd graph;
* module (``FSDPModule``) <- init (argument checks, groups, parameters) <- fully_shard
  (the entry points); api re-exports the old ``plait.fsdp.api`` names;
* state_dict, clip and memory sit beside them, above state.
"""

from plait.fsdp.clip import clip_grad_norm_
from plait.fsdp.fully_shard import fully_shard, register_fsdp_forward_method, share_comm_ctx
from plait.fsdp.group import ShardedState
from plait.fsdp.memory import FSDPMemoryReport, memory_report
from plait.fsdp.module import FSDPModule, UnshardHandle
from plait.fsdp.placement import ShardPlacement
from plait.fsdp.policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from plait.fsdp.state import TrainingState
from plait.fsdp.state_dict import get_full_state_dict, set_full_state_dict

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPMemoryReport",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ShardPlacement",
    "ShardedState",
    "TrainingState",
    "UnshardHandle",
    "clip_grad_norm_",
    "fully_shard",
    "get_full_state_dict",
    "memory_report",
    "register_fsdp_forward_method",
    "set_full_state_dict",
    "share_comm_ctx",
]
