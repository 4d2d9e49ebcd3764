"""The one pipeline runtime: execute this rank's action list for one step.

Any schedule from :func:`~plait.pipeline.schedules.generate` (lowered with
communication, and with FSDP actions when stages do data parallelism) runs here:

* ``F``: the stage's forward; on the last stage, the loss ``loss_fn(output, target)`` of
  the microbatch, and the backward is seeded with ``scale`` (see :class:`StepData`);
* ``B`` / ``I`` / ``W``: the whole backward, or its input and weight halves;
* ``SEND_F`` / ``RECV_F`` / ``SEND_B`` / ``RECV_B``: consecutive ones are posted together
  in one ``batch_isend_irecv``, with receives posted a little ahead of their place (so
  data flows while this rank computes); a compute action waits for the receive it
  consumes; sends complete in the background (awaited at the end of the step at the
  latest);
* ``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD``: the stage's data-parallel modules gather,
  free, and reduce their accumulated gradients (:mod:`plait.pipeline.grad_sync`); after
  each backward action, ``fully_shard`` units move the new gradients into their
  reduce-dtype accumulators.

Custom functions (:mod:`plait.pipeline.custom`) replace the runtime's own work for the
actions of their type; with one for ``OVERLAP_F_B``, each overlapped pair runs as one
step (:func:`~plait.pipeline.ordering.pair_steps`).

Failures. When anything raises on this rank during the step (the model, the loss, a
declared shape that does not match, a transfer, or an abort heard from a neighbour), the
other ranks are told before the error is raised here. Once this rank's messages flow, or
after the ranks agreed on the schedule in an earlier step, :func:`abort_step` sends an
abort, with the cause, in place of this rank's next message to each neighbour that waits
for one; before the first run's agreement, the failure is reported in the agreement
itself (:meth:`~plait.pipeline.agreement.Agreement.report_failure`). Each neighbour raises
:class:`~plait.pipeline.p2p.PipelineAbort` naming the rank that failed first and why, and
passes it on: every rank of the pipeline ends the step with the cause, none waits for
messages that will never come. On a backend that matches messages in posting order
(NCCL) this is best effort: a rank whose stream still holds a send the failed rank will
never receive delivers nothing after it, and NCCL's own timeout then ends the job
(``plait train --max-restarts`` restarts it). Bad arguments to ``step`` are found before
:func:`run_actions` and stay local, so the caller can fix the call and step again: no
neighbour has started the step with this rank, and an abort nobody reads would be matched
by a later step. (Its neighbours then wait; with ``PLAIT_CHECK_SPMD=1`` they fail at the
deadline, naming the transfer.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from plait.hooks import traced
from plait.pipeline.actions import OVERLAP_F_B, Action, ActionKind, OverlappedPair
from plait.pipeline.agreement import Agreement
from plait.pipeline.custom import CustomFunction, _PipelineContext
from plait.pipeline.grad_sync import StageGradSync
from plait.pipeline.ordering import pair_steps
from plait.pipeline.p2p import (
    ActivationRecv,
    P2PBatch,
    PipelineAbort,
    SentTensor,
    prune_sends,
    publish_abort,
    wait_sends,
)
from plait.pipeline.stage import PipelineStage

__all__ = ["CustomRun", "StepData", "StepResult", "abort_step", "run_actions"]

logger = logging.getLogger(__name__)

K = ActionKind
LossFn = Callable[..., torch.Tensor]
"""``loss_fn(output, target, **loss_kwargs) -> scalar`` for one microbatch."""


@dataclass
class StepData:
    """The microbatched inputs of one step, as this rank sees them.

    ``args`` / ``kwargs``: per microbatch (args used by the first stage only). ``targets``
    and ``scales``: per microbatch, for the last stage; the backward of microbatch i starts
    from ``loss_i * scales[i]``, where ``loss_i = loss_fn(output_i, targets[i],
    **loss_kwargs)``. ``backward``: False runs forwards only (no graph kept).
    ``keep_outputs``: False keeps no outputs of the last stage (only the losses).
    """

    args: Sequence[tuple[Any, ...]]
    kwargs: Sequence[dict[str, Any]]
    targets: Sequence[Any] | None
    scales: Sequence[float]
    loss_fn: LossFn | None
    backward: bool
    loss_kwargs: Mapping[str, Any] = field(default_factory=dict)
    keep_outputs: bool = True


@dataclass
class StepResult:
    """What the last stage produced, per microbatch (empty on other ranks)."""

    outputs: dict[int, Any] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class CustomRun:
    """The custom functions of a step (:mod:`plait.pipeline.custom`): ``functions`` by
    computation type, this rank's overlapped ``pairs``, and, for their context, the
    ``schedule`` and the caller's ``losses`` list."""

    functions: Mapping[str, CustomFunction]
    pairs: Sequence[OverlappedPair]
    schedule: Any
    losses: list[torch.Tensor] | None


