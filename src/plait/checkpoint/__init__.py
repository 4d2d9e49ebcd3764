"""Composable activation checkpointing (non-reentrant, saved-tensor hooks).

Layers, each importing only those before it: region (the recompute machinery), selective
(policies that keep some op outputs), offload (park saved tensors in host memory) <- api
(the ``checkpoint`` composable API).
"""

from plait.checkpoint.api import CheckpointError, ContextFn, Policy, checkpoint

__all__ = ["CheckpointError", "ContextFn", "Policy", "checkpoint"]
