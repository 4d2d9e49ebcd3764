"""plait: composable parallelism for PyTorch.

The public vocabulary follows torch's composable APIs, so code moves over by changing
imports. See README.md for the tour and docs/architecture.md for the map.

The names below are imported on first use (PEP 562), so ``import plait`` and the torch-free
parts of it (``plait plan``'s cost model) do not import torch; ``plait.fully_shard``,
``from plait import fully_shard`` and ``from plait import *`` import what they name.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from plait.lazy import LazyExports

if TYPE_CHECKING:
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
        get_full_state_dict,
        memory_report,
        set_full_state_dict,
    )

    # From its module: mypy takes the package's name for the submodule of that name here.
    from plait.fsdp.fully_shard import fully_shard, register_fsdp_forward_method, share_comm_ctx
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

#: Where each lazily imported name lives.
_MODULES = {
    "plait.checkpoint": (
        "CheckpointError",
        "CheckpointImpl",
        "CheckpointWrapper",
        "apply_activation_checkpointing",
        "checkpoint",
        "checkpoint_wrapper",
    ),
    "plait.contract": ("_get_registry", "contract"),
    "plait.fsdp": (
        "CPUOffloadPolicy",
        "DataParallelMeshDims",
        "FSDPModule",
        "MixedPrecisionPolicy",
        "OffloadPolicy",
        "UnshardHandle",
        "clip_grad_norm_",
        "fully_shard",
        "get_full_state_dict",
        "memory_report",
        "register_fsdp_forward_method",
        "set_full_state_dict",
        "share_comm_ctx",
    ),
    "plait.replicate": ("ReplicateModule", "replicate"),
}
_LAZY = LazyExports(__name__, _MODULES)


def __getattr__(name: str) -> Any:
    return _LAZY.attribute(name)


def __dir__() -> list[str]:
    return _LAZY.names()


class _Package(types.ModuleType):
    """plait's module: importing a submodule that shares an exported name (``checkpoint``,
    ``contract``, ``replicate``) does not rebind that name to the submodule, so
    ``plait.checkpoint`` is the function whatever was imported first (as when the names
    were imported eagerly)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY.where and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
