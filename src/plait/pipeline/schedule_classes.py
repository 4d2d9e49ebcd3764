"""torch's schedule classes, each a thin shell over one generated action list.

``ScheduleGPipe`` and ``Schedule1F1B`` take one stage per rank; ``ScheduleInterleaved1F1B``,
``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble`` take
this rank's list of stages. Each builds its action list once, with
:func:`~plait.pipeline.schedules.generate` (plus communication, plus FSDP actions when a
stage does data parallelism), validates it, and hands it to the one runtime
(:func:`~plait.pipeline.runtime.run_actions`) at every ``step``.

``step(*args, target=None, losses=None, **kwargs)`` takes the whole batch: the first stage
uses ``args``, the last stage ``target``; keyword arguments go to every stage. On the rank
of the last stage it returns the merged output and fills ``losses`` with the per-microbatch
losses; elsewhere it returns None. ``eval(...)`` is the same with forwards only, no graph.

Agreement. At its first run, just before this rank first sends or receives (errors it
finds on its own before then stay local), a schedule all-gathers over the pipeline group
each rank's schedule name, number of microbatches and number of stages; if they differ,
every rank raises :class:`~plait.spmd.DivergenceError` naming each side (the ranks would
otherwise wait forever for messages the others never send). Every step notes its schedule and
number of microbatches with :func:`plait.spmd.agree`, runs with the per-backward checks
of ``fully_shard`` / ``replicate`` deferred, and ends with one
``spmd.check("end of a pipeline step")``: with divergence checking on, a rank that runs
an extra step, or that stays stuck in a transfer, fails within the deadline.

Gradient scale. torch divides gradients by the number of microbatches, which equals a
whole-batch mean loss only when microbatches are equal. plait seeds microbatch i's
backward with ``rows_i / rows``: the same for equal microbatches, and still the
whole-batch mean for an uneven last one (for a loss that is a mean over the batch, as
torch's ``scale_grads=True`` assumes). ``scale_grads=False`` seeds with 1 (sum losses).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from plait import spmd
from plait.pipeline.actions import ActionKind, Schedule, Style, stage_to_rank
from plait.pipeline.grad_sync import StageGradSync
from plait.pipeline.microbatch import (
    ChunkSpec,
    merge_chunks,
    split_args_kwargs_into_chunks,
)
from plait.pipeline.runtime import LossFn, StepData, StepResult, run_actions
from plait.pipeline.schedules import (
    SCHEDULES,
    add_communication,
    add_fsdp_actions,
    generate,
    schedule_spec,
)
from plait.pipeline.simulate import simulate
from plait.pipeline.stage import PipelineStage
from plait.pipeline.validate import validate

K = ActionKind
logger = logging.getLogger(__name__)

__all__ = [
    "SCHEDULE_CLASSES",
    "PipelineSchedule",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
]


class PipelineSchedule:
    """A named schedule over this rank's ``stages``; subclasses fix ``name``."""

    name: ClassVar[str]

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        args_chunk_spec: Sequence[ChunkSpec] | None = None,
        kwargs_chunk_spec: Mapping[str, ChunkSpec] | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
    ) -> None:
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int):
            raise TypeError(f"n_microbatches must be an int, got {n_microbatches!r}")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        self._stages = {s.stage_index: s for s in _check_stages(self.name, stages)}
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        first = next(iter(self._stages.values()))
        self._n_ranks, self._n_stages = first.group_size, first.num_stages
        self._group_rank, self._group, self._device = first.group_rank, first.group, first.device
        self._agreed = self._n_ranks == 1  # checked at the first run (_check_agreement)
        self._syncs = {
            i: sync for i, s in self._stages.items() if (sync := StageGradSync(s.submod)).active
        }
        style = schedule_spec(self.name).style
        compute = generate(self.name, self._n_ranks, self._n_stages, n_microbatches)
        forwards = {r: [a for a in acts if a.kind is K.FORWARD] for r, acts in compute.items()}
        self._train = self._lower(compute, style, backward=True)
        self._eval = self._lower(forwards, style, backward=False)
        self._place_stages(style)
        logger.debug(
            "%s on pipeline rank %d: %s",
            self.name,
            self._group_rank,
            " ".join(map(str, self._train[self._group_rank])),
        )

    @property
    def pipeline_order(self) -> Schedule:
        """Every pipeline rank's actions, as torch's ``pipeline_order``."""
        return self._train

    def _lower(self, compute: Schedule, style: Style, *, backward: bool) -> Schedule:
        """Add communication (and FSDP) actions to ``compute`` and check the result."""
        n_ranks, n_stages, m = self._n_ranks, self._n_stages, self._n_microbatches
        schedule = add_communication(compute, n_ranks, style, n_stages)
        if self._syncs:  # each rank lowers its own FSDP actions: they involve no other rank
            schedule = add_fsdp_actions(schedule)
        if backward:
            validate(schedule, n_ranks, n_stages, m, style=style)
        else:
            simulate(schedule)  # validate wants backwards; a deadlock still raises here
        return schedule

    def _place_stages(self, style: Style) -> None:
        """Check that this rank holds exactly its stages; connect them to their neighbours."""
        rank_of_stage = [stage_to_rank(s, self._n_ranks, style) for s in range(self._n_stages)]
        expected = [s for s, r in enumerate(rank_of_stage) if r == self._group_rank]
        if sorted(self._stages) != expected:
            raise ValueError(
                f"{self.name} with {self._n_stages} stages on {self._n_ranks} pipeline ranks "
                f"places stages {expected} on pipeline rank {self._group_rank} ({style!r} "
                f"placement), but this rank was given stages {sorted(self._stages)}"
            )
        for stage in self._stages.values():
            stage.attach(rank_of_stage, self._stages)

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One training step on the whole batch; see the module docstring."""
        return self._run(args, kwargs, target, losses, backward=self._loss_fn is not None)

    def eval(
        self,
        *args: Any,
        target: Any = None,
        losses: list[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Forwards only, no gradients: the merged output on the last stage's rank."""
        with torch.no_grad():
            return self._run(args, kwargs, target, losses, backward=False)

    def _run(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        losses: list[torch.Tensor] | None,
        backward: bool,
    ) -> Any:
        """Run this rank's actions of the training (``backward``) or the forward-only order."""
        order = self._train if backward else self._eval
        m = self._n_microbatches
        what = "pipeline_step" if backward else "pipeline_forward"
        spmd.agree(what, m, self._group, f"{self.name} with {m} microbatches")
        data = self._step_data(args, kwargs, target, backward)
        agree = None if self._agreed else self._check_agreement
        with spmd.deferred_checks():  # stages reach their backwards at different times
            result = run_actions(
                order[self._group_rank], self._stages, self._syncs, data, before_first_message=agree
            )
        spmd.check("end of a pipeline step")
        return self._finish(result, losses)

    def _check_agreement(self) -> None:
        """Raise DivergenceError unless every pipeline rank runs this schedule with the same
        number of microbatches and stages (one small all-gather, at the first run)."""
        mine = [zlib.crc32(self.name.encode()), self._n_microbatches, self._n_stages]
        local = torch.tensor(mine, dtype=torch.int64, device=self._device)
        gathered = local.new_empty(self._n_ranks * len(mine))
        owner = f"the agreement check of {self.name}"
        spmd.record("all_gather", local, self._group, owner)
        work = dist.all_gather_single(gathered, local, group=self._group, async_op=True)
        spmd.wait(work, f"all_gather of {owner}")
        rows = gathered.view(self._n_ranks, len(mine)).tolist()
        if any(row != rows[0] for row in rows):
            names = {zlib.crc32(name.encode()): name for name in SCHEDULES}
            sides = [
                f"pipeline rank {r} (global rank {dist.get_global_rank(self._group, r)}) runs "
                f"{names.get(crc, 'an unknown schedule')} with {m} microbatches over "
                f"{stages} stages"
                for r, (crc, m, stages) in enumerate(rows)
            ]
            raise spmd.DivergenceError(
                "plait: the ranks of the pipeline disagree on the schedule: "
                + "; ".join(sides)
                + ". Build the same schedule class, with the same n_microbatches and "
                "num_stages, on every rank of the pipeline group (otherwise they wait forever "
                "for messages the others never send)."
            )
        self._agreed = True

    def _step_data(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, backward: bool
    ) -> StepData:
        m = self._n_microbatches
        has_first = 0 in self._stages
        has_last = self._n_stages - 1 in self._stages
        if has_first and not args and not kwargs:
            raise ValueError(
                f"{self.name}.step: this rank holds stage 0, which needs the batch as args"
            )
        arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(
            args if has_first else (),
            kwargs,
            m,
            self._args_chunk_spec if has_first else None,
            self._kwargs_chunk_spec,
        )
        targets, scales = None, [1.0] * m
        if has_last and backward and target is None:
            raise ValueError(
                f"{self.name}.step: this rank holds the last stage, which needs target= to "
                "compute the loss"
            )
        if has_last and target is not None:
            target_mbs, _ = split_args_kwargs_into_chunks((target,), None, m)
            targets = [t for (t,) in target_mbs]
            if self.scale_grads:
                scales = _row_shares(targets)
        return StepData(arg_mbs, kwarg_mbs, targets, scales, self._loss_fn, backward)

    def _finish(self, result: StepResult, losses: list[torch.Tensor] | None) -> Any:
        if self._n_stages - 1 not in self._stages:
            return None
        if losses is not None:
            losses.clear()
            losses.extend(result.losses[i] for i in sorted(result.losses))
        outputs = [result.outputs[i] for i in range(self._n_microbatches)]
        return merge_chunks(outputs, self._output_merge_spec)


