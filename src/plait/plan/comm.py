"""Communication per step: bytes each rank sends, per collective and per mesh dimension.

Ring algorithms (NCCL's and gloo's for large messages): an all-gather or reduce-scatter of
``X`` bytes over ``g`` ranks sends ``X (g - 1) / g`` per rank, an all-reduce twice that.
A mesh dimension's group runs on NVLink when its ranks fit in one node, else on the
inter-node network: the mesh is ``(pp, dp_replicate, dp_shard, cp, tp)``, ``tp`` innermost,
so a dimension's group spans ``size x (product of the inner sizes)`` consecutive ranks
(``cp``: ``cp x tp``, on NVLink while that is at most a node's devices).

What plait communicates in one step (``m`` microbatches, ``P`` a rank's parameter
elements after tp, ``e`` the compute dtype's bytes, ``n`` tokens per microbatch):

* ``dp_shard`` (with context parallelism ``dp_shard_cp``: ``fully_shard`` shards over
  ``dp_shard x cp``, :func:`~plait.plan.shards.fsdp_ranks`, and its collectives have that
  many ranks): all-gathers of every unit in the compute dtype, per microbatch (blocks twice
  with ``reshard_after_forward``, forward and backward; the root once), or once per step
  under a pipeline (``max_active_stages``: as often as the schedule gathers each stage
  again, :func:`~plait.plan.schedule.layout_gathers`); one fp32 reduce-scatter of every
  unit per step (gradient accumulation and pipelines reduce once, at the end). Both move
  ``fully_shard``'s buffers, each parameter padded to a multiple of the group's ranks on
  dim 0 (:func:`~plait.plan.shards.padded_params`). With ``Software.float8_all_gather``
  (torchao's fp8 all-gather) the blocks' weights are gathered in fp8, 1 byte per
  parameter (the few norm weights among them too, a negligible over-count); the root unit
  and a MoE's routed experts (no Float8Linears) stay in the compute dtype; the weights'
  scales are one small all-reduce per step, left out.
* ``dp_replicate``: one fp32 all-reduce of the gradients per step: of the shards under HSDP,
  of everything with ``replicate``.
* ``zero`` (:data:`ZERO`, a :class:`~plait.plan.spec.PlanLayout` with ZeRO-1/2, whose
  group is ``dp_replicate x cp``; in place of ``dp_replicate``'s all-reduce): one
  reduce-scatter of the fp32 gradients per step (ZeRO-2 without a pipeline: one per
  microbatch) and one all-gather of the updated parameters in the compute dtype, an
  all-reduce's bytes between them. The reduce-scatter overlaps backward as
  ``replicate``'s buckets do; the all-gather follows the optimizer step (Megatron-LM can
  overlap it with the next step's forward).
* ``tp``: per block and microbatch, in forward two all-gathers and two reduce-scatters of
  ``n x d`` (sequence parallelism; without it two all-reduces), the same in backward, and
  the forward ones again when checkpointing recomputes the block; the embedding and head
  one exchange each way. With ``Software.float8_tp_gather`` a forward's two all-gathers
  move fp8 (1 byte per element).
* ``pp``: per microbatch and stage boundary, the activation forward and its gradient back
  (``n x d``, split by tp under sequence parallelism).
* ``cp``: per block and microbatch, attention's exchange of keys and values
  (:func:`cp_traffic`; ``n`` is then the rank's ``seq_len / cp`` share of each sequence),
  and the forward's again when checkpointing recomputes attention (``--ac full`` and
  ``selective`` both do).

Mixture-of-experts blocks (``E`` routed experts, ``k`` per token), with ``ep`` ranks taken
from ``dp_shard x cp`` (the experts' mesh is ``(pp, dp_replicate, efsdp, ep, tp)``,
``efsdp = dp_shard x cp / ep``):

* ``ep``: per MoE block and microbatch, the forward dispatches the rank's routed rows of
  ``d`` to their experts' ranks and combines them back (two all-to-alls), backward
  retraces both, and checkpointing's recompute (``--ac full`` or ``selective``: both rerun
  the block's forward) repeats the forward's. The rank's rows are the block's ``n k``,
  under tensor parallelism its tp chunk of them, ``n k / tp``
  (:func:`~plait.plan.shards.moe_rows`; the ep group is the ep ranks of its tp index). A
  rank keeps the rows of its own experts: with balanced routing ``1 / ep`` of them, so it
  sends ``n k d e (ep - 1) / (ep tp)`` bytes per all-to-all. Each forward also exchanges
  the ``E`` row counts (int64) and all-reduces them over the data-parallel ranks (the
  load): latency, no bandwidth to speak of.
* ``tp`` (tp > 1 under ``fully_shard``, where tp splits the routed rows:
  :func:`~plait.plan.shards.routed_tp`): the chunks' expert outputs all-gathered over tp,
  ``n k`` rows of ``d`` (each rank gives ``n k / tp``): one all-gather per MoE block and
  microbatch in forward, one of the input rows' gradients in backward, and the forward's
  again in a recompute (``--ac full`` or ``selective``: the gather is not a matmul selective
  keeps), ``n k d e (tp - 1) / tp`` bytes each (:func:`tp_gather_bytes`,
  ``all_gather(routed)``).
* ``efsdp``: with ``ep`` > 1 or tp splitting the routed rows the experts are a parameter
  group of their own, gathered and reduced over ``efsdp x tp`` ranks
  (:func:`~plait.plan.shards.expert_fsdp_ranks`: their ``E / ep`` experts only, whole on
  every tp rank) as the rest of the block is over ``dp_shard``; with ``ep`` = ``tp`` = 1
  they are part of the block's ``dp_shard`` collectives.
* ``dp_replicate``: the experts' shards join the all-reduce (``1 / (dp_shard x tp)`` of
  all of them; the dense parameters' ``1 / dp_shard`` of their tp shard).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from plait.layout import CP, DP_REPLICATE, DP_SHARD, EFSDP, EP, MESH_DIMS, PP, TP
from plait.plan.schedule import RankLoad, layout_gathers
from plait.plan.shards import (
    RankParams,
    compute_bytes,
    expert_fsdp_ranks,
    experts_apart,
    fsdp_ranks,
    microbatch_tokens,
    moe_rows,
    padded_params,
    routed_rows,
    routed_tp,
)
from plait.plan.spec import (
    ZERO,
    DeviceSpec,
    Layout,
    ModelSpec,
    Software,
    Workload,
    zero_ranks,
    zero_stage,
)
from plait.plan.stacks import kv_share, stack

__all__ = [
    "DP_SHARD_CP",
    "ZERO",
    "Collective",
    "CpTraffic",
    "all_to_all_bytes",
    "all_to_all_passes",
    "communication",
    "cp_traffic",
    "ep_span",
    "fsdp_dim",
    "link_bandwidth",
    "ring",
    "tp_bytes_per_block",
    "tp_collective_bytes",
    "tp_forward_bytes",
    "tp_gather_bytes",
    "tp_gather_passes",
]

#: ``fully_shard``'s group under context parallelism: ``dp_shard x cp`` (torchtitan's
#: name), the dim its collectives are reported on when ``cp`` > 1.
DP_SHARD_CP = "dp_shard_cp"


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


def fsdp_dim(layout: Layout) -> str:
    """The dim ``fully_shard``'s collectives run on: ``dp_shard``, or with context
    parallelism :data:`DP_SHARD_CP`."""
    return DP_SHARD if layout.cp == 1 else DP_SHARD_CP


def _span(dim: str, layout: Layout) -> int:
    """Consecutive ranks one group of ``dim`` spans (``ep`` and ``efsdp``: of the experts'
    mesh, ``ep`` just outside ``tp``, ``efsdp`` outside ``ep``: as ``dp_shard x cp``;
    ``dp_shard_cp``: the ``dp_shard`` and ``cp`` dims together)."""
    if dim == EP:
        return layout.ep * layout.tp
    if dim in (EFSDP, DP_SHARD_CP):
        return layout.dp_shard * layout.cp * layout.tp
    if dim == ZERO:  # dp_replicate x cp, with dp_shard 1 between them
        return layout.dp_replicate * layout.cp * layout.dp_shard * layout.tp
    size = getattr(layout, dim) if dim != PP else 2  # point-to-point: neighbours
    return size * _inner(layout, dim)


def link_bandwidth(dim: str, layout: Layout, device: DeviceSpec, span: int | None = None) -> float:
    """Bandwidth per rank of ``dim``'s collectives, a group spanning ``span`` consecutive
    ranks (None: as plait's mesh lays ``dim`` out): NVLink inside a node, else the network
    (an all-to-all whose ep group spans nodes runs at the network's rate)."""
    span = span or _span(dim, layout)
    return device.intra_node_bw if span <= device.gpus_per_node else device.inter_node_bw


def ep_span(layout: Layout, ep_inner: bool) -> int | None:
    """The consecutive ranks an ep group spans: ``ep`` under ``Software.ep_inner``
    (Megatron-Core's expert mesh with ETP 1); None, plait's mesh's (``ep x tp``)."""
    return layout.ep if ep_inner else None


def all_to_all_passes(layout: Layout) -> int:
    """All-to-alls of routed rows per MoE block and microbatch: dispatch and combine in
    forward, their reverse in backward, and the forward's again when checkpointing
    recomputes the block."""
    return 6 if layout.ac != "none" else 4


def all_to_all_bytes(model: ModelSpec, layout: Layout, work: Workload) -> float:
    """Bytes one rank sends in one all-to-all of one MoE block (module docstring): its
    routed rows (its tp chunk of them) less the ``1 / ep`` that stay on it; 0 without
    expert parallelism."""
    if layout.ep == 1:
        return 0.0
    share = (layout.ep - 1) / layout.ep
    return moe_rows(model, layout, work) * model.d_model * compute_bytes(work) * share


def tp_gather_passes(layout: Layout) -> int:
    """Tensor parallelism's all-gathers of routed rows per MoE block and microbatch: the
    experts' outputs in forward, the input rows' gradients in backward, and the forward's
    again when checkpointing recomputes the block (0 where tp does not split the routed
    rows: :func:`~plait.plan.shards.routed_tp`)."""
    if routed_tp(layout) == 1:
        return 0
    return 3 if layout.ac != "none" else 2


def tp_gather_bytes(model: ModelSpec, layout: Layout, work: Workload) -> float:
    """Bytes one rank sends in one all-gather of one MoE block's routed rows over tp
    (module docstring): ``n k`` rows of ``d`` in the compute dtype, ring; 0 without
    experts or where tp does not split the routed rows."""
    rows = routed_rows(model, layout, work)
    return rows * model.d_model * compute_bytes(work) * ring("all_gather", routed_tp(layout))


def tp_bytes_per_block(model: ModelSpec, layout: Layout, work: Workload) -> float:
    """Bytes one rank sends in one block's forward (or backward) for one microbatch."""
    n = microbatch_tokens(layout, work)
    e = compute_bytes(work)
    return 4 * ring("all_gather", layout.tp) * n * model.d_model * e  # 2 AG + 2 RS (or 2 AR)


def tp_collective_bytes(
    model: ModelSpec, layout: Layout, work: Workload, fp8_gathers: bool = False
) -> tuple[float, float]:
    """Bytes one rank sends in one of a block's forward all-gathers and in one of its
    reduce-scatters (a quarter of :func:`tp_bytes_per_block` each), the gather at 1 byte
    per element with ``fp8_gathers`` (``Software.float8_tp_gather``)."""
    one = tp_bytes_per_block(model, layout, work) / 4
    return (one / compute_bytes(work) if fp8_gathers else one), one


def tp_forward_bytes(model: ModelSpec, layout: Layout, work: Workload, fp8_gathers: bool) -> float:
    """Bytes one rank sends in one block's forward for one microbatch: its two all-gathers
    and two reduce-scatters (:func:`tp_collective_bytes`)."""
    gather, reduce = tp_collective_bytes(model, layout, work, fp8_gathers)
    return 2 * (gather + reduce)


@dataclass(frozen=True)
class CpTraffic:
    """What one rank sends in one block's context-parallel attention for one microbatch:
    bytes and calls of the forward and of the backward, and the collective's name;
    ``shift``: the bytes of each of the backward's gradient shifts that run beside a
    block's attention after its gather (torch's all-gather method; 0 for the others)."""

    op: str
    forward: float
    forward_calls: int
    backward: float
    backward_calls: int
    shift: float = 0.0


def cp_traffic(
    model: ModelSpec, layout: Layout, work: Workload, software: Software | None = None
) -> CpTraffic:
    """The exchange of context parallelism's attention per block and microbatch (zero
    without context parallelism), as ``software`` (default plait's) runs it
    (:mod:`plait.plan.stacks`, "Context parallelism"). ``n``: the rank's tokens (its
    ``seq_len / cp`` of each sequence), ``k``: the width of the keys (and values) the
    attention receives on a tp rank (the query width ``d`` where they were repeated to the
    query heads, :func:`~plait.plan.stacks.kv_share`), ``e`` the compute dtype's
    bytes:

    * ``allgather``: one all-gather of the stacked keys and values (``2 n k e`` from each
      rank, every rank receives the others': ``(cp - 1) 2 n k e`` sent per rank in a ring);
      backward one reduce-scatter of their gradients, the same bytes (plait's); torch's
      gathers them again and shifts their fp32 gradient accumulators round the ring
      (``cp`` shifts of ``2 n k`` in fp32 beside the gather).
    * ``ring``: ``cp - 1`` shifts of the stacked key/value block (``2 n k e`` each: the same
      bytes as the all-gather); backward the blocks go round again (``cp - 1`` shifts) with
      their gradients' accumulators beside them (``cp`` shifts of ``2 n k`` in fp32, the
      accumulation dtype), a little over twice the forward's bytes in bf16.
    * ``alltoall`` (Ulysses): q, k, v exchanged from a sequence split to a head split and
      the output back, each all-to-all sending ``(cp - 1) / cp`` of the rank's tensor: ``(2
      d + 2 k) n e (cp - 1) / cp``; q, k and v go as one stacked exchange when k is as wide
      as q (no grouped-query attention, or key/value heads expanded to the query heads
      because cp does not divide them), else q and the stacked k, v separately. Backward:
      the same all-to-alls reversed.
    """
    cp = layout.cp
    if cp == 1:
        return CpTraffic("", 0.0, 0, 0.0, 0)
    software = software or Software()
    n, e, tp = microbatch_tokens(layout, work), compute_bytes(work), layout.tp
    d = model.q_width / tp
    k = d * kv_share(model, software)
    if layout.cp_method == "alltoall" and (model.kv_heads // tp) % cp:
        k = d  # plait's Ulysses expands key/value heads that cp does not divide
    block = 2 * n * k * e  # a rank's stacked keys and values
    shift = 2 * n * k * 4  # backward's fp32 key/value gradients, shifted cp times
    if layout.cp_method == "allgather":
        sent = (cp - 1) * block
        if stack(software.kernels).context == "torch":
            back = sent + cp * shift
            return CpTraffic("all_gather+send_recv", sent, 1, back, 1 + cp, shift)
        return CpTraffic("all_gather+reduce_scatter", sent, 1, sent, 1)
    if layout.cp_method == "ring":
        back = (cp - 1) * block + cp * shift  # blocks, then the fp32 accumulators
        return CpTraffic("send_recv", (cp - 1) * block, cp - 1, back, 2 * cp - 1)
    if layout.cp_method == "alltoall":
        sent = (2 * d + 2 * k) * n * e * (cp - 1) / cp
        calls = 2 if k == d else 3
        return CpTraffic("all_to_all", sent, calls, sent, calls)
    raise ValueError(f"--cp-method {layout.cp_method}: not one of allgather, ring, alltoall")


def _cp_per_step(t: CpTraffic, layout: Layout, layers: int) -> tuple[float, int]:
    """Bytes and calls one rank sends in context parallelism's attention (``t`` per block
    and microbatch) over a step, for ``layers`` blocks: per block and microbatch the
    forward, the backward, and the forward again when checkpointing recomputes attention."""
    forwards = 2 if layout.ac != "none" else 1
    per_block = forwards * t.forward + t.backward
    calls = forwards * t.forward_calls + t.backward_calls
    return layout.microbatches * layers * per_block, layout.microbatches * layers * calls


_Add = Callable[[str, str, float, int], None]


def communication(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    load: RankLoad,
    software: Software | None = None,
) -> list[Collective]:
    """What pipeline rank ``load`` sends in one step (module docstring), by dim and op;
    ``software``: whether the blocks are all-gathered in fp8, tp's input gathers, and
    where ep's groups lie (``Software.ep_inner``); None: what ``plait train`` runs."""
    software = software or Software()
    e = compute_bytes(work)
    fp8_gather = software.float8_all_gather
    m, ds, dr, tp = layout.microbatches, fsdp_ranks(layout), layout.dp_replicate, layout.tp
    p = padded_params(model, layout, load)  # fully_shard moves its padded buffers
    out: list[Collective] = []
    fsdp = fsdp_dim(layout)

    def add(dim: str, op: str, nbytes: float, calls: float) -> None:
        if nbytes > 0:  # calls: a bounded pipeline gathers a stage a fractional mean of times
            span = ep_span(layout, dim == EP and software.ep_inner)
            bandwidth = link_bandwidth(dim, layout, device, span)
            out.append(Collective(dim, op, nbytes, round(calls), bandwidth))

    units = p.blocks + (1 if p.root else 0)
    if ds > 1:
        if layout.pp > 1:  # each stage once per step, or as often as its bound says
            gathers = per_block = layout_gathers(layout)
        else:
            gathers, per_block = m, m * (2 if layout.reshard_after_forward else 1)
        # ep > 1 or tp > 1: the experts are a group of their own, on efsdp (x tp); else
        # part of the block's.
        apart = experts_apart(layout)
        own = 0.0 if apart else p.expert_total
        if fp8_gather:  # the blocks' weights in fp8, 1 byte each
            units_bytes = (p.root * gathers + own * per_block) * e + p.sharded_blocks * per_block
            gathered = units_bytes * ring("all_gather", ds)
        else:
            gathered = (
                (p.root * gathers + (p.sharded_blocks + own) * per_block)
                * e
                * ring("all_gather", ds)
            )
        add(fsdp, "all_gather", gathered, gathers + per_block * p.blocks)
        reduced = (p.sharded_blocks + own + p.root) * 4 * ring("reduce_scatter", ds)
        add(fsdp, "reduce_scatter", reduced, units)
        eg = expert_fsdp_ranks(layout)
        if apart and eg > 1:
            experts = p.expert_total * per_block * e * ring("all_gather", eg)
            add(EFSDP, "all_gather", experts, per_block * p.moe_blocks)
            add(
                EFSDP,
                "reduce_scatter",
                p.expert_total * 4 * ring("reduce_scatter", eg),
                p.moe_blocks,
            )
    if zero_stage(layout):
        _add_zero(add, layout, work, p, units)
    elif dr > 1:
        add(DP_REPLICATE, "all_reduce", p.total / ds * 4 * ring("all_reduce", dr), units)
    if tp > 1:
        passes = 3 if layout.ac != "none" else 2  # forward, backward, recomputed forward
        ends = int(load.embedding) + int(load.head)  # embedding / head exchanges
        block_bytes = tp_bytes_per_block(model, layout, work)
        # the forward's (and a recompute's)
        forward = tp_forward_bytes(model, layout, work, software.float8_tp_gather)
        blocks = (passes - 1) * forward + block_bytes  # the forwards, then backward
        tp_bytes = m * (load.layers * blocks + ends * block_bytes / 2)
        op = "all_gather+reduce_scatter" if layout.sequence_parallel else "all_reduce"
        add(TP, op, tp_bytes, m * (passes * 4 * load.layers + 2 * ends))
    if layout.pp > 1:
        sp = tp if layout.sequence_parallel else 1
        hop = microbatch_tokens(layout, work) * model.d_model / sp * e
        stages = layout.stages_per_rank
        add(PP, "send_recv", 2 * m * stages * hop, 2 * m * stages)
    if layout.cp > 1:
        t = cp_traffic(model, layout, work, software)
        add(CP, t.op, *_cp_per_step(t, layout, load.layers))
    if p.moe_blocks:
        _add_moe(add, model, layout, work, p)
    return out


def _add_zero(add: _Add, layout: Layout, work: Workload, p: RankParams, units: int) -> None:
    """ZeRO's data-parallel exchange over ``dp_replicate x cp`` (:data:`ZERO`): the fp32
    gradients reduce-scattered (per step; ZeRO-2 without a pipeline every microbatch, as
    DeepSpeed reduces its buckets as each backward makes them) and the updated parameters
    all-gathered in the compute dtype after the optimizer step, each in ``units`` buckets."""
    z = zero_ranks(layout)
    if z == 1:
        return
    reductions = layout.microbatches if zero_stage(layout) == 2 and layout.pp == 1 else 1
    scattered = p.total * 4 * ring("reduce_scatter", z) * reductions
    add(ZERO, "reduce_scatter", scattered, units * reductions)
    add(ZERO, "all_gather", p.total * compute_bytes(work) * ring("all_gather", z), units)


def _add_moe(add: _Add, model: ModelSpec, layout: Layout, work: Workload, p: RankParams) -> None:
    """The expert-parallel exchanges, tensor parallelism's gathers of routed rows and the
    load counts of ``p``'s MoE blocks."""
    m = layout.microbatches
    forwards = m * p.moe_blocks * (2 if layout.ac != "none" else 1)  # recompute included
    if routed_tp(layout) > 1:
        gathers = tp_gather_passes(layout) * m * p.moe_blocks
        add(TP, "all_gather(routed)", tp_gather_bytes(model, layout, work) * gathers, gathers)
    if layout.ep > 1:
        passes = all_to_all_passes(layout)
        rows = all_to_all_bytes(model, layout, work) * passes * m * p.moe_blocks
        add(EP, "all_to_all", rows, passes * m * p.moe_blocks)
        # the row counts of each forward: E int64, all but 1 / ep of them sent
        counts = model.experts * 8 * ring("all_gather", layout.ep)
        add(EP, "all_to_all(counts)", counts * forwards, forwards)
    if layout.dp > 1:  # the load: E int64 summed over the data-parallel ranks per forward
        dim = DP_SHARD if layout.dp_shard > 1 else DP_REPLICATE
        load = model.experts * 8 * ring("all_reduce", layout.dp) * forwards
        add(dim, "all_reduce(load)", load, forwards)
