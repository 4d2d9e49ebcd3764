"""One pipeline rank as the memory model reads it (:mod:`plait.plan.memory`): its load
(less the blocks its recipe takes off an end stage), its recipe, its elements after tensor
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
from plait.plan.spec import Layout, ModelSpec, Workload, zero_stage

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


def memory_rank(
    model: ModelSpec, layout: Layout, work: Workload, load: RankLoad, keeps: Keeps
) -> MemoryRank:
    """The rank of ``load``, less the blocks ``keeps.end_stage_fewer`` takes off an end
    stage of a pipeline."""
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
    )