def _row_shares(target_mbs: Sequence[Any]) -> list[float]:
    rows = [_rows(t) for t in target_mbs]
    total = sum(rows)
    return [r / total for r in rows]


def _rows(target: Any) -> int:
    leaves = [t for t in tree_leaves(target) if isinstance(t, torch.Tensor)]
    return leaves[0].shape[0] if leaves and leaves[0].dim() else 1


def _check_stages(name: str, stages: Sequence[PipelineStage]) -> list[PipelineStage]:
    stages = list(stages)
    if not stages or not all(isinstance(s, PipelineStage) for s in stages):
        raise TypeError(f"{name} needs PipelineStage objects, got {stages!r}")
    first = stages[0]
    for s in stages[1:]:
        if (s.num_stages, s.group) != (first.num_stages, first.group):
            raise ValueError(
                f"{name}: all stages of a rank must share num_stages and the pipeline group; "
                f"stage {s.stage_index} has num_stages={s.num_stages}, stage "
                f"{first.stage_index} has {first.num_stages}"
            )
    indices = [s.stage_index for s in stages]
    if len(set(indices)) != len(indices):
        raise ValueError(f"{name}: stage indices {indices} repeat")
    return stages


class PipelineScheduleSingle(PipelineSchedule):
    """A schedule with one stage per rank: ``(stage, n_microbatches, loss_fn=None, ...)``."""

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        args_chunk_spec: Sequence[ChunkSpec] | None = None,
        kwargs_chunk_spec: Mapping[str, ChunkSpec] | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
    ) -> None:
        if not isinstance(stage, PipelineStage):
            raise TypeError(
                f"{self.name} takes one PipelineStage (one stage per rank), got "
                f"{type(stage).__name__}; for several stages per rank use "
                "ScheduleInterleaved1F1B or ScheduleLoopedBFS"
            )
        super().__init__(
            [stage],
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
        )