def run_actions(
    actions: Sequence[Action],
    stages: Mapping[int, PipelineStage],
    syncs: Mapping[int, StageGradSync],
    data: StepData,
    *,
    agreement: Agreement | None = None,
    custom: CustomRun | None = None,
    in_order: bool = False,
) -> StepResult:
    """Run ``actions`` (this rank's list) over ``stages`` (this rank's, by index).

    ``agreement`` (the first run's) is checked once, just before this rank first sends to
    or receives from another rank: its collective comes before every message of the step
    on every rank (NCCL runs a communicator's operations in the order issued). On failure
    the other ranks are told (module docstring) and the error is raised. ``in_order``: the
    backend matches messages in posting order (:func:`plait.pipeline.p2p.matches_in_order`)
    and ``actions`` were lowered for it.
    """
    runner = _Runner(actions, stages, syncs, data, agreement, custom, in_order)
    for stage in stages.values():
        stage.begin_step(data.backward)
    for sync in syncs.values():
        sync.begin_step()
    steps = runner.steps
    done = 0  # steps run (or, for communication, queued)
    try:
        for step in steps:
            if isinstance(step, OverlappedPair):
                runner.run_pair(step)
            else:
                runner.run(step)
            done += 1
        runner.flush()
        wait_sends(runner.sent)
        for stage in stages.values():
            stage.end_step()
    except BaseException as error:
        # Sends already posted still reach their peers: a peer that read a header goes on
        # to receive its metadata and payload, which gloo moves only inside wait().
        _finish_sends(runner.sent)
        remaining = [*runner.pending, *(a for s in steps[done:] for a in _actions_of(s))]
        failed_here = isinstance(error, Exception)  # not an interrupt
        if runner.messaged or (agreement is None and failed_here):
            abort_step(remaining, stages, error, in_order)  # the neighbours are in the step
        elif runner.agreement is not None and failed_here:
            runner.agreement.report_failure(error)  # they wait in the agreement
        # else: the agreement itself failed, on every rank alike: nothing is pending
        raise
    finally:
        for sync in syncs.values():
            sync.end_step()
    return runner.result


def _actions_of(step: Action | OverlappedPair) -> Sequence[Action]:
    return step.sub_actions if isinstance(step, OverlappedPair) else (step,)


def _finish_sends(sent: list[SentTensor]) -> None:
    """Wait for ``sent`` (abort messages, or a failed step's sends in flight) on a daemon
    thread: gloo moves a send whose receive is not posted yet only inside ``wait()``, and a
    peer that never looks must not block us."""

    def wait_all() -> None:
        for work, _, what in sent:
            try:
                work.wait()
            except Exception as error:  # the peer is gone: nothing left to tell it
                logger.debug("plait: %s did not complete: %s", what, error)

    threading.Thread(target=wait_all, name="plait-pipeline-abort", daemon=True).start()


def abort_step(
    remaining: Sequence[Action],
    stages: Mapping[int, PipelineStage],
    error: BaseException,
    in_order: bool,
) -> None:
    """Tell each neighbour waiting for one of ``remaining`` (this rank's actions not yet
    posted, in order) that this rank's step failed with ``error``: an abort replaces the
    sends to each peer (see :mod:`plait.pipeline.p2p`). Never raises: the caller raises
    ``error``.

    Which sends: on a backend that matches messages by tag (gloo) every remaining one,
    since the peer posts receives ahead and may be waiting for any of them (which one
    depends on timing); on one that matches in order (``in_order``: NCCL) the first to
    each peer, which is the receive the peer waits for next.
    """
    any_stage = next(iter(stages.values()))
    try:
        if isinstance(error, PipelineAbort):  # pass on the same reason
            key, skip = error.key, {error.source}
        else:
            where = f"pipeline rank {any_stage.group_rank} (global rank {dist.get_rank()})"
            key, skip = publish_abort(f"{where} failed: {type(error).__name__}: {error}"), set()
        told: set[int] = set()
        batch = P2PBatch(any_stage.group, any_stage.device)
        for action in remaining:
            if action.kind not in (K.SEND_F, K.SEND_B):
                continue
            stage, forward = stages[action.stage], action.kind is K.SEND_F
            peer = stage.next_peer if forward else stage.prev_peer
            if peer is None or peer in skip or (in_order and peer in told):
                continue
            told.add(peer)
            assert action.microbatch is not None
            stage.send_abort(forward, action.microbatch, key, batch)
        _finish_sends(batch.post())
    except Exception as failure:  # the group may be broken too: the original error counts
        logger.warning("plait: could not tell the other pipeline ranks of the failure: %s", failure)


