"""Seconds of communication on a rank's links, and the exchanges inside a block that
compute does not hide: tensor, context and expert parallelism's, per block and
microbatch, and a pipeline's sends (:mod:`plait.plan.timing`).

**Links** (bytes from :mod:`plait.plan.comm`): time = bytes / link bandwidth + the
device's ``latency`` per call. Collectives whose group spans nodes with ``k`` members in
each node run at ``k x`` the network's rate per rank, at most NVLink's (NCCL's rings side
by side, one per NIC).

**Tensor parallelism**: ``tp_overlap="none"`` (plait's recipe, the default: torch's TP
collectives run synchronously in the compute stream) exposes them whole; ``"async"``
(Megatron's TP communication overlap) exposes of each collective what exceeds the GEMMs it
is decomposed into: in forward the attention's input gather its q, k and v GEMMs, the
output projection's reduce-scatter that projection, the MLP's gather its input GEMMs and
its reduce-scatter its output GEMM; in backward the gathers of output gradients the
input-gradient GEMMs they feed and the reductions of input gradients the input
projections' weight-gradient GEMMs (each priced as its forward GEMM). So a block whose
attention projections are short (a small model at a high tp) exposes part of its
attention's collectives however long its MLP runs; ``"micro-pipeline"`` (torch's async
TP as torchtitan runs it: ``torch/_inductor/fx_passes/micro_pipeline_tp.py``) the same in
forward, but in backward
only the two all-gathers (of the output gradients, each feeding one matmul) are fused:
the two reduce-scatters of the input gradients reduce sums of several matmuls (q, k and v;
the MLP's input GEMMs), which the pass does not fuse (it needs one producer matmul), so
they stay exposed whole. With ``Software.float8_tp_gather``
(torchtitan's Float8 tensorwise TP) the forward's two all-gathers move fp8.

**Context parallelism** (``cp`` ranks per sequence, :mod:`plait.context`): a rank computes
its ``seq_len / cp`` tokens of each of its data-parallel rank's sequences, each attending
to the whole sequence (so attention's FLOPs per rank fall by ``cp`` like the rest; the
causal load balancing makes the ranks' shares equal). Its key/value exchange per block
(:func:`~plait.plan.comm.cp_traffic`), on NVLink while ``cp x tp`` ranks fit a node:

* ``allgather`` and ``alltoall``: exposed whole. The all-gather (its reduce-scatter in
  backward) and the all-to-alls sit between the q, k, v projections and attention, and
  between attention and the output projection: nothing of the block runs beside them.
* ``ring``: overlapped with attention. Each shift starts before the current block's
  attention runs, so per block only what exceeds the attention's compute (forward: the
  forward's; backward: twice that) is exposed, latencies included. That assumes the
  kernels run at the same rate beside the transfers and that no shift waits on one
  another.
* torch's ``allgather`` (``Software`` whose stack runs torch's ``context_parallel``:
  :mod:`plait.plan.stacks`, "Context parallelism"): its all-gather runs beside the first
  of the ``cp`` attention blocks (``1 / cp`` of the pass's attention, the load balancing
  giving every block an equal share), in forward and again in backward; each of the
  backward's ``cp`` shifts of the fp32 key/value gradients beside the next block's
  backward, the last one exposed whole.

What of a context-parallel exchange runs hidden slows the attention beside it, as a
data-parallel collective does the compute beside it (:mod:`plait.plan.timing`,
"Interference": NCCL's all-gathers, all-to-alls and sends hold their thread blocks while
they run).

Recomputation (``--ac full`` or ``selective``) repeats the forward's exchange, but for
torchtitan's selective policy, which saves the reduce-scatters' outputs (its
``activation_checkpoint.py``): that recompute repeats tensor parallelism's all-gathers
only (without sequence parallelism its all-reduces, which nothing saves). ``fully_shard``
shards over ``dp_shard x cp`` and its collectives have that many ranks.

**Mixture of experts.** A MoE block's expert-parallel all-to-alls (of its tp chunk of the
routed rows) sit between the router and the experts and between the experts and the
residual: nothing runs beside them, so they are exposed whole, like tensor parallelism's,
per MoE block and microbatch: dispatch and combine in forward, both again in backward, and
the forward's in a recompute; each forward also pays the latency of its row-count exchange
and load all-reduce. Under tensor parallelism the chunks' outputs are all-gathered over tp
(in backward the input rows' gradients), one all-gather per pass, exposed whole as well.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.layout import CP, EFSDP, EP, PP, TP
from plait.plan.comm import (
    CpTraffic,
    _span,
    all_to_all_bytes,
    cp_traffic,
    ep_span,
    link_bandwidth,
    tp_collective_bytes,
    tp_gather_bytes,
)
from plait.plan.shards import (
    compute_bytes,
    expert_fsdp_ranks,
    fsdp_ranks,
    microbatch_tokens,
    routed_tp,
)
from plait.plan.spec import DeviceSpec, Layout, ModelSpec, Software, Workload

__all__ = [
    "cp_exposed",
    "link_seconds",
    "microbatch_hop",
    "moe_exchanges",
    "tp_exposed",
]


def _bandwidth(dim: str, layout: Layout, device: DeviceSpec, span: int | None) -> float:
    """Per rank bandwidth of ``dim``'s collectives, a group spanning ``span`` consecutive
    ranks (None: as plait's mesh lays ``dim`` out). Inside a node NVLink's; across nodes, a
    group with ``k`` members in each node runs ``k`` rings side by side, one per NIC
    (NCCL's channels over rail-optimised networks), each member's NIC carrying ``1 / k``
    of the node-crossing traffic: ``k x`` the network's rate, at most NVLink's."""
    span = span or _span(dim, layout)
    bw = link_bandwidth(dim, layout, device, span)
    if bw != device.inter_node_bw or dim == PP:
        return bw
    sizes = {EP: layout.ep, EFSDP: expert_fsdp_ranks(layout), "dp_shard_cp": fsdp_ranks(layout)}
    sizes["zero"] = layout.dp_replicate * layout.cp
    size = sizes[dim] if dim in sizes else int(getattr(layout, dim))
    per_node = max(1, device.gpus_per_node * size // max(span, 1))
    return min(device.intra_node_bw, per_node * device.inter_node_bw)


def link_seconds(
    nbytes: float,
    dim: str,
    layout: Layout,
    device: DeviceSpec,
    calls: int,
    span: int | None = None,
) -> float:
    """Seconds of ``calls`` collectives of ``dim`` moving ``nbytes`` per rank in all, each
    group spanning ``span`` consecutive ranks (None: plait's mesh's)."""
    return nbytes / _bandwidth(dim, layout, device, span) + calls * device.latency


def tp_exposed(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    fused: Sequence[float],
    overlap: str,
    fp8_gathers: bool = False,
) -> tuple[float, float, float]:
    """Seconds tensor parallelism's collectives expose in one block for one microbatch
    (module docstring): ``(forward, backward, again)``, ``again`` what a recompute that
    keeps the reduce-scatters' outputs repeats (torchtitan's selective checkpointing): the
    forward's all-gathers, or without sequence parallelism its all-reduces, whole.

    Exposed whole, or with ``overlap`` ``"async"`` each collective beyond the GEMMs it is
    decomposed into, or with ``"micro-pipeline"`` the same but backward's reduce-scatters
    whole. ``fused``: the forward's GEMMs after each of the four collectives (attention's
    input gather, its output reduction, the MLP's input gather and output reduction:
    ``roofline.BlockKernels.fused``); backward's gathers feed the input-gradient GEMMs of
    the two output projections and its reductions follow the input projections' (priced as
    their forward GEMMs). ``fp8_gathers`` (``Software.float8_tp_gather``): the forward's
    two all-gathers move 1 byte per element, its two reduce-scatters and the backward's
    four exchanges the compute dtype's."""
    if layout.tp == 1:
        return 0.0, 0.0, 0.0
    gather_bytes, reduce_bytes = tp_collective_bytes(model, layout, work, fp8_gathers)
    gather = link_seconds(gather_bytes, TP, layout, device, 1)
    reduce = link_seconds(reduce_bytes, TP, layout, device, 1)
    t_fwd, t_bwd = 2 * (gather + reduce), 4 * reduce
    sp = layout.sequence_parallel
    if overlap not in ("async", "micro-pipeline") or not device.overlap:
        return t_fwd, t_bwd, 2 * gather if sp else t_fwd
    if overlap == "micro-pipeline" and not sp:  # all-reduces are not fused
        return t_fwd, t_bwd, t_fwd
    attn_in, attn_out, mlp_in, mlp_out = fused
    gathers = max(0.0, gather - attn_in) + max(0.0, gather - mlp_in)
    back = max(0.0, reduce - attn_out) + max(0.0, reduce - mlp_out)
    fwd = gathers + back
    again = gathers if sp else fwd
    if overlap == "micro-pipeline":  # backward's reductions of sums of matmuls stay whole
        return fwd, 2 * reduce + back, again
    return fwd, back + max(0.0, reduce - attn_in) + max(0.0, reduce - mlp_in), again


