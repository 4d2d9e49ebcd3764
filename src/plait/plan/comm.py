"""Communication per step: bytes each rank sends, per collective and per mesh dimension.

Ring algorithms (NCCL's and gloo's for large messages): an all-gather or reduce-scatter of
``X`` bytes over ``g`` ranks sends ``X (g - 1) / g`` per rank, an all-reduce twice that.
A mesh dimension's group runs on NVLink when its ranks fit in one node, else on the
inter-node network: the mesh is ``(pp, dp_replicate, dp_shard, tp)``, ``tp`` innermost, so
a dimension's group spans ``size x (product of the inner sizes)`` consecutive ranks.

What plait communicates in one step (``m`` microbatches, ``P`` a rank's parameter
elements after tp, ``e`` the compute dtype's bytes, ``n`` tokens per microbatch):

* ``dp_shard``: all-gathers of every unit in the compute dtype, per microbatch (blocks twice
  with ``reshard_after_forward``, forward and backward; the root once), or once per step
  under a pipeline; one fp32 reduce-scatter of every unit per step (gradient accumulation
  and pipelines reduce once, at the end).
* ``dp_replicate``: one fp32 all-reduce of the gradients per step: of the shards under HSDP,
  of everything with ``replicate``.
* ``tp``: per block and microbatch, in forward two all-gathers and two reduce-scatters of
  ``n x d`` (sequence parallelism; without it two all-reduces), the same in backward, and
  the forward ones again when checkpointing recomputes the block; the embedding and head
  one exchange each way.
* ``pp``: per microbatch and stage boundary, the activation forward and its gradient back
  (``n x d``, split by tp under sequence parallelism).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.layout import DP_REPLICATE, DP_SHARD, MESH_DIMS, PP, TP
from plait.plan.schedule import RankLoad
from plait.plan.shards import compute_bytes, microbatch_tokens, rank_params
from plait.plan.spec import DeviceSpec, Layout, ModelSpec, Workload

__all__ = ["Collective", "communication", "link_bandwidth", "ring"]


@dataclass(frozen=True)
class Collective:
    """One kind of collective on one mesh dimension, summed over a step, on one rank."""

    dim: str
    op: str  # all_gather, reduce_scatter, all_reduce, send_recv
    bytes: float  # sent by one rank per step
    calls: int
    bandwidth: float  # bytes/s of the link it runs on

    @property
    def seconds(self) -> float:
        return self.bytes / self.bandwidth if self.bytes else 0.0


def ring(op: str, group: int) -> float:
    """Bytes sent per rank per byte of the collective's full size (ring algorithm)."""
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    return 2 * share if op == "all_reduce" else share


def _inner(layout: Layout, dim: str) -> int:
    """The product of the sizes of the dims inside ``dim`` (the ranks between two of its
    neighbours)."""
    inside = MESH_DIMS[MESH_DIMS.index(dim) + 1 :]
    return math.prod(getattr(layout, d) for d in inside)


def link_bandwidth(dim: str, layout: Layout, device: DeviceSpec) -> float:
    """Bandwidth per rank of ``dim``'s collectives: NVLink inside a node, else the network."""
    size = getattr(layout, dim) if dim != PP else 2  # point-to-point: neighbours
    span = size * _inner(layout, dim)
    return device.intra_node_bw if span <= device.gpus_per_node else device.inter_node_bw


def tp_bytes_per_block(model: ModelSpec, layout: Layout, work: Workload) -> float:
    """Bytes one rank sends in one block's forward (or backward) for one microbatch."""
    n = microbatch_tokens(layout, work)
    e = compute_bytes(work)
    return 4 * ring("all_gather", layout.tp) * n * model.d_model * e  # 2 AG + 2 RS (or 2 AR)


def communication(
    model: ModelSpec, layout: Layout, work: Workload, device: DeviceSpec, load: RankLoad
) -> list[Collective]:
    """What pipeline rank ``load`` sends in one step (module docstring), by dim and op."""
    e = compute_bytes(work)
    m, ds, dr, tp = layout.microbatches, layout.dp_shard, layout.dp_replicate, layout.tp
    p = rank_params(model, layout, load)
    out: list[Collective] = []

    def add(dim: str, op: str, nbytes: float, calls: int) -> None:
        if nbytes > 0:
            out.append(Collective(dim, op, nbytes, calls, link_bandwidth(dim, layout, device)))

    units = p.blocks + (1 if p.root else 0)
    if ds > 1:
        if layout.pp > 1:
            gathers, block_gathers = 1, p.blocks
        else:
            per_block = 2 if layout.reshard_after_forward else 1
            gathers, block_gathers = m, m * per_block * p.blocks
        gathered = (p.root * gathers + p.block * block_gathers) * e
        add(DP_SHARD, "all_gather", gathered * ring("all_gather", ds), gathers + block_gathers)
        add(DP_SHARD, "reduce_scatter", p.total * 4 * ring("reduce_scatter", ds), units)
    if dr > 1:
        add(DP_REPLICATE, "all_reduce", p.total / ds * 4 * ring("all_reduce", dr), units)
    if tp > 1:
        passes = 3 if layout.ac != "none" else 2  # forward, backward, recomputed forward
        ends = int(load.embedding) + int(load.head)  # embedding / head exchanges
        block_bytes = tp_bytes_per_block(model, layout, work)
        tp_bytes = m * (passes * load.layers * block_bytes + ends * block_bytes / 2)
        op = "all_gather+reduce_scatter" if layout.sequence_parallel else "all_reduce"
        add(TP, op, tp_bytes, m * (passes * 4 * load.layers + 2 * ends))
    if layout.pp > 1:
        sp = tp if layout.sequence_parallel else 1
        hop = microbatch_tokens(layout, work) * model.d_model / sp * e
        stages = layout.stages_per_rank
        add(PP, "send_recv", 2 * m * stages * hop, 2 * m * stages)
    return out