class PipelineScheduleMulti(PipelineSchedule):
    """A schedule over a list of this rank's stages."""

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        args_chunk_spec: Sequence[ChunkSpec] | None = None,
        kwargs_chunk_spec: Mapping[str, ChunkSpec] | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
    ) -> None:
        if isinstance(stages, PipelineStage):
            raise TypeError(f"{self.name} takes a list of this rank's stages, got one stage")
        super().__init__(
            stages,
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
        )


class ScheduleGPipe(PipelineScheduleSingle):
    """All forwards, then all backwards."""

    name = "GPipe"


class Schedule1F1B(PipelineScheduleSingle):
    """Warm-up forwards, then one forward and one backward at a time."""

    name = "1F1B"


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """1F1B over several looped stages per rank (Megatron's interleaving)."""

    name = "Interleaved1F1B"


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Breadth-first over several looped stages per rank."""

    name = "LoopedBFS"


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """Interleaved 1F1B with the backward split into input (I) and weight (W) halves."""

    name = "InterleavedZeroBubble"


class ScheduleZBVZeroBubble(PipelineScheduleMulti):
    """ZB-V: two stages per rank in a V, split backward."""

    name = "ZBVZeroBubble"


SCHEDULE_CLASSES: dict[str, type[PipelineSchedule]] = {
    cls.name: cls
    for cls in (
        ScheduleGPipe,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleLoopedBFS,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )
}
"""The class of every schedule of :data:`~plait.pipeline.schedules.SCHEDULES`, by the same
name (``SCHEDULE_CLASSES[schedule_spec(name).name]`` for a case-insensitive name)."""
