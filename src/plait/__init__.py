"""plait: composable parallelism for PyTorch.

The public vocabulary follows torch's composable APIs, so code moves over by changing
imports. See README.md for the tour and docs/architecture.md for the map.
"""

from plait.checkpoint import (
    CheckpointError,
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint,
    checkpoint_wrapper,
)
from plait.contract import _get_registry as _get_registry  # torch's name for get_registry
from plait.contract import contract
from plait.fsdp import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    clip_grad_norm_,
    fully_shard,
    get_full_state_dict,
    memory_report,
    register_fsdp_forward_method,
    set_full_state_dict,
    share_comm_ctx,
)
from plait.replicate import ReplicateModule, replicate

__all__ = [
    "CPUOffloadPolicy",
    "CheckpointError",
    "CheckpointImpl",
    "CheckpointWrapper",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReplicateModule",
    "UnshardHandle",
    "apply_activation_checkpointing",
    "checkpoint",
    "checkpoint_wrapper",
    "clip_grad_norm_",
    "contract",
    "fully_shard",
    "get_full_state_dict",
    "memory_report",
    "register_fsdp_forward_method",
    "replicate",
    "set_full_state_dict",
    "share_comm_ctx",
]
__version__ = "0.1.0"
