"""Expert parallelism: a reference mixture-of-experts layer, and its stacked experts
sharded over an ``ep`` mesh with all-to-all token dispatch.

Layers, each importing only those before it: counts (row counts read on the host, or
balanced in shape-only runs), router (top-k choice), grouped (grouped GEMMs: when
torch can run them, and the experts as three of them) <- swiglu (the experts),
balance (load statistics and losses over the global batch), rows (routed rows split over
tensor-parallel ranks), all_to_all (stateless collectives) <- dispatch (rows to their
experts and back) <- moe (the ``MoE`` layer)
<- parallel (``ExpertParallel``, ``expert_parallel``).

Applying it::

    mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
    model = Model()                      # blocks holding plait.experts.MoE layers
    expert_parallel(model, mesh["ep"], load_balance_mesh=mesh)
    # or, in torch's vocabulary (then set_load_balance_mesh(model, mesh)):
    # parallelize_module(model, mesh["ep"], {"layers.*.moe.experts": ExpertParallel()})
    ...
    loss.backward()                      # the MoE's auxiliary losses are included
    optimizer.step()
    update_expert_bias(model)            # auxiliary-loss-free balancing, once per step
"""

from plait.experts.all_to_all import all_to_all
from plait.experts.grouped import grouped_mm_supported
from plait.experts.moe import (
    AuxLossType,
    MoE,
    expert_load,
    set_load_balance_groups,
    set_load_balance_mesh,
    split_routed_rows,
    update_expert_bias,
)
from plait.experts.parallel import (
    ExpertParallel,
    ExpertParallelState,
    expert_parallel,
    shard_experts,
)
from plait.experts.router import Routing, TopKRouter
from plait.experts.swiglu import GroupedExperts, SwiGLU, set_grouped_mm

__all__ = [
    "AuxLossType",
    "ExpertParallel",
    "ExpertParallelState",
    "GroupedExperts",
    "MoE",
    "Routing",
    "SwiGLU",
    "TopKRouter",
    "all_to_all",
    "expert_load",
    "expert_parallel",
    "grouped_mm_supported",
    "set_grouped_mm",
    "set_load_balance_groups",
    "set_load_balance_mesh",
    "shard_experts",
    "split_routed_rows",
    "update_expert_bias",
]
