"""``fully_shard``: sharded data parallelism.

Layers, each importing only those before it: collectives <- param <- group <- state <- api.
"""

from plait.fsdp.api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from plait.fsdp.group import ShardedState
from plait.fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from plait.fsdp.state import TrainingState

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ShardedState",
    "TrainingState",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]
