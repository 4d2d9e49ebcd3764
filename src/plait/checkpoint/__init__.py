"""Composable activation checkpointing (non-reentrant, saved-tensor hooks).

Layers, each importing only those before it: region (the recompute machinery), selective
(policies that keep some op outputs), offload (park saved tensors in host memory) <- api
(the ``checkpoint`` composable API) <- wrapper (torch's ``checkpoint_wrapper`` module form).
"""

from plait.checkpoint.api import CheckpointError, ContextFn, Policy, checkpoint
from plait.checkpoint.wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

__all__ = [
    "CheckpointError",
    "CheckpointImpl",
    "CheckpointWrapper",
    "ContextFn",
    "Policy",
    "apply_activation_checkpointing",
    "checkpoint",
    "checkpoint_wrapper",
]
