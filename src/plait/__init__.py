"""plait: composable parallelism for PyTorch.

The public vocabulary follows torch's composable APIs, so code moves over by changing
imports. See README.md for the tour and DESIGN.md (in the shared folder) for the layout.
"""

from plait.checkpoint import CheckpointError, checkpoint
from plait.contract import contract
from plait.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    clip_grad_norm_,
    fully_shard,
    get_full_state_dict,
    memory_report,
    register_fsdp_forward_method,
    set_full_state_dict,
)
from plait.replicate import ReplicateModule, replicate

__all__ = [
    "CPUOffloadPolicy",
    "CheckpointError",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReplicateModule",
    "checkpoint",
    "clip_grad_norm_",
    "contract",
    "fully_shard",
    "get_full_state_dict",
    "memory_report",
    "register_fsdp_forward_method",
    "replicate",
    "set_full_state_dict",
]
__version__ = "0.1.0"
