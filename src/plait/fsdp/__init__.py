"""``fully_shard``: sharded data parallelism.

Layers, each importing only those before it: collectives <- param <- group <- state <- api;
state_dict, clip and memory sit beside them, above state (tests/test_fsdp_api.py checks it).
"""

from plait.fsdp.api import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from plait.fsdp.clip import clip_grad_norm_
from plait.fsdp.group import ShardedState
from plait.fsdp.memory import FSDPMemoryReport, memory_report
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
