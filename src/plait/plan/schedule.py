"""What plait's pipeline schedule does to each rank: layers held, microbatches in flight,
and the bubble, read from plait's own schedule generator and simulator
(:mod:`plait.pipeline.schedules`, :mod:`plait.pipeline.simulate`), not from a formula.

Stages get blocks as :func:`plait.pipeline.stage_layers` gives them (contiguous runs,
earlier stages one more when they do not divide); the embeddings go with the first stage,
the final norm and head with the last. The simulation is compute-only with uniform stages,
``F = 1`` and ``B = 2`` (split backwards: ``I = W = 1``); the makespan is reported in units
of one stage's forward plus backward for one microbatch, so a step lasts ``makespan x
(F + B)`` of the slowest stage. Checkpointing makes backward longer than twice the forward;
the makespan is scaled, not re-simulated, which is exact for GPipe and 1F1B and close for
the others. Results are cached: a search simulates each (schedule, ranks, stages,
microbatches) once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from plait.pipeline.actions import Action, ActionKind, Schedule, stage_to_rank
from plait.pipeline.schedules import generate, schedule_spec
from plait.pipeline.simulate import simulate
from plait.plan.spec import Layout, ModelSpec

__all__ = ["PipelineShape", "RankLoad", "layout_shape", "pipeline_shape"]


@dataclass(frozen=True)
class RankLoad:
    """One pipeline rank's share: what its memory and time depend on."""

    rank: int
    layers: int  # blocks held, over all its stages
    stage_layers: int  # blocks of its largest stage
    embedding: bool  # holds the first stage (token and position embeddings)
    head: bool  # holds the last stage (final norm, head, loss)
    in_flight: int  # (stage, microbatch) activations held at once, at most
    head_in_flight: int  # of those, microbatches of the last stage (logits saved)


@dataclass(frozen=True)
class PipelineShape:
    """``ranks``: the pipeline ranks whose memory can be the largest (the others hold less
    of everything than one of these); ``makespan``: the step in units of one stage's forward
    plus backward of one microbatch; ``bubble``: idle fraction of the ranks' time (0
    without a pipeline)."""

    ranks: tuple[RankLoad, ...]
    makespan: float
    bubble: float


def _split(layers: int, n_stages: int) -> list[int]:
    size, extra = divmod(layers, n_stages)
    return [size + (1 if s < extra else 0) for s in range(n_stages)]


def _peak_live(actions: list[Action], stage: int) -> int:
    """Most microbatch activations of ``stage`` alive at once among ``actions``."""
    live = peak = 0
    for a in actions:
        if a.stage != stage:
            continue
        kind = a.kind
        if kind is ActionKind.FORWARD:
            live += 1
            peak = max(peak, live)
        elif kind in (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_WEIGHT):
            live -= 1
    return peak


def _pareto(loads: list[RankLoad]) -> tuple[RankLoad, ...]:
    """The loads not dominated by another (memory grows with every field)."""

    def key(r: RankLoad) -> tuple[int, int, int, int, int, int]:
        return (r.layers, r.stage_layers, r.embedding, r.head, r.in_flight, r.head_in_flight)

    keys = {key(r): r for r in loads}  # one rank per distinct load
    out = [
        r
        for k, r in keys.items()
        if not any(o != k and all(a >= b for a, b in zip(o, k, strict=True)) for o in keys)
    ]
    return tuple(sorted(out, key=lambda r: r.rank))


@functools.lru_cache(maxsize=4096)
def pipeline_shape(
    layers: int,
    pp: int,
    schedule: str = "1F1B",
    stages_per_rank: int = 1,
    microbatches: int = 1,
) -> PipelineShape:
    """The pipeline ranks' loads and the bubble of ``schedule`` (see the module docstring).

    Without a pipeline (``pp == 1``): one rank holding everything, one microbatch in flight
    (gradient accumulation runs microbatches one after another). ValueError (from the
    generator) for shapes plait's schedules refuse.
    """
    if pp == 1:
        return PipelineShape((RankLoad(0, layers, layers, True, True, 1, 1),), 1.0, 0.0)
    spec = schedule_spec(schedule)
    n_stages = pp * stages_per_rank
    if n_stages > layers:
        raise ValueError(
            f"{pp} x {stages_per_rank} = {n_stages} pipeline stages but only {layers} blocks: "
            "every stage needs at least one"
        )
    plan: Schedule = generate(spec.name, pp, n_stages, microbatches)
    sim = simulate(plan, {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0})
    sizes = _split(layers, n_stages)
    loads = []
    for rank in range(pp):
        mine = [s for s in range(n_stages) if stage_to_rank(s, pp, spec.style) == rank]
        loads.append(
            RankLoad(
                rank=rank,
                layers=sum(sizes[s] for s in mine),
                stage_layers=max(sizes[s] for s in mine),
                embedding=0 in mine,
                head=n_stages - 1 in mine,
                in_flight=sim.peak_activations[rank],
                head_in_flight=_peak_live(plan[rank], n_stages - 1) if n_stages - 1 in mine else 0,
            )
        )
    return PipelineShape(_pareto(loads), sim.makespan / 3, sim.bubble_fraction)


def layout_shape(model: ModelSpec, layout: Layout) -> PipelineShape:
    """:func:`pipeline_shape` of ``model`` under ``layout``."""
    return pipeline_shape(
        model.layers, layout.pp, layout.schedule, layout.stages_per_rank, layout.microbatches
    )
