"""torch's schedule classes, each a thin shell over one generated action list.

``ScheduleGPipe``, ``Schedule1F1B`` and ``_ScheduleForwardOnly`` take one stage per rank;
``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` take this rank's list of stages. Each
builds its action list once, with :func:`~plait.pipeline.schedules.generate` (plus
communication, plus FSDP actions when a stage does data parallelism), validates it, and
hands it to the one runtime (:func:`~plait.pipeline.runtime.run_actions`) at every
``step``. ``_PipelineScheduleRuntime`` (and ``PipelineScheduleMulti`` / ``Single`` built
directly) start without an order: ``_load_csv(filename, format)`` or
``_prepare_schedule_with_comms(actions, format)`` gives them one, checked the same way;
``_dump_csv(filename, format)`` writes any schedule's order (:mod:`.schedule_csv`).
``get_schedule_class(name)`` finds a class by torch's case-insensitive name.

``step(*args, target=None, losses=None, return_outputs=True, loss_kwargs=None, **kwargs)``
takes the whole batch: the first stage uses ``args``, the last stage ``target``; keyword
arguments go to every stage; ``loss_kwargs`` go to ``loss_fn``. Or, torch's newest form,
``step(arg_mbs=[...], kwarg_mbs=[...], target_mbs=[...], ...)`` with the microbatches cut
by the caller (:mod:`~plait.pipeline.step_inputs`). On the rank of the last stage it
returns the merged output (None with ``return_outputs=False``) and fills ``losses`` with
the per-microbatch losses; elsewhere it returns None. ``eval(...)`` is the same with
forwards only, no graph (it runs under ``torch.inference_mode()`` too).

Constructor keywords of torch's classes: ``backward_requires_autograd`` (True: ``step``
under ``torch.no_grad()`` raises, as torch), ``defer_pp_recv`` (accepted, no effect: plait
always posts receives ahead of their use) and ``use_full_backward`` (deprecated in torch,
ignored: the schedule's actions say B or I / W).

Failures. A rank whose step fails once the step's messages flow (the model, the loss, a
transfer) sends an abort with the cause to its neighbours
(:func:`~plait.pipeline.runtime.abort_step`): every rank of the pipeline ends the step
with :class:`~plait.pipeline.p2p.PipelineAbort` naming the rank that failed and why.

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
import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist

from plait import spmd
from plait.pipeline.actions import Action, ActionKind, Schedule, ScheduleError, stage_to_rank
from plait.pipeline.grad_sync import StageGradSync
from plait.pipeline.microbatch import ChunkSpec, merge_chunks
from plait.pipeline.runtime import LossFn, StepData, StepResult, run_actions
from plait.pipeline.schedule_csv import dump_csv, format_csv, load_csv, parse_cell
from plait.pipeline.schedules import (
    SCHEDULES,
    add_communication,
    add_fsdp_actions,
    generate,
)
from plait.pipeline.simulate import simulate, stage_owners
from plait.pipeline.stage import PipelineStage
from plait.pipeline.step_inputs import step_data
from plait.pipeline.validate import validate

K = ActionKind
logger = logging.getLogger(__name__)

Placement = Mapping[int, int]
"""Where each stage lives: ``{stage: pipeline rank}``."""
CsvFormat = Literal["compute_only", "compute_comms"]

__all__ = [
    "SCHEDULE_CLASSES",
    "PipelineSchedule",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
    "_PipelineScheduleRuntime",
    "_ScheduleForwardOnly",
    "get_schedule_class",
]


class PipelineSchedule:
    """A named schedule over this rank's ``stages``; subclasses fix ``name``.

    A class whose ``name`` is in :data:`~plait.pipeline.schedules.SCHEDULES` generates its
    order; the base classes start without one, to be given with :meth:`_load_csv` or
    :meth:`_prepare_schedule_with_comms` (torch's ``_PipelineScheduleRuntime`` use).
    """

    name: ClassVar[str] = "PipelineSchedule"

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        args_chunk_spec: Sequence[ChunkSpec] | None = None,
        kwargs_chunk_spec: Mapping[str, ChunkSpec] | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        *,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        use_full_backward: bool | None = None,
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
        # torch's keywords (see step_inputs' module docstring for what each means here).
        self._backward_requires_autograd = backward_requires_autograd
        self._defer_pp_recv = defer_pp_recv  # receives are always posted ahead: no effect
        del use_full_backward  # deprecated in torch too: B or I/W follow the schedule's actions
        first = next(iter(self._stages.values()))
        self._n_ranks, self._n_stages = first.group_size, first.num_stages
        self._group_rank, self._group, self._device = first.group_rank, first.group, first.device
        self._agreed = self._n_ranks == 1  # checked at the first run (_check_agreement)
        self._syncs = {
            i: sync for i, s in self._stages.items() if (sync := StageGradSync(s.submod)).active
        }
        self._compute: Schedule = {}  # compute-only, as torch's pipeline_order
        self._train: Schedule = {}  # lowered: what step() runs
        self._eval: Schedule = {}  # lowered forwards: what eval() runs
        generated = self._generate()
        if generated is not None:
            self._install(*generated)

    @property
    def pipeline_order(self) -> Schedule:
        """Every pipeline rank's compute actions (F, B, I, W), as torch's ``pipeline_order``."""
        return self._compute

    @property
    def pipeline_order_with_comms(self) -> Schedule:
        """Every pipeline rank's actions as run: with communication (and FSDP) actions."""
        return self._train

    def _generate(self) -> tuple[Schedule, Placement] | None:
        """This class's compute-only order and placement (None: the base classes, whose
        order is given later)."""
        if self.name not in SCHEDULES:
            return None
        style = SCHEDULES[self.name].style
        compute = generate(self.name, self._n_ranks, self._n_stages, self._n_microbatches)
        return compute, {s: stage_to_rank(s, self._n_ranks, style) for s in range(self._n_stages)}

    def _install(self, schedule: Schedule, placement: Placement) -> None:
        """Adopt ``schedule`` (compute-only, or already lowered with communication actions)
        as this schedule's order: lower and check it, derive the forward-only order, and
        connect this rank's stages to their neighbours under ``placement``."""
        compute = {r: [a for a in acts if a.kind.is_compute] for r, acts in schedule.items()}
        if any(a.kind.is_comm for acts in schedule.values() for a in acts):
            train = schedule
            if self._syncs and not any(a.kind.is_fsdp for acts in train.values() for a in acts):
                train = add_fsdp_actions(train)
            forward_kinds = (K.FORWARD, K.SEND_F, K.RECV_F, K.UNSHARD, K.RESHARD)
            forwards = {r: [a for a in a_s if a.kind in forward_kinds] for r, a_s in train.items()}
            self._check(train, placement)
            simulate(forwards)  # a subsequence of a deadlock-free order: checked all the same
        else:
            train = self._lower(compute, placement)
            forwards = {r: [a for a in acts if a.kind is K.FORWARD] for r, acts in compute.items()}
            forwards = self._lower(forwards, placement)
        self._place_stages(placement)
        self._compute, self._train, self._eval = compute, train, forwards
        self._agreed = self._n_ranks == 1  # a new order: the ranks agree on it again
        logger.debug(
            "%s on pipeline rank %d: %s",
            self.name,
            self._group_rank,
            " ".join(map(str, self._train.get(self._group_rank, []))),
        )

    def _lower(self, compute: Schedule, placement: Placement) -> Schedule:
        """Add communication (and FSDP) actions to ``compute`` and check the result."""
        schedule = add_communication(compute, self._n_ranks, placement, self._n_stages)
        if self._syncs:  # each rank lowers its own FSDP actions: they involve no other rank
            schedule = add_fsdp_actions(schedule)
        self._check(schedule, placement)
        return schedule

    def _check(self, schedule: Schedule, placement: Placement) -> None:
        """validate a training order; a forward-only one (validate wants backwards) is
        simulated, which still raises on a deadlock."""
        backward = (K.FULL_BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT)
        if any(a.kind in backward for acts in schedule.values() for a in acts):
            validate(schedule, self._n_ranks, self._n_stages, self._n_microbatches, style=placement)
        else:
            simulate(schedule)

    def _place_stages(self, placement: Placement) -> None:
        """Check that this rank holds exactly its stages; connect them to their neighbours."""
        rank_of_stage = [placement[s] for s in range(self._n_stages)]
        expected = [s for s, r in enumerate(rank_of_stage) if r == self._group_rank]
        if sorted(self._stages) != expected:
            raise ValueError(
                f"{self.name} with {self._n_stages} stages on {self._n_ranks} pipeline ranks "
                f"places stages {expected} on pipeline rank {self._group_rank} "
                f"({_describe(placement, self._n_ranks)}), but this rank was given stages "
                f"{sorted(self._stages)}"
            )
        for stage in self._stages.values():
            stage.attach(rank_of_stage, self._stages)

    def _prepare_schedule_with_comms(
        self,
        actions: Mapping[int, Sequence[Action | object | None]],
        format: CsvFormat = "compute_only",
    ) -> None:
        """Use ``actions`` (rank -> actions; None gaps are skipped) as this schedule's order,
        as torch's ``_PipelineScheduleRuntime._prepare_schedule_with_comms``. Other objects
        are read by their text form, so torch's ``_Action`` lists work too (an
        ``OVERLAP_F_B`` becomes its F then its B).

        ``"compute_only"``: F / B / I / W only (ValueError naming a communication action
        found), lowered here; ``"compute_comms"``: already lowered (FSDP actions are added
        if a stage needs them and there are none). The placement is read from the
        actions (each stage on the rank running most of them). Raises ScheduleError
        (a ValueError) naming the rank and action if the order cannot run.
        """
        if format not in ("compute_only", "compute_comms"):
            raise NotImplementedError(
                f"{format=} is not implemented: use 'compute_only' or 'compute_comms'"
            )
        schedule = {
            r: [x for a in acts if a is not None for x in _as_actions(a)]
            for r, acts in actions.items()
        }
        if format == "compute_only":
            for rank, acts in schedule.items():
                for pos, a in enumerate(acts):
                    if not a.kind.is_compute:
                        raise ValueError(
                            f"Expected a compute-only schedule but found {a} at rank {rank}, "
                            f"position {pos}: load it with format='compute_comms'"
                        )
        owners = stage_owners(schedule)
        missing = [s for s in range(self._n_stages) if s not in owners]
        if missing:
            raise ScheduleError(
                f"{self.name}: the schedule never runs stages {missing} of {self._n_stages}"
            )
        self._install(schedule, owners)

    def _load_csv(
        self, filename: str | os.PathLike[str], format: CsvFormat = "compute_only"
    ) -> None:
        """Load this schedule's order from a CSV file in torch's layout (row r: rank r's
        actions, one per cell, e.g. ``0F1``; see :mod:`~plait.pipeline.schedule_csv`), as
        torch's ``_load_csv``; then as :meth:`_prepare_schedule_with_comms`."""
        if format not in ("compute_only", "compute_comms"):
            raise NotImplementedError(
                f"{format=} is not implemented: use 'compute_only' or 'compute_comms'"
            )
        self._prepare_schedule_with_comms(load_csv(filename), format)

    def _dump_csv(
        self, filename: str | os.PathLike[str], format: CsvFormat = "compute_comms"
    ) -> None:
        """Write this schedule's order as CSV in torch's layout: the order as run
        (``"compute_comms"``, torch's default) or its compute actions (``"compute_only"``)."""
        if format not in ("compute_only", "compute_comms"):
            raise NotImplementedError(
                f"{format=} is not implemented: use 'compute_only' or 'compute_comms'"
            )
        if not self._train:
            raise RuntimeError(f"{self.name} has no schedule yet to dump: load one first")
        dump_csv(self._compute if format == "compute_only" else self._train, filename)

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[torch.Tensor] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[dict[str, Any]] | None = None,
        target_mbs: list[Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One training step (forwards and, with a ``loss_fn``, backwards): the whole batch
        as ``*args`` / ``**kwargs`` / ``target``, or the microbatch lists ``arg_mbs`` /
        ``kwarg_mbs`` / ``target_mbs``; ``loss_kwargs`` go to ``loss_fn``; see
        :mod:`~plait.pipeline.step_inputs`. Returns the merged output on the last stage's
        rank (None elsewhere, or with ``return_outputs=False``).

        Raises RuntimeError under ``torch.no_grad()`` when the step has a backward (as
        torch; ``backward_requires_autograd=False`` lifts that: plait enables autograd for
        the stage's own forwards) and always under ``torch.inference_mode()``, whose tensors
        can never be differentiated: use :meth:`eval` there.
        """
        backward = self._loss_fn is not None
        if backward and torch.is_inference_mode_enabled():
            raise RuntimeError(
                f"{self.name}.step runs a backward, which torch.inference_mode() forbids: "
                "call schedule.eval(...) for forwards only"
            )
        if backward and self._backward_requires_autograd and not torch.is_grad_enabled():
            raise RuntimeError(
                f"{self.name}.step runs a backward, so it needs gradients enabled: do not "
                "call it under torch.no_grad(); call schedule.eval(...) for forwards only"
            )
        inputs = _inputs(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        return self._run(inputs, losses, loss_kwargs, return_outputs, backward=backward)

    def eval(
        self,
        *args: Any,
        target: Any = None,
        losses: list[torch.Tensor] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[dict[str, Any]] | None = None,
        target_mbs: list[Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Forwards only, no gradients (under ``torch.inference_mode()`` too): the merged
        output on the last stage's rank, and the losses in ``losses`` when targets are
        given. Arguments as :meth:`step`."""
        inputs = _inputs(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        with torch.no_grad():
            return self._run(inputs, losses, loss_kwargs, return_outputs, backward=False)

    def _run(
        self,
        inputs: dict[str, Any],
        losses: list[torch.Tensor] | None,
        loss_kwargs: dict[str, Any] | None,
        return_outputs: bool,
        backward: bool,
    ) -> Any:
        """Run this rank's actions of the training (``backward``) or the forward-only order."""
        order = self._train if backward else self._eval
        if not order:
            raise RuntimeError(
                f"{self.name} has no schedule to run: give it one with _load_csv(filename) "
                "or _prepare_schedule_with_comms(actions), or use a schedule class such as "
                "Schedule1F1B"
            )
        m = self._n_microbatches
        what = "pipeline_step" if backward else "pipeline_forward"
        spmd.agree(what, m, self._group, f"{self.name} with {m} microbatches")
        data = self._step_data(inputs, loss_kwargs, return_outputs, backward)
        agree = None if self._agreed else self._check_agreement
        with spmd.deferred_checks():  # stages reach their backwards at different times
            result = run_actions(
                order[self._group_rank], self._stages, self._syncs, data, before_first_message=agree
            )
        spmd.check("end of a pipeline step")
        return self._finish(result, losses, return_outputs)

    def _step_data(
        self,
        inputs: dict[str, Any],
        loss_kwargs: dict[str, Any] | None,
        return_outputs: bool,
        backward: bool,
    ) -> StepData:
        """This rank's microbatches of the step (see :mod:`~plait.pipeline.step_inputs`)."""
        return step_data(
            self.name,
            self._n_microbatches,
            has_first=0 in self._stages,
            has_last=self._n_stages - 1 in self._stages,
            backward=backward,
            loss_fn=self._loss_fn,
            scale_grads=self.scale_grads,
            args_chunk_spec=self._args_chunk_spec,
            kwargs_chunk_spec=self._kwargs_chunk_spec,
            loss_kwargs=loss_kwargs,
            return_outputs=return_outputs,
            **inputs,
        )

    def _check_agreement(self) -> None:
        """Raise DivergenceError unless every pipeline rank runs this schedule with the same
        number of microbatches and stages, and the same compute order (a checksum: two
        ranks that loaded different CSV files differ there); one small all-gather, at the
        first run."""
        order = zlib.crc32(format_csv(self._compute).encode())
        mine = [zlib.crc32(self.name.encode()), self._n_microbatches, self._n_stages, order]
        local = torch.tensor(mine, dtype=torch.int64, device=self._device)
        gathered = local.new_empty(self._n_ranks * len(mine))
        owner = f"the agreement check of {self.name}"
        spmd.record("all_gather", local, self._group, owner)
        work = dist.all_gather_single(gathered, local, group=self._group, async_op=True)
        spmd.wait(work, f"all_gather of {owner}")
        rows = gathered.view(self._n_ranks, len(mine)).tolist()
        if any(row != rows[0] for row in rows):
            known = [*SCHEDULES, *(cls.name for cls in _UNREGISTERED)]
            names = {zlib.crc32(name.encode()): name for name in known}
            sides = [
                f"pipeline rank {r} (global rank {dist.get_global_rank(self._group, r)}) runs "
                f"{names.get(crc, 'an unknown schedule')} with {m} microbatches over "
                f"{stages} stages (order checksum {checksum:08x})"
                for r, (crc, m, stages, checksum) in enumerate(rows)
            ]
            raise spmd.DivergenceError(
                "plait: the ranks of the pipeline disagree on the schedule: "
                + "; ".join(sides)
                + ". Build the same schedule class, with the same n_microbatches and "
                "num_stages (and the same loaded order), on every rank of the pipeline group "
                "(otherwise they wait forever for messages the others never send)."
            )
        self._agreed = True

    def _finish(
        self, result: StepResult, losses: list[torch.Tensor] | None, return_outputs: bool
    ) -> Any:
        if self._n_stages - 1 not in self._stages:
            return None
        if losses is not None:
            losses.clear()
            losses.extend(result.losses[i] for i in sorted(result.losses))
        if not return_outputs:
            return None
        outputs = [result.outputs[i] for i in range(self._n_microbatches)]
        return merge_chunks(outputs, self._output_merge_spec)


def _as_actions(action: object) -> list[Action]:
    """``action`` itself, or the actions its text form names (a torch ``_Action``)."""
    return [action] if isinstance(action, Action) else parse_cell(str(action))


def _describe(placement: Placement, n_ranks: int) -> str:
    """Name ``placement`` by its style when it has one (for error messages)."""
    n = len(placement)
    for style in ("loop", "v"):
        try:
            if all(placement[s] == stage_to_rank(s, n_ranks, style) for s in range(n)):
                return f"{style!r} placement"
        except (KeyError, ValueError):
            continue
    return f"placement {dict(placement)}"


def _inputs(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    target: Any,
    arg_mbs: list[Any] | None,
    kwarg_mbs: list[dict[str, Any]] | None,
    target_mbs: list[Any] | None,
) -> dict[str, Any]:
    """The batch a step was called with, in either form (see step_inputs.step_data)."""
    return {
        "args": args,
        "kwargs": kwargs,
        "target": target,
        "arg_mbs": arg_mbs,
        "kwarg_mbs": kwarg_mbs,
        "target_mbs": target_mbs,
    }


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

    name = "PipelineScheduleSingle"

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        args_chunk_spec: Sequence[ChunkSpec] | None = None,
        kwargs_chunk_spec: Mapping[str, ChunkSpec] | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        **options: Any,
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
            **options,
        )


class PipelineScheduleMulti(PipelineSchedule):
    """A schedule over a list of this rank's stages (torch's positional order, in which
    ``use_full_backward`` comes before ``scale_grads``)."""

    name = "PipelineScheduleMulti"

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        args_chunk_spec: Sequence[ChunkSpec] | None = None,
        kwargs_chunk_spec: Mapping[str, ChunkSpec] | None = None,
        output_merge_spec: Any = None,
        use_full_backward: bool | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        **options: Any,
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
            backward_requires_autograd=backward_requires_autograd,
            use_full_backward=use_full_backward,
            **options,
        )


class _PipelineScheduleRuntime(PipelineScheduleMulti):
    """torch's runtime over an order given as data: build it, then give it its order with
    ``_load_csv(filename, format)`` or ``_prepare_schedule_with_comms(actions, format)``.
    The looped and V schedules below derive from it, as in torch, and take its positional
    order (``scale_grads, backward_requires_autograd, defer_pp_recv`` after the specs)."""

    name = "PipelineScheduleRuntime"

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        args_chunk_spec: Sequence[ChunkSpec] | None = None,
        kwargs_chunk_spec: Mapping[str, ChunkSpec] | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(
            stages,
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads=scale_grads,
            backward_requires_autograd=backward_requires_autograd,
            defer_pp_recv=defer_pp_recv,
            **options,
        )


class _ScheduleForwardOnly(PipelineScheduleSingle):
    """Forwards only, microbatch after microbatch, one stage per rank (torch's private
    forward-only schedule): ``step`` runs as :meth:`eval` (no graph, no loss) and returns
    the merged output on the last stage's rank. Passing ``target`` or ``losses`` raises
    RuntimeError, as in torch."""

    name = "ForwardOnly"

    def _generate(self) -> tuple[Schedule, Placement]:
        n_ranks, n_stages = self._n_ranks, self._n_stages
        if n_stages != n_ranks:
            raise ValueError(
                f"{self.name} holds 1 stage per rank, so num_stages must be {n_ranks} for "
                f"{n_ranks} pipeline ranks, got {n_stages}"
            )
        m = range(self._n_microbatches)
        compute = {r: [Action(r, K.FORWARD, i) for i in m] for r in range(n_ranks)}
        return compute, {s: s for s in range(n_stages)}

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Forwards of every microbatch; the merged output on the last stage's rank."""
        if target is not None or losses is not None or kwargs.get("target_mbs") is not None:
            raise RuntimeError(
                f"{self.name} does not support loss computation: call step() without "
                "target=, target_mbs= and losses= (for losses, use a training schedule such "
                "as ScheduleGPipe, or its eval())"
            )
        return self.eval(*args, **kwargs)


class ScheduleGPipe(PipelineScheduleSingle):
    """All forwards, then all backwards."""

    name = "GPipe"


class Schedule1F1B(PipelineScheduleSingle):
    """Warm-up forwards, then one forward and one backward at a time."""

    name = "1F1B"


class ScheduleInterleaved1F1B(_PipelineScheduleRuntime):
    """1F1B over several looped stages per rank (Megatron's interleaving)."""

    name = "Interleaved1F1B"


class ScheduleLoopedBFS(_PipelineScheduleRuntime):
    """Breadth-first over several looped stages per rank (torch's arguments: no chunk
    specs, whole tensors are cut on dim 0)."""

    name = "LoopedBFS"

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(
            stages,
            n_microbatches,
            loss_fn,
            output_merge_spec=output_merge_spec,
            scale_grads=scale_grads,
            backward_requires_autograd=backward_requires_autograd,
            defer_pp_recv=defer_pp_recv,
            **options,
        )


class ScheduleInterleavedZeroBubble(_PipelineScheduleRuntime):
    """Interleaved 1F1B with the backward split into input (I) and weight (W) halves."""

    name = "InterleavedZeroBubble"


class ScheduleZBVZeroBubble(_PipelineScheduleRuntime):
    """ZB-V: two stages per rank in a V, split backward."""

    name = "ZBVZeroBubble"


class ScheduleDualPipeV(_PipelineScheduleRuntime):
    """DualPipeV (DeepSeek-V3): two stages per rank in a V; in the steady state each rank
    runs a forward of one of its stages with a backward of the other (consecutive F and B
    actions: see :func:`~plait.pipeline.schedules.dualpipe_v`). Needs n_microbatches >=
    num_stages (ValueError otherwise, as in torch)."""

    name = "DualPipeV"


SCHEDULE_CLASSES: dict[str, type[PipelineSchedule]] = {
    cls.name: cls
    for cls in (
        ScheduleGPipe,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleLoopedBFS,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
        ScheduleDualPipeV,
    )
}
"""The class of every schedule of :data:`~plait.pipeline.schedules.SCHEDULES`, by the same
name (``SCHEDULE_CLASSES[schedule_spec(name).name]`` for a case-insensitive name)."""


_UNREGISTERED: tuple[type[PipelineSchedule], ...] = (
    PipelineSchedule,
    PipelineScheduleSingle,
    PipelineScheduleMulti,
    _PipelineScheduleRuntime,
    _ScheduleForwardOnly,
)
"""The classes without an entry in SCHEDULES (named in agreement errors all the same)."""


def get_schedule_class(schedule_name: str) -> type[PipelineSchedule]:
    """The schedule class named ``schedule_name``, case-insensitive, as torch's
    ``get_schedule_class``: a name of :data:`SCHEDULE_CLASSES` (``"1F1B"``, ``"GPipe"``,
    ``"DualPipeV"``, ...) or ``"PipelineScheduleSingle"`` / ``"PipelineScheduleMulti"``.
    Raises ValueError naming the unknown name and the known ones."""
    known: dict[str, type[PipelineSchedule]] = {
        **SCHEDULE_CLASSES,
        "PipelineScheduleSingle": PipelineScheduleSingle,
        "PipelineScheduleMulti": PipelineScheduleMulti,
    }
    by_lower = {name.lower(): cls for name, cls in known.items()}
    if not isinstance(schedule_name, str) or schedule_name.lower() not in by_lower:
        raise ValueError(
            f"Unknown schedule name {schedule_name!r}. The valid options are {list(known)}"
        )
    return by_lower[schedule_name.lower()]
