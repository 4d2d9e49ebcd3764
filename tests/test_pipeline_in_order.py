"""Pipelines on a backend that matches messages in posting order (NCCL), tested on CPU.

NCCL ignores tags, matches the messages between two ranks in the order they were posted,
runs a rank's operations one batch after another and gives one work per batch; gloo does
none of these, so the rest of the suite cannot see an order that would hang GPUs, or a
message that would land in the wrong buffer. Here the lowering for such a backend
(:mod:`plait.pipeline.lowering`) is replayed on paper under NCCL's rules
(:func:`~plait.pipeline.in_order.check_in_order`) for every schedule over many shapes,
and whole training and eval steps run under an emulation of those rules on gloo
(:mod:`in_order_p2p`), each checked against one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from plait.pipeline import SCHEDULE_CLASSES, SCHEDULES, p2p
from plait.pipeline.actions import (
    Action,
    ActionKind,
    OverlappedPair,
    ScheduleError,
    stage_to_rank,
)
from plait.pipeline.in_order import check_in_order
from plait.pipeline.lowering import add_communication
from plait.pipeline.ordering import Lowering, Shape, generated, given, pair_steps
from plait.pipeline.schedules import generate, schedule_spec

import test_pipeline_runtime as runtime_tests
import test_pipeline_torch_extras as extras_tests
from harness import run_on_ranks
from in_order_p2p import in_order_p2p
from models import layer_stack

K = ActionKind


def _shapes(name: str) -> list[tuple[int, int, int]]:
    """(ranks, stages, microbatches) to replay ``name`` at: 2 to 8 ranks, 1 to 3 stages
    per rank where the schedule takes them, the fewest microbatches, an odd count and
    more than twice the stages."""
    spec = schedule_spec(name)
    shapes = []
    for ranks in (2, 3, 4, 8):
        for per_rank in (spec.stages_per_rank,) if spec.stages_per_rank else (1, 2, 3):
            stages = per_rank * ranks
            fewest = spec.min_microbatches(stages)
            for m in sorted({fewest, max(fewest, 5), 2 * stages + 1}):
                shapes.append((ranks, stages, m))
    return shapes


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_lowered_in_order_runs_under_nccls_rules(name: str) -> None:
    # The orders a schedule class runs there: training (with FSDP actions), eval's forwards,
    # and training with DualPipeV's overlapped pairs each run as one step (a custom
    # OVERLAP_F_B function), each as a first step (activation receives settled in place)
    # and as a later one.
    for ranks, stages, m in _shapes(name):
        order = generated(name, Shape(ranks, stages, m), Lowering(fsdp=True, in_order=True))
        paired = {
            r: [a for step in pair_steps(acts, order.pairs.get(r, ())) for a in _actions(step)]
            for r, acts in order.train.items()
        }
        for actions in (order.train, order.eval, paired):
            for first_step in (True, False):
                check_in_order(actions, order.placement, first_step=first_step)


def _actions(step: Action | OverlappedPair) -> tuple[Action, ...]:
    return step.sub_actions if isinstance(step, OverlappedPair) else (step,)


def test_receives_beside_their_consumers_would_hang_on_nccl() -> None:
    # The lowering for gloo (receive right before its consumer) is not enough there: on
    # two ranks the interleaved schedules hang or cross their messages; one stage per
    # rank is fine.
    owners = {s: stage_to_rank(s, 2, "loop") for s in range(4)}
    lowered = add_communication(generate("Interleaved1F1B", 2, 4, 4), 2, owners, 4)
    with pytest.raises(
        ScheduleError,
        match=r"hangs .*rank 0 is at 2B1, its stream waiting on: send to rank 1; rank 1 is at 1F2",
    ):
        check_in_order(lowered, owners, first_step=False)
    v = {0: 0, 1: 1, 2: 1, 3: 0}
    lowered = add_communication(generate("ZBVZeroBubble", 2, 4, 4), 2, v, 4)
    crossed = "crosses its messages .*: message 2 from rank 0 to rank 1 is the gradients"
    with pytest.raises(ScheduleError, match=crossed):
        check_in_order(lowered, v, first_step=False)
    one_each = add_communication(generate("1F1B", 2, 2, 4), 2, {0: 0, 1: 1}, 2)
    check_in_order(one_each, {0: 0, 1: 1}, first_step=True)


def test_an_order_lowered_elsewhere_is_checked_for_nccl() -> None:
    # An order handed over with its sends and receives (torch's 'compute_comms') runs as
    # given: on gloo this one is fine, on NCCL it would hang, and is refused up front.
    owners = {s: stage_to_rank(s, 2, "loop") for s in range(4)}
    lowered = add_communication(generate("Interleaved1F1B", 2, 4, 4), 2, owners, 4)
    shape = Shape(2, 4, 4)
    given("Interleaved1F1B", lowered, "compute_comms", shape)
    with pytest.raises(ScheduleError, match="hangs on a backend that matches messages"):
        given("Interleaved1F1B", lowered, "compute_comms", shape, Lowering(in_order=True))
    for_nccl = add_communication(generate("Interleaved1F1B", 2, 4, 4), 2, owners, 4, in_order=True)
    given("Interleaved1F1B", for_nccl, "compute_comms", shape, Lowering(in_order=True))


def _in_order(body: object, *args: object) -> object:
    """Run a test body of another module with NCCL's rules emulated (on every rank)."""
    with in_order_p2p():
        return body(*args)  # type: ignore[operator]


