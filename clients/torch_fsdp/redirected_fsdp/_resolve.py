"""Resolve a name the tests import from torch's fully_shard / composable modules.

Public modules (the API plait reimplements: ``torch.distributed.fsdp``, the old
``torch.distributed._composable.fsdp`` path, ``torch.distributed._composable`` with
``checkpoint`` / ``replicate`` / ``contract``) map to the plait modules that hold their
counterparts, searched in order for the same name; a name plait lacks becomes
:class:`Missing` (the pipelining client's placeholder: the import succeeds, the first use
raises ``NotImplementedError``).

A torch-private module stays torch's, name by name, except where plait has a
counterpart of the same name and contract (``PRIVATE_HOMES``): torch's private helpers
that answer questions about a model sharded by plait (which modules and parameters a
``fully_shard`` call would manage; the autograd function that runs a unit's
post-backward, which ``common_fsdp.patch_register_post_backward_hook_backward`` patches
to count) must ask plait's state, not torch's.
"""

from __future__ import annotations

import importlib
from typing import Any

from redirected_pipelining._resolve import Missing

PUBLIC_HOMES: dict[str, tuple[str, ...]] = {
    "torch.distributed.fsdp": ("plait.fsdp",),
    "torch.distributed._composable.fsdp": ("plait.fsdp",),
    "torch.distributed._composable.fsdp.fully_shard": ("plait.fsdp",),
    "torch.distributed.fsdp._fully_shard": ("plait.fsdp",),
    "torch.distributed.fsdp._fully_shard._fully_shard": ("plait.fsdp",),
    "torch.distributed._composable": ("plait",),
    "torch.distributed._composable.replicate": ("plait.replicate",),
    "torch.distributed._composable.replicate_with_fsdp": ("plait.replicate",),
    "torch.distributed._composable.checkpoint_activation": ("plait.checkpoint",),
    "torch.distributed._composable.contract": ("plait.contract",),
}
#: Single names of other torch modules that plait's API raises or returns: the
#: composable checkpoint's error is torch.utils.checkpoint's CheckpointError in torch and
#: plait.checkpoint's in plait (code that catches it moves over by this import); the
#: module's other names (its functional checkpoint) stay torch's.
NAME_HOMES: dict[tuple[str, str], str] = {
    ("torch.utils.checkpoint", "CheckpointError"): "plait.checkpoint",
}
PRIVATE_HOMES: dict[str, tuple[str, ...]] = {
    "torch.distributed.fsdp._fully_shard._fsdp_init": ("plait.fsdp.init",),
    "torch.distributed.fsdp._fully_shard._fsdp_param_group": ("plait.fsdp.backward_hooks",),
}


def resolve(torch_module: str, name: str) -> tuple[Any, str]:
    """``(object, where)``: what the plait copy of a test gets for ``torch_module.name``."""
    if (torch_module, name) in NAME_HOMES:
        home = NAME_HOMES[torch_module, name]
        return getattr(importlib.import_module(home), name), f"{home}.{name}"
    public = torch_module in PUBLIC_HOMES
    for home in PUBLIC_HOMES.get(torch_module, ()) + PRIVATE_HOMES.get(torch_module, ()):
        module = importlib.import_module(home)
        if hasattr(module, name):
            return getattr(module, name), f"{home}.{name}"
    if public:
        return Missing(f"{torch_module}.{name}"), "MISSING"
    return getattr(importlib.import_module(torch_module), name), f"{torch_module}.{name} (torch's)"
