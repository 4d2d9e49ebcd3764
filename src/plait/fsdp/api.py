"""The names ``plait.fsdp.api`` held before FSDP was split by concept, importable from here
still (``pipeline/grad_sync.py`` and code written against it use this path).

New code imports from :mod:`plait.fsdp`; the definitions live in ``fully_shard.py`` (the
entry points), ``module.py`` (``FSDPModule``), ``init.py`` (argument and parameter checks)
and ``state.py`` (per-unit state).
"""

from plait.fsdp.fully_shard import fully_shard, register_fsdp_forward_method, share_comm_ctx
from plait.fsdp.init import FSDPArgumentError, FSDPUnsupportedError, check_tp_param
from plait.fsdp.module import FSDPDeepcopyError, FSDPModule, UnshardHandle
from plait.fsdp.state import fsdp_states_in

__all__ = [
    "FSDPArgumentError",
    "FSDPDeepcopyError",
    "FSDPModule",
    "FSDPUnsupportedError",
    "UnshardHandle",
    "check_tp_param",
    "fsdp_states_in",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