def moe_exchanges(
    model: ModelSpec, layout: Layout, work: Workload, device: DeviceSpec, ep_inner: bool = False
) -> tuple[float, float]:
    """Seconds one MoE block's exchanges take in forward and in backward for one
    microbatch, all exposed (module docstring): the all-to-alls of dispatch and combine,
    the row counts' and the load's latencies, and the routed rows' all-gather over tp.
    ``ep_inner`` (``Software.ep_inner``): an ep group is ``ep`` consecutive ranks, not
    plait's ``ep x tp``."""
    span = ep_span(layout, ep_inner)
    one = link_seconds(all_to_all_bytes(model, layout, work), EP, layout, device, 0, span)
    latency = device.latency * ((3 if layout.ep > 1 else 0) + (1 if layout.dp > 1 else 0))
    exchange = 2 * one + latency  # forward: counts, dispatch, combine (and the load)
    back = 2 * one + (2 * device.latency if layout.ep > 1 else 0.0)
    if routed_tp(layout) > 1:  # the routed rows' all-gather over tp, one per pass
        gathered = link_seconds(tp_gather_bytes(model, layout, work), TP, layout, device, 1)
        exchange, back = exchange + gathered, back + gathered
    return exchange, back


def cp_exposed(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    attention: float,
    software: Software | None = None,
    contention: float = 0.0,
) -> tuple[float, float]:
    """Seconds context parallelism's exchange adds to one block's forward and backward for
    one microbatch (module docstring), as ``software`` (default plait's) runs it:
    what is exposed, plus ``contention`` (the fraction of compute a collective beside it
    takes, :func:`plait.plan.timing.interference`) of what runs hidden; ``attention``: the
    forward's attention compute, which a ring's shifts run beside (the backward's is twice
    that)."""
    t = cp_traffic(model, layout, work, software)
    fwd = link_seconds(t.forward, CP, layout, device, t.forward_calls)
    bwd = link_seconds(t.backward, CP, layout, device, t.backward_calls)
    exposed = _cp_exposed(layout, device, attention, t, fwd, bwd)
    return (
        exposed[0] + contention * max(0.0, fwd - exposed[0]),
        exposed[1] + contention * max(0.0, bwd - exposed[1]),
    )


