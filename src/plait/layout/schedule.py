"""The rules of the pipeline: a known schedule, the stages per rank it runs, a block for
every stage, and at least the microbatches the schedule needs; with the defaults
``plait train`` fills in when they are not given.

What the rules need of a schedule comes in as an argument (:class:`ScheduleFacts`, by name
in a :data:`ScheduleTable`; ``plait.pipeline.SCHEDULES`` is one), so this module stays
core: it does not import the pipeline package.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from plait.layout.dims import PP
from plait.layout.layout import Layout
from plait.layout.reasons import Reason
from plait.layout.shape import ModelShape

__all__ = [
    "INTERLEAVED_STAGES_PER_RANK",
    "ScheduleFacts",
    "ScheduleTable",
    "check_microbatches",
    "check_schedule",
    "check_stages",
    "check_stages_per_rank",
    "default_microbatches",
    "default_stages_per_rank",
    "fewest_microbatches",
    "find_schedule",
    "stage_blocks",
]

#: Stages per rank of a schedule that interleaves several, unless told otherwise.
INTERLEAVED_STAGES_PER_RANK = 2


class ScheduleFacts(Protocol):
    """What the rules need of a pipeline schedule (``plait.pipeline.ScheduleSpec`` has it):
    ``stages_per_rank`` is None for a schedule that holds any number per rank."""

    @property
    def name(self) -> str: ...

    @property
    def stages_per_rank(self) -> int | None: ...

    def min_microbatches(self, n_stages: int) -> int: ...


#: The pipeline schedules by name (``plait.pipeline.SCHEDULES``).
ScheduleTable = Mapping[str, ScheduleFacts]


def find_schedule(schedules: ScheduleTable, name: str) -> ScheduleFacts | None:
    """The schedule ``name`` (case-insensitive), or None."""
    if name in schedules:
        return schedules[name]
    return next((s for key, s in schedules.items() if key.lower() == name.lower()), None)


def check_schedule(schedules: ScheduleTable, name: str) -> list[Reason]:
    """``name`` must be one of ``schedules``."""
    if find_schedule(schedules, name) is not None:
        return []
    message = f"--schedule {name}: Unknown schedule {name!r}; known: {list(schedules)}"
    return [Reason("schedule", message)]


def default_stages_per_rank(spec: ScheduleFacts, pp: int) -> int:
    """Stages per rank when not given: the schedule's own (1 without a pipeline)."""
    if pp == 1:
        return 1
    return spec.stages_per_rank or INTERLEAVED_STAGES_PER_RANK


def check_stages_per_rank(
    layout: Layout, spec: ScheduleFacts, schedules: ScheduleTable
) -> list[Reason]:
    """Several stages per rank need a pipeline and a schedule that interleaves them; a
    schedule of a fixed number runs exactly that."""
    v, field = layout.stages_per_rank, "stages_per_rank"
    if layout.pp == 1:
        if v == 1:
            return []
        return [Reason(field, f"--stages-per-rank {v} needs a pipeline: add --pp 2 or more")]
    if spec.stages_per_rank is not None and v != spec.stages_per_rank:
        *others, last = [s.name for s in schedules.values() if s.stages_per_rank is None]
        message = (
            f"--schedule {spec.name} runs exactly {spec.stages_per_rank} stage(s) per rank, but "
            f"--stages-per-rank is {v}: drop --stages-per-rank, or use a schedule for several "
            f"stages per rank ({', '.join(others)} or {last})"
        )
        return [Reason(field, message)]
    if spec.stages_per_rank is None and v == 1:
        single = " / ".join(s.name for s in schedules.values() if s.stages_per_rank == 1)
        message = (
            f"--schedule {spec.name} interleaves several stages per rank, but "
            f"--stages-per-rank is 1: use --stages-per-rank {INTERLEAVED_STAGES_PER_RANK} (or "
            f"more), or --schedule {single} for one stage per rank"
        )
        return [Reason(field, message)]
    return []


