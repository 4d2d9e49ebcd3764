"""The parallel layout of a run: the mesh dimensions by name, one :class:`Layout`, the
device mesh built from it, and the one set of rules saying which layouts can run.

``plait train`` (which refuses a configuration before any worker starts) and ``plait plan``
(which searches the layouts of N devices) ask the same rules, so a layout the planner
proposes is one that training runs. A rule returns :class:`Reason` s, none when the layout
can run; each names the field at fault and the fix in ``plait train``'s flag words (the
planner's layout flags are the same). The caller decides what a reason means: training
refuses with the first, the search skips the layout.

This package is core: it imports torch, nothing of plait's APIs, and torch only when a mesh
is built (``plait plan`` uses the rules without it). What the rules need of a pipeline
schedule comes in as an argument (:class:`ScheduleFacts` by name; the pipeline package's
``SCHEDULES`` is such a table), and what they need of a model as a :class:`ModelShape`,
which training builds from its GPT and the planner from its specs.

Its modules, each importing only those before it: ``dims`` (the names and their orders)
<- ``meshes`` (a device mesh from sizes; the dim a stacked expert weight is sharded on)
<- ``layout`` (:class:`Layout`, its meshes) <- ``reasons`` (:class:`Reason`, :func:`flag`)
<- ``world`` (sizes fill the world; :func:`grids`) <- ``shape`` (:class:`ModelShape`)
<- ``splits`` (what tp, cp and ep split) <- ``schedule`` (the pipeline's rules and
defaults) <- ``rules`` (:func:`check`, all of them in order; the batch). Import the names
from here: the split into modules is not part of the interface.

Adding a parallel dimension happens here: its name, its place in :data:`MESH_DIMS`, its
field of :class:`Layout`, and a rule for what it splits.
"""

from __future__ import annotations

from plait.layout.dims import (
    CP,
    CP_METHODS,
    DATA_PARALLEL,
    DP,
    DP_REPLICATE,
    DP_SHARD,
    DP_SHARD_CP,
    EFSDP,
    EP,
    EXPERT_MESH_DIMS,
    MESH_DIMS,
    PP,
    TP,
)
from plait.layout.layout import LAYOUT_FIELDS, Layout

# Not in __all__ (as before the split): plait train's recipe and the planner import it by name.
from plait.layout.meshes import expert_shard_dim as expert_shard_dim
from plait.layout.reasons import Reason, flag
from plait.layout.rules import check, check_batch
from plait.layout.schedule import (
    INTERLEAVED_STAGES_PER_RANK,
    ScheduleFacts,
    ScheduleTable,
    check_microbatches,
    check_schedule,
    check_stages,
    check_stages_per_rank,
    default_microbatches,
    default_stages_per_rank,
    fewest_microbatches,
    find_schedule,
    stage_blocks,
)
from plait.layout.shape import ModelShape, cp_shard
from plait.layout.splits import Split, check_cp, check_ep, check_tp, moe_tp_width, tp_splits
from plait.layout.world import World, check_sizes, check_world, grids

__all__ = [
    "CP",
    "CP_METHODS",
    "DATA_PARALLEL",
    "DP",
    "DP_REPLICATE",
    "DP_SHARD",
    "DP_SHARD_CP",
    "EFSDP",
    "EP",
    "EXPERT_MESH_DIMS",
    "INTERLEAVED_STAGES_PER_RANK",
    "LAYOUT_FIELDS",
    "MESH_DIMS",
    "PP",
    "TP",
    "Layout",
    "ModelShape",
    "Reason",
    "ScheduleFacts",
    "ScheduleTable",
    "Split",
    "World",
    "check",
    "check_batch",
    "check_cp",
    "check_ep",
    "check_microbatches",
    "check_schedule",
    "check_sizes",
    "check_stages",
    "check_stages_per_rank",
    "check_tp",
    "check_world",
    "cp_shard",
    "default_microbatches",
    "default_stages_per_rank",
    "fewest_microbatches",
    "find_schedule",
    "flag",
    "grids",
    "moe_tp_width",
    "stage_blocks",
    "tp_splits",
]