def _cp_exposed(
    layout: Layout,
    device: DeviceSpec,
    attention: float,
    t: CpTraffic,
    fwd: float,
    bwd: float,
) -> tuple[float, float]:
    """What of the exchange's ``fwd`` and ``bwd`` seconds (:func:`cp_exposed`) nothing
    hides."""
    if not device.overlap:
        return fwd, bwd
    if layout.cp_method == "ring":
        return max(0.0, fwd - attention), max(0.0, bwd - 2 * attention)
    if t.shift:  # torch's all-gather method
        # each gather beside the first block's attention (1 / cp of the pass's, every
        # block an equal share under the causal load balancing), each of the cp
        # accumulator shifts beside the next block's backward, the last one waited on whole
        shift = link_seconds(t.shift, CP, layout, device, 1)
        step_fwd, step_bwd = attention / layout.cp, 2 * attention / layout.cp
        back = max(0.0, fwd - step_bwd) + (layout.cp - 1) * max(0.0, shift - step_bwd) + shift
        return max(0.0, fwd - step_fwd), back  # fwd: the gather, one call
    return fwd, bwd


def microbatch_hop(model: ModelSpec, layout: Layout, work: Workload, device: DeviceSpec) -> float:
    """Seconds to send one microbatch's activation to the next pipeline stage."""
    sp = layout.tp if layout.sequence_parallel else 1
    n = microbatch_tokens(layout, work)
    e = compute_bytes(work)
    return link_seconds(n * model.d_model / sp * e, PP, layout, device, 1)