def stage_blocks(blocks: int, n_stages: int, end_blocks: int = 0) -> list[int]:
    """Blocks per pipeline stage, in order: ``blocks`` and the ends' weight split evenly
    (earlier stages take one more when they do not divide), where the first stage's
    embedding and the last stage's head each count as ``end_blocks`` blocks (torchtitan's
    ``pipeline_parallel_first_stage_less_layers`` and ``..._last_stage_less_layers``, both
    1 there; Llama 3 405B's 126 blocks over 16 x 8 stages: the first holds the embedding
    alone, the last the head alone). ValueError when a stage would hold nothing (more
    stages than blocks and ends) or an end outweighs its stage's share."""
    if n_stages < 1:
        raise ValueError(f"{n_stages} pipeline stages: a model runs as 1 or more")
    if n_stages == 1:
        return [blocks]
    units = blocks + 2 * end_blocks
    if end_blocks < 0 or n_stages > units:
        raise ValueError(
            f"{n_stages} pipeline stages but only {blocks} blocks"
            + (f" and two ends of {end_blocks}" if end_blocks else "")
            + ": every stage needs at least one"
        )
    size, extra = divmod(units, n_stages)
    sizes = [size + (1 if s < extra else 0) for s in range(n_stages)]
    sizes[0] -= end_blocks
    sizes[-1] -= end_blocks
    if sizes[-1] < 0:  # the last stage's share is the smallest
        raise ValueError(
            f"end blocks {end_blocks}: more than a stage's share ({size}) of {blocks} blocks "
            f"and the two ends over {n_stages} stages"
        )
    return sizes


def _ends_that_fit(blocks: int, n_stages: int) -> int:
    """The smallest ``end_blocks`` with which ``blocks`` split into ``n_stages`` (0: none).

    The closed form of :func:`stage_blocks`'s rule, since the search asks it of every
    layout with too many stages (trying each ``end_blocks`` in turn cost ``n_stages ** 2``
    steps, most of a 10,240-GPU search): with ends of ``e`` the last stage, the smallest,
    keeps ``(blocks + 2 e) // n_stages - e`` blocks, not negative exactly when
    ``blocks >= (n_stages - 2) e``, which ``e = 1`` satisfies if any ``e`` does."""
    return 1 if 2 <= n_stages <= blocks + 2 else 0


def check_stages(model: ModelShape, layout: Layout) -> list[Reason]:
    """Every pipeline stage needs at least one block, or the embedding or the head
    (:func:`stage_blocks`)."""
    n, ends = layout.n_stages, layout.end_blocks
    if ends < 0:
        return [Reason("end_blocks", f"--end-blocks {ends}: use 0 or more")]
    if n == 1:
        return []
    try:
        stage_blocks(model.layers, n, ends)
    except ValueError:
        pass
    else:
        return []
    if ends and n <= model.layers + 2 * ends:
        message = (
            f"--end-blocks {ends}: each end counts as {ends} blocks, more than one of the "
            f"{n} pipeline stages' share of {model.layers} blocks and both ends: use a smaller "
            "--end-blocks, or fewer stages"
        )
        return [Reason("end_blocks", message)]
    blocks = f"--n-layer {model.layers}" if model.from_flags else str(model.layers)
    fix = f"use --n-layer {n} or more, or fewer stages" if model.from_flags else "use fewer stages"
    ends_fix = _ends_that_fit(model.layers, n)
    if ends_fix > ends:  # the embedding and the head as stages of their own
        fix += f", or --end-blocks {ends_fix} (the embedding and the head as stages of their own)"
    ends_text = f" and two ends of --end-blocks {ends}" if ends else ""
    message = (
        f"--pp {layout.pp} x {layout.stages_per_rank} stage(s) per rank = {n} pipeline "
        f"stages, but the model has only {blocks} blocks{ends_text} (a stage needs at least "
        f"one): {fix}"
    )
    return [Reason(PP, message)]


def fewest_microbatches(layout: Layout, spec: ScheduleFacts) -> int:
    """The fewest microbatches ``layout``'s pipeline runs (1 without one)."""
    return spec.min_microbatches(layout.n_stages) if layout.pp > 1 else 1


def default_microbatches(layout: Layout) -> int:
    """Microbatches when not given: one per pipeline stage, 1 without a pipeline."""
    return layout.n_stages if layout.pp > 1 else 1


def check_microbatches(layout: Layout, spec: ScheduleFacts) -> list[Reason]:
    """A pipeline runs at least its schedule's fewest microbatches."""
    fewest = fewest_microbatches(layout, spec)
    if layout.microbatches >= fewest:
        return []
    message = (
        f"--schedule {layout.schedule} over {layout.n_stages} pipeline stages needs at "
        f"least {fewest} microbatches, got --microbatches {layout.microbatches}: use "
        f"--microbatches {fewest} or more"
    )
    return [Reason("microbatches", message)]
