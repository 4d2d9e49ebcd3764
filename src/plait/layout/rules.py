"""Every rule at once (:func:`check`), in the order ``plait train`` reports them, and the
rule of the batch that ties the layout to the data (:func:`check_batch`).

``plait train`` (which refuses a configuration before any worker starts) and ``plait
plan`` (which searches the layouts of N devices) both ask :func:`check`, so a layout the
planner proposes is one that training runs.
"""

from __future__ import annotations

from plait.layout.dims import DATA_PARALLEL, EP
from plait.layout.layout import Layout
from plait.layout.reasons import Reason, flag
from plait.layout.schedule import (
    ScheduleTable,
    check_microbatches,
    check_schedule,
    check_stages,
    check_stages_per_rank,
    find_schedule,
)
from plait.layout.shape import ModelShape, cp_shard
from plait.layout.splits import check_cp, check_ep, check_tp
from plait.layout.world import World, check_sizes, check_world

__all__ = ["check", "check_batch"]


def check(
    layout: Layout, model: ModelShape, batch: int, world: World, schedules: ScheduleTable
) -> list[Reason]:
    """Every reason ``layout`` cannot run ``model`` on global batches of ``batch``
    sequences over ``world``, with the pipeline ``schedules`` (a table by name); [] when it
    can. In the order ``plait train`` reports them."""
    counts = {**layout.sizes, EP: layout.ep, "stages_per_rank": layout.stages_per_rank}
    reasons = check_sizes({**counts, "microbatches": layout.microbatches})
    if reasons:
        return reasons  # the rules below divide by these
    reasons += check_world(layout.sizes, world)
    reasons += check_cp(model, layout.cp, layout.cp_method, layout.tp)
    if not reasons or layout.cp == 1:  # tp splits each cp rank's share of a sequence
        reasons += check_tp(cp_shard(model, layout.cp), layout.tp, layout.sequence_parallel)
    reasons += check_ep(model, layout.ep, layout.dp_shard * layout.cp)
    spec = find_schedule(schedules, layout.schedule)
    if spec is None:
        reasons += check_schedule(schedules, layout.schedule)
    else:
        reasons += check_stages_per_rank(layout, spec, schedules)
        reasons += check_stages(model, layout)
        reasons += check_microbatches(layout, spec)
    return reasons + check_batch(batch, layout)


def check_batch(batch: int, layout: Layout) -> list[Reason]:
    """The global batch splits evenly over the data-parallel ranks, and each rank's share
    over the microbatches."""
    dp, m = layout.dp, layout.microbatches
    if batch % dp:
        ranks = " x ".join(f"{flag(d)} {getattr(layout, d)}" for d in DATA_PARALLEL)
        fix = dp * max(1, round(batch / dp))
        message = (
            f"--batch-size {batch} does not split evenly over {dp} data-parallel ranks "
            f"({ranks}): use a multiple of {dp}, e.g. --batch-size {fix}"
        )
        return [Reason("batch", message)]
    local = batch // dp
    if local % m == 0:
        return []
    message = (
        f"--microbatches {m} does not divide the {local} sequences per data-parallel rank "
        f"(--batch-size {batch} / {dp}): use a --microbatches that divides {local}, or a "
        f"--batch-size that is a multiple of {dp * m}"
    )
    return [Reason("microbatches", message)]
