"""``PipelineSchedule``: a schedule's order over this rank's stages, run step after step.

torch's classes (:mod:`~plait.pipeline.schedule_classes`) are this one class with a name,
which picks the generated order, and torch's positional order of the constructor's
parameters; everything else lives here, built from pure parts:

* the order: :mod:`~plait.pipeline.ordering` (generated, given as data, or loaded from
  CSV with ``_load_csv(filename, format)`` / ``_prepare_schedule_with_comms(actions,
  format)``; written with ``_dump_csv(filename, format)``);
* one step's inputs: a :class:`~plait.pipeline.step_inputs.StepInputs` value, cut into
  this rank's microbatches by :func:`~plait.pipeline.step_inputs.step_data`;
* the first run's agreement between ranks: :mod:`~plait.pipeline.agreement`;
* running this rank's actions: :func:`~plait.pipeline.runtime.run_actions`, with the
  custom functions registered (:mod:`~plait.pipeline.custom`).

``step(*args, target=None, losses=None, return_outputs=True, loss_kwargs=None, **kwargs)``
takes the whole batch: the first stage uses ``args``, the last stage ``target``; keyword
arguments go to every stage; ``loss_kwargs`` go to ``loss_fn``. Or, torch's newest form,
``step(arg_mbs=[...], kwarg_mbs=[...], target_mbs=[...], ...)`` with the microbatches cut
by the caller. On the rank of the last stage it returns the merged output (None with
``return_outputs=False``) and fills ``losses`` with the per-microbatch losses; elsewhere
it returns None. ``eval(...)`` is the same with forwards only, no graph (it runs under
``torch.inference_mode()`` too).

Constructor keywords of torch's classes: ``backward_requires_autograd`` (True: ``step``
under ``torch.no_grad()`` raises, as torch), ``defer_pp_recv`` (accepted, no effect: plait
always posts receives ahead of their use) and ``use_full_backward`` (deprecated in torch,
ignored: the schedule's actions say B or I / W).

Failures. A rank whose step fails once it started (the model, the loss, a declared shape,
a transfer) tells the other ranks (:mod:`~plait.pipeline.runtime`): every rank of the
pipeline ends the step with :class:`~plait.pipeline.p2p.PipelineAbort` naming the rank
that failed and why. Every step notes its schedule and number of microbatches with
:func:`plait.spmd.agree`, runs with the per-backward checks of ``fully_shard`` /
``replicate`` deferred, and ends with one ``spmd.check("end of a pipeline step")``: with
divergence checking on, a rank that runs an extra step, or that stays stuck in a
transfer, fails within the deadline.

Gradient scale. torch divides gradients by the number of microbatches, which equals a
whole-batch mean loss only when microbatches are equal. plait seeds microbatch i's
backward with ``rows_i / rows``: the same for equal microbatches, and still the
whole-batch mean for an uneven last one (for a loss that is a mean over the batch, as
torch's ``scale_grads=True`` assumes). ``scale_grads=False`` seeds with 1 (sum losses).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch

from plait import spmd
from plait.pipeline import p2p
from plait.pipeline.actions import OVERLAP_F_B, Schedule
from plait.pipeline.agreement import Agreement
from plait.pipeline.custom import CustomFunction
from plait.pipeline.grad_sync import StageGradSync
from plait.pipeline.microbatch import ChunkSpec, merge_chunks
from plait.pipeline.ordering import (
    CsvFormat,
    Lowering,
    Order,
    Shape,
    check_format,
    check_pair_steps,
    check_placement,
    generated,
    given,
    order_checksum,
)
from plait.pipeline.runtime import CustomRun, LossFn, StepResult, run_actions
from plait.pipeline.schedule_csv import dump_csv, load_csv_cells
from plait.pipeline.schedules import SCHEDULES
from plait.pipeline.stage import PipelineStage
from plait.pipeline.step_inputs import Microbatching, StepInputs, step_data

__all__ = ["PipelineSchedule"]

logger = logging.getLogger(__name__)


class PipelineSchedule:
    """A named schedule over this rank's ``stages``; subclasses fix ``name``.

    A class whose ``name`` is in :data:`~plait.pipeline.schedules.SCHEDULES` generates its
    order; the others start without one, to be given with :meth:`_load_csv` or
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
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        *,
        use_full_backward: bool | None = None,
        max_active_stages: int | None = None,
    ) -> None:
        """torch's constructor parameters, written once for every schedule class (each
        takes them in its torch positional order; this one is torch's
        ``_PipelineScheduleRuntime`` family's). TypeError / ValueError name the argument
        at fault.

        ``max_active_stages`` (plait's, keyword only): with ``fully_shard`` / ``replicate``
        stages, how many of this rank's stages may hold their full parameters at once
        (:func:`~plait.pipeline.schedules.add_fsdp_actions`). ``None``, the default, gathers
        each stage once per step and keeps it until its last compute: the fewest
        all-gathers, every local stage full through the middle of the step. torch's
        runtime schedules bound it to 3, gathering a stage again when it comes back into
        the window; pass 3 for torch's memory profile, or fewer for less."""
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
        self._backward_requires_autograd = backward_requires_autograd
        self._defer_pp_recv = defer_pp_recv  # receives are always posted ahead: no effect
        del use_full_backward  # deprecated in torch too: B or I/W follow the schedule's actions
        if max_active_stages is not None and (
            isinstance(max_active_stages, bool) or not isinstance(max_active_stages, int)
        ):
            raise TypeError(f"max_active_stages must be an int or None, got {max_active_stages!r}")
        if max_active_stages is not None and max_active_stages < 1:
            raise ValueError(f"max_active_stages must be >= 1 (or None), got {max_active_stages}")
        first = next(iter(self._stages.values()))
        self._shape = Shape(first.group_size, first.num_stages, n_microbatches)
        self._group_rank, self._group, self._device = first.group_rank, first.group, first.device
        # How the backend matches messages decides where the order places its receives.
        self._in_order = p2p.matches_in_order(self._device)
        self._syncs = {
            i: sync for i, s in self._stages.items() if (sync := StageGradSync(s.submod)).active
        }
        self._lowering = Lowering(bool(self._syncs), self._in_order, max_active_stages)
        self._custom: dict[str, CustomFunction] = {}
        self._order: Order | None = None
        self._agreement: Agreement | None = None
        order = self._generate()
        if order is not None:
            self._adopt(order)

    @property
    def pipeline_order(self) -> Schedule:
        """Every pipeline rank's compute actions (F, B, I, W), as torch's ``pipeline_order``."""
        return {} if self._order is None else self._order.compute

    @property
    def pipeline_order_with_comms(self) -> Schedule:
        """Every pipeline rank's actions as run: with communication (and FSDP) actions."""
        return {} if self._order is None else self._order.train

    def _generate(self) -> Order | None:
        """This class's order (None: the classes whose order is given later)."""
        if self.name not in SCHEDULES:
            return None
        return generated(self.name, self._shape, self._lowering)

    def _adopt(self, order: Order) -> None:
        """Run ``order`` from now on: check this rank holds exactly its stages, connect them
        to their neighbours; the ranks agree on it again at its first run."""
        rank_of_stage = check_placement(
            self.name, order.placement, self._shape, self._group_rank, self._stages
        )
        if order.pairs and OVERLAP_F_B in self._custom:
            check_pair_steps(order)
        for stage in self._stages.values():
            stage.attach(rank_of_stage, self._stages)
        self._order = order
        facts = [self._n_microbatches, self._shape.n_stages, order_checksum(order)]
        names = [*SCHEDULES, *(cls.name for cls in _subclasses(PipelineSchedule))]
        self._agreement = Agreement(self.name, facts, self._group, self._device, names)
        logger.debug(
            "%s on pipeline rank %d: %s",
            self.name,
            self._group_rank,
            " ".join(map(str, order.train.get(self._group_rank, []))),
        )

    def _prepare_schedule_with_comms(
        self,
        actions: Mapping[int, Sequence[object | None]],
        format: CsvFormat = "compute_only",
    ) -> None:
        """Use ``actions`` (rank -> actions; None gaps are skipped) as this schedule's order,
        as torch's ``_PipelineScheduleRuntime._prepare_schedule_with_comms``: see
        :func:`~plait.pipeline.ordering.given` (torch's ``_Action`` lists work too, their
        ``OVERLAP_F_B`` pairs included). Raises ScheduleError (a ValueError) naming the
        rank and action if the order cannot run."""
        self._adopt(given(self.name, actions, format, self._shape, self._lowering))

    def _load_csv(
        self, filename: str | os.PathLike[str], format: CsvFormat = "compute_only"
    ) -> None:
        """Load this schedule's order from a CSV file in torch's layout (row r: rank r's
        actions, one per cell, e.g. ``0F1``; see :mod:`~plait.pipeline.schedule_csv`), as
        torch's ``_load_csv``; then as :meth:`_prepare_schedule_with_comms`."""
        check_format(format)
        self._prepare_schedule_with_comms(load_csv_cells(filename), format)

    def _dump_csv(
        self, filename: str | os.PathLike[str], format: CsvFormat = "compute_comms"
    ) -> None:
        """Write this schedule's order as CSV in torch's layout: the order as run
        (``"compute_comms"``, torch's default) or its compute actions (``"compute_only"``)."""
        check_format(format)
        if self._order is None:
            raise RuntimeError(f"{self.name} has no schedule yet to dump: load one first")
        dump_csv(self._order.compute if format == "compute_only" else self._order.train, filename)

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
        inputs = StepInputs(
            args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs, return_outputs
        )
        return self._run(inputs, losses, backward=backward)

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
        inputs = StepInputs(
            args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs, return_outputs
        )
        with torch.no_grad():
            return self._run(inputs, losses, backward=False)

    def _run(self, inputs: StepInputs, losses: list[torch.Tensor] | None, backward: bool) -> Any:
        """Run this rank's actions of the training (``backward``) or the forward-only order."""
        if self._order is None:
            raise RuntimeError(
                f"{self.name} has no schedule to run: give it one with _load_csv(filename) "
                "or _prepare_schedule_with_comms(actions), or use a schedule class such as "
                "Schedule1F1B"
            )
        m, rank = self._n_microbatches, self._group_rank
        what = "pipeline_step" if backward else "pipeline_forward"
        spmd.agree(what, m, self._group, f"{self.name} with {m} microbatches")
        data = step_data(inputs, self._microbatching(), backward=backward)
        custom = None
        if self._custom:
            # Pairs are F then B: only the training order has them.
            pairs = self._order.pairs.get(rank, ()) if backward else ()
            custom = CustomRun(self._custom, pairs, self, losses)
        agreement = self._agreement
        actions = (self._order.train if backward else self._order.eval)[rank]
        with spmd.deferred_checks():  # stages reach their backwards at different times
            result = run_actions(
                actions,
                self._stages,
                self._syncs,
                data,
                agreement=None if agreement is None or agreement.agreed else agreement,
                custom=custom,
                in_order=self._in_order,
            )
        spmd.check("end of a pipeline step")
        return self._finish(result, losses, inputs.return_outputs)

    def _microbatching(self) -> Microbatching:
        """How this rank cuts a step's inputs (read at each step: ``scale_grads`` is a
        public attribute, as in torch)."""
        return Microbatching(
            self.name,
            self._n_microbatches,
            has_first=0 in self._stages,
            has_last=self._shape.n_stages - 1 in self._stages,
            loss_fn=self._loss_fn,
            scale_grads=self.scale_grads,
            args_chunk_spec=self._args_chunk_spec,
            kwargs_chunk_spec=self._kwargs_chunk_spec,
        )

    def _finish(
        self, result: StepResult, losses: list[torch.Tensor] | None, return_outputs: bool
    ) -> Any:
        if self._shape.n_stages - 1 not in self._stages:
            return None
        if losses is not None:
            losses.clear()
            losses.extend(result.losses[i] for i in sorted(result.losses))
        if not return_outputs:
            return None
        outputs = [result.outputs[i] for i in range(self._n_microbatches)]
        return merge_chunks(outputs, self._output_merge_spec)


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


def _subclasses(cls: type[PipelineSchedule]) -> Iterator[type[PipelineSchedule]]:
    """``cls`` and every class derived from it (to name any schedule in agreement errors)."""
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)