_RECVS = (K.RECV_F, K.RECV_B)
_AHEAD_PER_STAGE = 2
"""Receives are posted up to this many (per local stage) ahead of their place in the
schedule, so data flows while this rank still computes; the bound keeps the buffers of
early receives from piling up."""


class _Runner:
    def __init__(
        self,
        actions: Sequence[Action],
        stages: Mapping[int, PipelineStage],
        syncs: Mapping[int, StageGradSync],
        data: StepData,
        agreement: Agreement | None,
        custom: CustomRun | None,
        in_order: bool,
    ) -> None:
        self.stages = stages
        self.syncs = syncs
        self.data = data
        self.agreement = agreement  # checked before the first message, then None
        self.messaged = False  # whether this rank has posted a message in this step
        self.result = StepResult()
        self.pending: list[Action] = []  # consecutive communication actions
        self.sent: list[SentTensor] = []
        any_stage = next(iter(stages.values()))
        self.group, self.device = any_stage.group, any_stage.device
        self.functions: Mapping[str, CustomFunction] = {}
        self.steps: Sequence[Action | OverlappedPair] = actions
        self.paired: set[Action] = set()  # halves of pairs: never given to F / B functions
        if custom is not None and custom.functions:
            self.functions = custom.functions
            self.paired = {a for pair in custom.pairs for a in pair.sub_actions}
            if OVERLAP_F_B in custom.functions:
                self.steps = pair_steps(actions, custom.pairs)
            self.context = _PipelineContext(
                custom.schedule,
                [tuple(a) for a in data.args],
                [dict(k) for k in data.kwargs],
                None if data.targets is None else list(data.targets),
                custom.losses,
                runner=self.perform,
            )
        # Receives in the order the steps reach them (a pair's before the pair).
        self.recvs = [a for s in self.steps for a in _actions_of(s) if a.kind in _RECVS]
        self.posted = 0  # self.recvs[:posted] have been posted
        self.reached = 0  # receive actions the schedule has reached
        # Where messages match in posting order, no receive is posted ahead (flush).
        self.in_order = in_order
        self.ahead = 0 if self.in_order else _AHEAD_PER_STAGE * len(stages)

    def run(self, action: Action) -> None:
        """Queue a communication action; run any other, or its custom function."""
        if action.kind.is_comm:
            self.pending.append(action)
            return
        self.flush()
        function = None if action in self.paired else self.functions.get(action.kind.value)
        with traced(f"plait.pipeline.{action}"):
            if function is None:
                self.perform(action)  # which waits for the stage's gathers
            else:
                self.gathered(action)
                function(action, self.context)

    def run_pair(self, pair: OverlappedPair) -> None:
        """An overlapped pair as one step: its custom function, once its receives are
        posted (they come before it)."""
        self.flush()
        for half in pair.sub_actions:
            self.gathered(half)
        with traced(f"plait.pipeline.{pair}"):
            self.functions[OVERLAP_F_B](pair, self.context)

    def gathered(self, action: Action) -> None:
        """Before a compute action: complete its stage's all-gathers, which its UNSHARD
        may have issued ahead (``max_active_stages``), as torch's runtime waits before
        computing on a stage. Custom functions get the stage gathered too."""
        if action.kind.is_compute and (sync := self.syncs.get(action.stage)) is not None:
            sync.wait_unshard()

    def perform(self, action: Action | OverlappedPair) -> None:
        """The runtime's own work for a compute or FSDP action (a pair: F then B)."""
        if isinstance(action, OverlappedPair):
            self.perform(action.forward)
            self.perform(action.backward)
            return
        self.gathered(action)  # (a custom function's run_action comes here directly)
        if action.kind is K.FORWARD:
            self.forward(self.stages[action.stage], action.microbatch)  # type: ignore[arg-type]
        elif action.kind.is_compute:
            self.backward(self.stages[action.stage], action)
        elif action.kind.is_fsdp:
            self.data_parallel(action)
        else:
            raise ValueError(f"{action} is a communication action: the runtime posts those")

    def forward(self, stage: PipelineStage, mb: int) -> None:
        data = self.data
        args = data.args[mb] if stage.is_first else ()
        with torch.set_grad_enabled(data.backward):
            output = stage.forward_one_chunk(mb, args, data.kwargs[mb], save=data.backward)
            if not stage.is_last:
                return
            if data.keep_outputs:
                kept = self.result.outputs[mb] = tree_map(_detached, output)
                stage.output_chunks.append(kept)
            if data.loss_fn is None or data.targets is None:
                return
            loss = data.loss_fn(output, data.targets[mb], **data.loss_kwargs)
        self.result.losses[mb] = loss.detach()
        if data.backward:
            stage.seed_loss(mb, loss, data.scales[mb])

    def backward(self, stage: PipelineStage, action: Action) -> None:
        mb = action.microbatch
        assert mb is not None
        if action.kind is K.BACKWARD_WEIGHT:
            stage.backward_weight_one_chunk(mb)
        else:
            stage.backward_one_chunk(mb, full=action.kind is K.FULL_BACKWARD)
        sync = self.syncs.get(action.stage)
        if sync is not None:  # accumulate over microbatches in the reduce dtype
            sync.stash_grads()

    def data_parallel(self, action: Action) -> None:
        sync = self.syncs.get(action.stage)
        if sync is None:
            return  # a stage without data parallelism: nothing to gather or reduce
        if action.kind is K.UNSHARD:
            sync.unshard()
        elif action.kind is K.RESHARD:
            sync.reshard()
        else:
            sync.reduce_grads()

    def flush(self) -> None:
        """Post the pending communication actions, and receives ahead, as one batch.

        Receives are posted in schedule order (so every pair of ranks sees its messages
        in the same order) and waited for by the compute action that consumes them.
        Where messages match in posting order, every action is posted in its place, none
        ahead, and the batch ends after an activation receive that has no agreed metadata
        yet, which is settled then (module docstring of :mod:`plait.pipeline.p2p`).
        """
        if not self.pending and self.posted == len(self.recvs):
            return  # nothing to send and every receive posted
        batch = P2PBatch(self.group, self.device, self.in_order)
        for action in self.pending:
            if action.kind in _RECVS:
                self.reached += 1  # posted below, if it was not already
                if self.in_order:
                    batch = self.queue_receives(batch)
            else:
                self.queue_send(action, batch)
        self.pending.clear()
        self.post(self.queue_receives(batch))

    def post(self, batch: P2PBatch) -> None:
        if batch:
            agreement, self.agreement = self.agreement, None
            if agreement is not None:
                agreement.check()
            self.messaged = True
            prune_sends(self.sent)  # free the buffers of sends that have completed
            self.sent += batch.post()

    def queue_receives(self, batch: P2PBatch) -> P2PBatch:
        """Every receive the schedule has reached, and those within the look-ahead whose
        buffers can be sized (a gradient's, once its forward ran); returns the batch to
        go on with (a new one after an activation receive that had to be settled)."""
        while self.posted < len(self.recvs):
            action = self.recvs[self.posted]
            stage = self.stages[action.stage]
            mb = action.microbatch
            assert mb is not None
            if self.posted >= self.reached:  # ahead of the schedule: only if allowed
                if self.posted >= self.reached + self.ahead:
                    break
                if action.kind is K.RECV_B and not stage.can_recv_gradients(mb):
                    break
            self.posted += 1
            if action.kind is K.RECV_B:
                stage.recv_gradients(mb, batch)
                continue
            stage.recv_activations(mb, batch)
            recv = batch.recvs[-1]
            assert isinstance(recv, ActivationRecv)
            if self.in_order and recv.agreed is None:  # the first: its metadata follows
                self.post(batch)
                recv.settle()
                batch = P2PBatch(self.group, self.device, self.in_order)
        return batch

    def queue_send(self, action: Action, batch: P2PBatch) -> None:
        stage = self.stages[action.stage]
        mb = action.microbatch
        assert mb is not None
        if action.kind is K.SEND_F:
            stage.send_activations(mb, batch)
        else:
            stage.send_gradients(mb, batch)


def _detached(x: Any) -> Any:
    """Outputs handed back to the user carry no graph (backward owns it)."""
    return x.detach() if isinstance(x, torch.Tensor) else x
