"""Device meshes for plait's APIs: defaults and validation.

Meshes are always passed explicitly; when an API is given none it builds a 1-D mesh over
the whole world on the module's device type. Named dimensions follow torchtitan's
vocabulary: ``"pp"``, ``"dp_replicate"``, ``"dp_shard"``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def module_device_type(module: nn.Module) -> str:
    """The device type of ``module``'s parameters (``"cpu"`` for a module without any)."""
    for param in module.parameters():
        return param.device.type
    for buffer in module.buffers():
        return buffer.device.type
    return "cpu"


def default_mesh(module: nn.Module, api_name: str) -> DeviceMesh:
    """A 1-D mesh over the whole world on ``module``'s device type."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"{api_name} needs an initialised default process group: call "
            "torch.distributed.init_process_group() first (torchrun sets up the environment), "
            "or pass mesh=..."
        )
    return init_device_mesh(module_device_type(module), (dist.get_world_size(),))


def one_dim_group(mesh: object, api_name: str) -> dist.ProcessGroup:
    """The process group of a 1-D ``mesh``, or a clear error naming the fix."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{api_name}: mesh must be a torch.distributed.device_mesh.DeviceMesh, "
            f"got {type(mesh).__name__}"
        )
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        raise ValueError(
            f"{api_name} needs a 1-D mesh (the data-parallel group) but got a {mesh.ndim}-D mesh "
            f"of shape {tuple(mesh.shape)} with dims {names}: pass one dimension, "
            'e.g. mesh["dp"]'
        )
    group = mesh.get_group()
    assert isinstance(group, dist.ProcessGroup)
    return group