@pytest.mark.parametrize("name", list(SCHEDULE_CLASSES))
def test_every_schedule_matches_one_process_with_messages_in_order(name: str) -> None:
    # Uneven microbatches (2, 2, 2, 1) in the first step, whose receives settle their
    # metadata in place; the same again (the steady state: one message per transfer);
    # then a new sequence length and a new batch, whose changes go through the store.
    per_rank = runtime_tests.per_rank(name)
    m = max(4, SCHEDULES[name].min_microbatches(per_rank * 2))
    steps = [(7, 3), (7, 3), (7, 5), (9, 2)]
    counts = run_on_ranks(2, _in_order, runtime_tests._parity_body, name, steps, m)
    assert counts == [per_rank] * 2


@pytest.mark.parametrize("name", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_four_ranks_with_messages_in_order(name: str) -> None:
    m = max(4, SCHEDULES[name].min_microbatches(8))
    run_on_ranks(4, _in_order, runtime_tests._parity_body, name, [(8, 3), (8, 3)], m)


def test_eval_alternates_with_training_with_messages_in_order() -> None:
    assert run_on_ranks(2, _in_order, runtime_tests._eval_body) == [[True, True, True]] * 2


def _alternating() -> int:
    """Train, eval, train, eval, train: the store carries nothing (training and eval keep
    agreements of their own); returns how many changes went through it."""
    model = layer_stack(4)
    reference = copy.deepcopy(model)
    schedule, modules = runtime_tests._build_schedule("Interleaved1F1B", model, 4, 2, F.mse_loss)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    before = sum(p2p._changes.values())
    for _ in range(2):
        schedule.step(x, target=y)
        out = schedule.eval(x)
        if out is not None:
            torch.testing.assert_close(out, reference(x))
    schedule.step(x, target=y)
    assert all(p.grad is not None for m in modules for p in m.parameters())
    return sum(p2p._changes.values()) - before


def test_training_and_eval_alternate_without_the_store() -> None:
    assert run_on_ranks(2, _in_order, _alternating) == [0, 0]


@pytest.mark.parametrize("name", ["1F1B", "ZBVZeroBubble"])
def test_fully_shard_stages_with_messages_in_order(name: str) -> None:
    # Pipeline groups of 2 beside data-parallel groups of 2: the schedule's FSDP actions
    # and the lowering for in-order messages together.
    run_on_ranks(4, _in_order, runtime_tests._pp_dp_body, name, "fully_shard")


@pytest.mark.parametrize("threaded", [False, True])
def test_overlapped_pairs_run_by_a_custom_function_with_messages_in_order(
    threaded: bool,
) -> None:
    # DualPipeV with a custom OVERLAP_F_B function: each pair runs as one step.
    results = run_on_ranks(2, _in_order, extras_tests._overlap_body, 4, threaded)
    assert all(r["pairs_match_torch"] and r["forwards_unpaired"] for r in results)


def test_a_real_model_with_messages_in_order() -> None:
    run_on_ranks(2, _in_order, runtime_tests._gpt_body, "InterleavedZeroBubble")


def _emulation_off() -> bool:
    return dist.batch_isend_irecv.__module__ == "torch.distributed.distributed_c10d" and (
        not p2p.matches_in_order(torch.device("cpu"))
    )


def test_the_emulation_is_left_on_no_rank() -> None:
    # Each body restores gloo's behaviour, so the pooled workers stay as other tests expect.
    run_on_ranks(2, _in_order, runtime_tests._eval_body)
    assert run_on_ranks(2, _emulation_off) == [True, True]
