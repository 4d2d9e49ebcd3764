"""What accelerate needs to run its FSDP2 path on CPU processes; applied to both runs.

None of it touches plait or torch's FSDP: see README.md ("CPU shims") for the reasons.
"""

from __future__ import annotations

from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin


def enable_fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """Make a ``cpu=True`` accelerator (gloo process group, CPU device) use its FSDP path.

    accelerate only switches to ``DistributedType.FSDP`` for accelerator backends
    (MULTI_GPU, MULTI_XPU, ...); with ``cpu=True`` it initializes gloo and stays
    ``MULTI_CPU``, so ``prepare`` would wrap the model in DDP instead. Setting the state's
    type and plugin afterwards is what accelerate itself does on a GPU machine. Both
    singletons hold the type (``AcceleratorState`` copies ``PartialState``'s fields again
    whenever it is re-created, e.g. in ``save_state``), so both are set.
    """
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
