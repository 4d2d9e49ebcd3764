"""One pipeline rank as the memory model reads it (:mod:`plait.plan.memory`): its load
(less the blocks its recipe takes off an end stage), its recipe and software (the
framework's dtypes: :class:`~plait.plan.spec.Software`), its elements after tensor
parallelism and ``fully_shard``'s padded units, and the figures every part of its memory
derives from them (the dtypes' bytes, the sharding ranks, the microbatch's tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plait.plan.keeps import Keeps
from plait.plan.schedule import RankLoad
from plait.plan.shards import (
    RankParams,
    compute_bytes,
    fsdp_ranks,
    microbatch_tokens,
    padded_params,
    rank_params,
)
from plait.plan.spec import Layout, ModelSpec, Software, Workload, zero_stage

__all__ = ["MemoryRank", "memory_rank"]


@dataclass(frozen=True)
class MemoryRank:
    """One pipeline rank as every part of its memory reads it: ``load`` less the blocks
    its recipe takes off an end stage (``blocks_scale``: the share it keeps), its
    elements after tensor parallelism (``params``) and ``fully_shard``'s padded units
    (``padded``), and the figures derived once from them (the search reads tens of
    thousands of ranks)."""

    model: ModelSpec
    layout: Layout
    work: Workload
    load: RankLoad
    keeps: Keeps
    software: Software
    blocks_scale: float
    params: RankParams
    padded: RankParams
    e: int  # bytes of the compute dtype
    e_res: int  # bytes of the residual stream's elements (norm inputs)
    ds: int  # the ranks fully_shard shards over (dp_shard x cp)
    zero: int  # ZeRO's stage (0: none)
    n: float  # tokens of one microbatch on this rank
    seq_split: int  # what sequence parallelism divides the residual stream by (else 1)
    autocast: bool  # --mp bf16 without fully_shard or ZeRO: plait runs it under autocast
    pipelined: bool
    accumulating: bool  # gradients accumulate over the step's microbatches (or stages)
    grad_bytes: int  # bytes of a gradient buffer element: the reduction's dtype
    weight_bytes: int  # bytes of a stored (master) weight and of a fully_shard gradient shard
    moment_bytes: int  # bytes of one optimizer moment
    master_bytes: int  # bytes ZeRO's optimizer keeps per parameter for the master weights


def memory_rank(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    load: RankLoad,
    keeps: Keeps,
    software: Software | None = None,
) -> MemoryRank:
    """The rank of ``load``, less the blocks ``keeps.end_stage_fewer`` takes off an end
    stage of a pipeline, under ``software`` (default: plait's).

    The dtypes (:class:`~plait.plan.spec.Software`): gradient buffers in the reduction's
    dtype (``grad_reduce_fp32``); ``optimizer_states`` ``"fp32"`` stores fp32 weights
    (``fully_shard``'s shards; ZeRO's master partition beside the compute-dtype weights)
    and fp32 moments, ``"remainders"`` fp32 moments and compute-dtype weights with their
    16-bit remainders as the master (none in fp32 compute), ``"bf16"`` bf16 moments and
    compute-dtype weights, no master."""
    software = software or Software()
    blocks_scale = 1.0
    if keeps.end_stage_fewer and layout.pp > 1 and (load.embedding or load.head):
        fewer = min(keeps.end_stage_fewer, load.layers - 1)
        blocks_scale = (load.layers - fewer) / load.layers
        load = dataclasses.replace(load, layers=load.layers - fewer)
    params, padded = rank_params(model, layout, load), padded_params(model, layout, load)
    e, ds, zero, tp = compute_bytes(work), fsdp_ranks(layout), zero_stage(layout), layout.tp
    autocast = work.precision == "bf16" and ds == 1 and not zero
    # Norm inputs live in the residual stream: fp32 under plait's autocast, else e (a model
    # kept in the compute dtype: fully_shard's cast, ZeRO, Megatron-LM).
    e_res = 4 if autocast and keeps.activations != "megatron" else e
    pipelined = layout.pp > 1
    return MemoryRank(
        model=model,
        layout=layout,
        work=work,
        load=load,
        keeps=keeps,
        software=software,
        blocks_scale=blocks_scale,
        params=params,
        padded=padded,
        e=e,
        e_res=e_res,
        ds=ds,
        zero=zero,
        n=microbatch_tokens(layout, work),
        seq_split=tp if layout.sequence_parallel and tp > 1 else 1,
        autocast=autocast,
        pipelined=pipelined,
        accumulating=pipelined or layout.microbatches > 1,
        grad_bytes=4 if software.grad_reduce_fp32 else e,
        weight_bytes=4 if software.optimizer_states == "fp32" else e,
        moment_bytes=2 if software.optimizer_states == "bf16" else 4,
        master_bytes=_master_bytes(software.optimizer_states, e),
    )


def _master_bytes(states: str, e: int) -> int:
    """Bytes per parameter of the master weights a ZeRO optimizer keeps beside the
    compute-dtype weights: none in fp32 compute (the weights are the master) or without
    one (``"bf16"``), the 16-bit remainders (``"remainders"``), else an fp32 copy."""
    if e >= 4 or states == "bf16":
        return 0
    return 2 if states == "remainders" else 4
