"""torch pipelining API points beyond the schedules themselves: custom functions in the
runtime (``register_custom_function``, DualPipeV's ``OVERLAP_F_B``), a stage's
``output_chunks``, and a declared stage shape that is wrong, which must stop every rank
with a message naming the stage and both shapes. Plus the pure parts behind the schedule
classes (ordering, step inputs, constructor orders), checked in one process.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from plait.pipeline import (
    OVERLAP_F_B,
    Action,
    ActionKind,
    OverlappedPair,
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleError,
    ScheduleGPipe,
    _PipelineContext,
    _PipelineScheduleRuntime,
    dualpipe_v_pairs,
    parse_action,
    split_model,
    stages_of_rank,
)
from plait.pipeline.custom import custom_type
from plait.pipeline.ordering import (
    Lowering,
    Shape,
    check_pair_steps,
    check_placement,
    forward_only,
    generated,
    given,
    pair_steps,
)
from plait.pipeline.schedule_classes import _MULTI, _SINGLE, FORWARD
from plait.pipeline.schedule_csv import load_csv_cells
from plait.pipeline.step_inputs import Microbatching, StepInputs, step_data

from harness import run_on_ranks
from models import dualpipe_v_stages, layer_stack

K = ActionKind
ATOL, RTOL = 1e-6, 1e-5
TIMEOUT = 90.0  # seconds: every multi-process test below has this deadline


def _torch_dualpipe_order(n_ranks: int, m: int) -> dict[int, list[Any]]:
    """torch's own DualPipeV compute order (its ``_Action`` objects, None gaps dropped)."""
    from torch.distributed.pipelining import schedules as ts

    obj = object.__new__(ts.ScheduleDualPipeV)
    obj.pp_group_size, obj._n_microbatches, obj._num_stages = n_ranks, m, 2 * n_ranks
    try:
        order = {r: obj._calculate_single_rank_operations(r) for r in range(n_ranks)}
    except (AttributeError, TypeError) as err:
        pytest.skip(f"torch's private DualPipeV helpers changed: {err}")
    return {r: [a for a in acts if a is not None] for r, acts in order.items()}


# --- pure: ordering, pairs, step inputs, constructor orders (no process group) ----------


@pytest.mark.parametrize(("n_ranks", "m"), [(1, 2), (2, 4), (2, 7), (3, 6), (4, 9)])
def test_dualpipe_pairs_are_torchs_overlap_actions(n_ranks: int, m: int) -> None:
    assert not dist.is_initialized()  # pure: no process group anywhere below
    torch_order = _torch_dualpipe_order(n_ranks, m)
    order = generated("DualPipeV", Shape(n_ranks, 2 * n_ranks, m))
    for rank in range(n_ranks):
        theirs = [str(a) for a in torch_order[rank] if a.sub_actions is not None]
        assert [str(p) for p in order.pairs[rank]] == theirs
        assert [str(p) for p in dualpipe_v_pairs(n_ranks, m)[rank]] == theirs
    # Given as torch's action objects, the order keeps the same pairs.
    loaded = given("Runtime", torch_order, "compute_only", Shape(n_ranks, 2 * n_ranks, m))
    assert loaded.pairs == order.pairs and loaded.train == order.train


def test_pair_steps_order_a_pair_as_torch_does() -> None:
    """Receives of both halves before the pair, their sends after it; deadlock-free."""
    for n_ranks, m, fsdp in [(2, 4, False), (2, 6, True), (4, 8, False), (3, 9, True)]:
        order = generated("DualPipeV", Shape(n_ranks, 2 * n_ranks, m), Lowering(fsdp=fsdp))
        check_pair_steps(order)
        for rank, actions in order.train.items():
            steps = pair_steps(actions, order.pairs.get(rank, ()))
            flat = [
                a for s in steps for a in (s.sub_actions if isinstance(s, OverlappedPair) else (s,))
            ]
            assert sorted(map(str, flat)) == sorted(map(str, actions))
            for i, step in enumerate(steps):
                if not isinstance(step, OverlappedPair):
                    continue
                f, b = step.sub_actions
                for recv in (
                    Action(f.stage, K.RECV_F, f.microbatch),
                    Action(b.stage, K.RECV_B, b.microbatch),
                ):
                    if recv in actions:
                        assert steps.index(recv) < i, (rank, step, recv)
                for send in (
                    Action(f.stage, K.SEND_F, f.microbatch),
                    Action(b.stage, K.SEND_B, b.microbatch),
                ):
                    if send in actions:
                        assert steps.index(send) > i, (rank, step, send)
    pair = OverlappedPair(parse_action("0F1"), parse_action("3B0"))
    with pytest.raises(ScheduleError, match="not consecutive"):
        pair_steps([parse_action(t) for t in ("0F1", "0F2", "3B0")], [pair])


def test_overlapped_pair_reads_like_torchs_action() -> None:
    pair = OverlappedPair(parse_action("0F3"), parse_action("3B1"))
    assert str(pair) == "(0F3;3B1)OVERLAP_F_B" and pair.computation_type == OVERLAP_F_B
    assert pair.sub_actions[1].microbatch_index == 1 and pair.sub_actions[0].stage_index == 0
    assert parse_action("2I4").computation_type is K.BACKWARD_INPUT
    assert parse_action("2F4").computation_type is FORWARD
    with pytest.raises(ValueError, match="two different stages"):
        OverlappedPair(parse_action("0F3"), parse_action("0B1"))
    with pytest.raises(ValueError, match="a forward .F. then a backward"):
        OverlappedPair(parse_action("0B3"), parse_action("3F1"))


def test_custom_types_are_torchs() -> None:
    from torch.distributed.pipelining.schedules import _ComputationType

    for kind in ("F", "B", "I", "W", "OVERLAP_F_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"):
        assert custom_type(_ComputationType(kind)) == kind == custom_type(kind)
    assert custom_type(K.FORWARD) == "F"
    for bad in (_ComputationType.SEND_F, K.RECV_B, "X", 3):
        with pytest.raises(ValueError, match="Invalid computation type .*Only FORWARD"):
            custom_type(bad)
    with pytest.raises(RuntimeError, match="only available inside a pipeline step"):
        _PipelineContext(None).run_action(parse_action("0F0"))


def test_torch_csv_with_overlap_cells_keeps_its_pairs(tmp_path: Path) -> None:
    torch_order = _torch_dualpipe_order(2, 5)
    with open(tmp_path / "dual.csv", "w", newline="") as f:
        csv.writer(f).writerows(torch_order[r] for r in range(2))
    order = given(
        "Runtime",
        load_csv_cells(tmp_path / "dual.csv"),
        "compute_only",
        Shape(2, 4, 5),
        Lowering(fsdp=True),
    )
    assert {r: list(p) for r, p in order.pairs.items()} == dualpipe_v_pairs(2, 5)
    assert any(a.kind is K.UNSHARD for a in order.train[0])


def test_placement_and_forward_only_orders() -> None:
    order = forward_only("ForwardOnly", Shape(3, 3, 2))
    assert [str(a) for a in order.compute[1]] == ["1F0", "1F1"] and order.eval == order.train
    assert check_placement("X", order.placement, Shape(3, 3, 2), 1, [1]) == [0, 1, 2]
    with pytest.raises(
        ValueError, match=r"places stages \[1\] on pipeline rank 1 .*given stages \[2\]"
    ):
        check_placement("X", order.placement, Shape(3, 3, 2), 1, [2])
    with pytest.raises(ValueError, match="num_stages must be 3"):
        forward_only("ForwardOnly", Shape(3, 6, 2))


def test_step_inputs_are_one_frozen_value() -> None:
    inputs = StepInputs((torch.arange(8.0).view(4, 2),), target=torch.zeros(4, 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.target = None  # type: ignore[misc]
    cut = Microbatching("GPipe", 2, True, True, F.mse_loss, True, None, None)
    data = step_data(inputs, cut, backward=True)
    assert [a[0].shape[0] for a in data.args] == [2, 2] and data.scales == [0.5, 0.5]
    with pytest.raises(ValueError, match="not both"):
        step_data(dataclasses.replace(inputs, arg_mbs=[(1,), (2,)]), cut, backward=True)


def test_constructor_orders_bind_torchs_positions() -> None:
    # PipelineScheduleMulti: torch's 7th positional argument is use_full_backward.
    multi = _MULTI.arguments("self", ["s"], 4, None, None, None, None, True, False)
    assert multi == {
        "stages": ["s"],
        "n_microbatches": 4,
        "loss_fn": None,
        "args_chunk_spec": None,
        "kwargs_chunk_spec": None,
        "output_merge_spec": None,
        "use_full_backward": True,
        "scale_grads": False,
    }
    single = _SINGLE.arguments("self", "one", 2, None, scale_grads=False, defer_pp_recv=True)
    assert single["stages"] == ["one"] and single["defer_pp_recv"] is True
    with pytest.raises(TypeError):  # the single-stage classes end at scale_grads, as torch
        _SINGLE.arguments("self", "one", 2, None, None, None, None, True, True)


# --- register_custom_function: DualPipeV's overlapped pairs ------------------------------


def _dual_setup(m: int) -> tuple[ScheduleDualPipeV, list[nn.Module], nn.Module]:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = layer_stack(2 * world)
    reference = copy.deepcopy(model)
    schedule, modules, _ = dualpipe_v_stages(model, m, rank, world)
    return schedule, modules, reference


def _check_step(
    schedule: Any,
    modules: list[nn.Module],
    reference: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    losses: list[torch.Tensor] | None = None,
) -> None:
    """One step of ``schedule`` against the whole model on the whole batch."""
    for mod in [*modules, reference]:
        mod.zero_grad(set_to_none=True)
    losses = [] if losses is None else losses
    out = schedule.step(x, target=y, losses=losses)
    ref_out = reference(x)
    ref_loss = F.mse_loss(ref_out, y)
    ref_loss.backward()
    if out is not None:
        torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss, atol=ATOL, rtol=RTOL)
    ref = dict(reference.named_parameters())
    for mod in modules:
        for name, p in mod.named_parameters():
            torch.testing.assert_close(p.grad, ref[name].grad, atol=ATOL, rtol=RTOL, msg=name)


def _overlap_body(m: int, threaded: bool) -> dict[str, Any]:
    """DualPipeV with a custom OVERLAP_F_B function that runs the pair's halves itself:
    backward first then forward, or both at once on two threads. A FORWARD function counts
    the other forwards (as in torch, a pair's halves never reach it)."""
    schedule, modules, reference = _dual_setup(m)
    pairs: list[str] = []
    forwards: list[str] = []
    contexts: list[tuple[bool, int, int, bool, bool]] = []
    losses_seen: list[Any] = []
    pool = ThreadPoolExecutor(2, thread_name_prefix="overlap") if threaded else None
    threads: set[str] = set()

    def overlap(action: Any, ctx: _PipelineContext) -> None:
        assert action.computation_type == OVERLAP_F_B
        forward, backward = action.sub_actions
        pairs.append(str(action))
        contexts.append(
            (
                ctx.schedule_ref is schedule,
                len(ctx.arg_mbs or ()),
                len(ctx.kwarg_mbs or ()),
                ctx.target_mbs is not None and len(ctx.target_mbs) == m,
                ctx.losses is losses_seen[-1],
            )
        )
        if pool is None:
            ctx.run_action(backward)  # the halves are independent: any order will do
            ctx.run_action(forward)
            return

        def half(a: Action) -> None:
            threads.add(threading.current_thread().name)
            ctx.run_action(a)

        for done in [pool.submit(half, backward), pool.submit(half, forward)]:
            done.result()

    def forward_fn(action: Any, ctx: _PipelineContext) -> None:
        forwards.append(str(action))
        ctx.run_action(action)

    schedule.register_custom_function(OVERLAP_F_B, overlap)
    schedule.register_custom_function(FORWARD, forward_fn)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        x, y = torch.randn(2 * m, 6, generator=gen), torch.randn(2 * m, 6, generator=gen)
        losses_seen.append([])  # the list the context must hold
        _check_step(schedule, modules, reference, x, y, losses_seen[-1])
    if pool is not None:
        pool.shutdown()
    rank = dist.get_rank()
    torch_pairs = [
        str(a) for a in _torch_dualpipe_order(dist.get_world_size(), m)[rank] if a.sub_actions
    ]
    all_forwards = [str(a) for a in schedule.pipeline_order[rank] if a.kind is K.FORWARD]
    paired = {str(p.forward) for p in dualpipe_v_pairs(dist.get_world_size(), m)[rank]}
    return {
        "pairs_match_torch": pairs == torch_pairs * 2,
        "forwards_unpaired": forwards == [f for f in all_forwards if f not in paired] * 2,
        "contexts": sorted(set(contexts)),
        "threads": len(threads),
        "last_stage_here": 2 * dist.get_world_size() - 1 in schedule._stages,
    }


@pytest.mark.parametrize(("world", "m", "threaded"), [(2, 4, False), (2, 6, True), (4, 8, False)])
def test_custom_overlap_function_runs_the_pairs_itself(world: int, m: int, threaded: bool) -> None:
    results = run_on_ranks(world, _overlap_body, m, threaded, timeout=TIMEOUT)
    for rank, result in enumerate(results):
        assert result["pairs_match_torch"] and result["forwards_unpaired"], (rank, result)
        holds_last = result["last_stage_here"]
        # schedule_ref, one arg / kwarg entry per microbatch, targets on the last stage's
        # rank only, and the caller's losses list.
        assert result["contexts"] == [(True, m, m, holds_last, True)], (rank, result)
        if threaded:
            assert result["threads"] == 2


def _reject_body() -> list[str]:
    schedule, _, _ = _dual_setup(4)
    messages = []
    for bad in ("SEND_F", K.RECV_B, "OVERLAP"):
        try:
            schedule.register_custom_function(bad, lambda a, c: None)
        except ValueError as err:
            messages.append(str(err))
    single = Schedule1F1B(
        PipelineStage(
            split_model(layer_stack(2), 2, stages=[dist.get_rank()])[0], dist.get_rank(), 2, "cpu"
        ),
        2,
    )
    messages.append(str(hasattr(single, "register_custom_function")))  # torch: runtime only
    return messages


def test_register_custom_function_rejects_other_types() -> None:
    for messages in run_on_ranks(2, _reject_body, timeout=TIMEOUT):
        assert len(messages) == 4 and messages[3] == "False"
        assert all("Only FORWARD, FULL_BACKWARD" in m for m in messages[:3])


def _fsdp_custom_body() -> list[str]:
    """Custom REDUCE_GRAD / UNSHARD functions on a runtime with a loaded order: called
    once per stage and step with their action, and replacing the runtime's work."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = layer_stack(4)
    reference = copy.deepcopy(model)
    ids = stages_of_rank(rank, world, 4, "v")
    modules = split_model(model, 4, stages=ids)
    stages = [PipelineStage(mod, s, 4, "cpu") for mod, s in zip(modules, ids, strict=True)]
    runtime = _PipelineScheduleRuntime(stages, 4, loss_fn=F.mse_loss)
    order = generated("DualPipeV", Shape(world, 4, 4), Lowering(fsdp=True))  # with FSDP actions
    runtime._prepare_schedule_with_comms(order.train, format="compute_comms")
    seen: list[str] = []
    runtime.register_custom_function(K.REDUCE_GRAD, lambda a, ctx: seen.append(str(a)))
    runtime.register_custom_function("UNSHARD", lambda a, ctx: seen.append(str(a)))
    _check_step(runtime, modules, reference, torch.randn(8, 6), torch.randn(8, 6))
    return seen


def test_custom_functions_for_fsdp_actions() -> None:
    for rank, seen in enumerate(run_on_ranks(2, _fsdp_custom_body, timeout=TIMEOUT)):
        local = stages_of_rank(rank, 2, 4, "v")
        assert sorted(seen) == sorted(
            [f"{s}UNSHARD" for s in local] + [f"{s}REDUCE_GRAD" for s in local]
        )


# --- output_chunks, as torch's ------------------------------------------------------------


def _output_chunks_body() -> list[list[int]]:
    """After each call, the number of output chunks on every stage, plait's and torch's."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import ScheduleGPipe as TorchGPipe

    rank = dist.get_rank()
    model = layer_stack(2)
    ours = split_model(model, 2, stages=[rank])[0]
    stage = PipelineStage(ours, rank, 2, "cpu")
    torch_stage = TorchStage(copy.deepcopy(ours), rank, 2, torch.device("cpu"))
    plait_schedule = ScheduleGPipe(stage, 4, loss_fn=F.mse_loss)
    torch_schedule = TorchGPipe(torch_stage, 4, loss_fn=F.mse_loss)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    counts = []
    for call in ("step", "step_no_outputs", "eval", "clear"):
        for s, st in ((plait_schedule, stage), (torch_schedule, torch_stage)):
            if call == "clear":
                st.clear_runtime_states()
                continue
            kwargs = {"return_outputs": False} if call == "step_no_outputs" else {}
            run = s.eval if call == "eval" else s.step
            out = run(*([x] if rank == 0 else []), target=y, **kwargs)
            if out is not None:
                torch.testing.assert_close(torch.cat(st.output_chunks), out)
        assert all(not c.requires_grad for c in stage.output_chunks)
        counts.append([len(stage.output_chunks), len(torch_stage.output_chunks)])
    return counts


def test_output_chunks_hold_the_last_steps_outputs_as_torch() -> None:
    first, last = run_on_ranks(2, _output_chunks_body, timeout=TIMEOUT)
    # Filled on the last stage during a step, kept until the next step starts (which
    # clears them; return_outputs=False keeps none), emptied by clear_runtime_states.
    assert last == [[4, 4], [0, 0], [4, 4], [0, 0]]
    assert first == [[0, 0]] * 4


# --- a declared shape that is wrong: every rank stops, naming the stage --------------------


class _KeepShape(nn.Module):
    """(B, T, 6) -> (B, T, 6): the sequence length T may change from step to step."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


def _declared_body(case: str) -> str:
    """Every rank's error, as ``"<type>: <message>"`` ("" if none)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = nn.Sequential(*(_KeepShape() for _ in range(world)))
    module = split_model(model, world, stages=[rank])[0]
    declared: dict[str, Any] = {}
    if case in ("first_step", "later_step") and rank == 0:
        declared["output_args"] = torch.ones(2, 4, 5 if case == "first_step" else 6)
    if case == "input" and rank == 1:
        declared["input_args"] = torch.ones(2, 4, 7)
    stage = PipelineStage(module, rank, world, "cpu", **declared)
    schedule = Schedule1F1B(stage, world, loss_fn=F.mse_loss)
    try:
        for t in (4, 5):  # the second step changes the sequence length
            x, y = torch.randn(2 * world, t, 6), torch.randn(2 * world, t, 6)
            schedule.step(*([x] if rank == 0 else []), target=y if rank == world - 1 else None)
    except (RuntimeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    finally:
        if case == "first_step":  # nothing was left pending: the group still works
            dist.barrier()
    return ""


_SHAPES = {
    "first_step": (r"\[2, 4, 6\]", r"\[2, 4, 5\]"),
    "later_step": (r"\[2, 5, 6\]", r"\[2, 4, 6\]"),
}


_FAILED = (
    "PipelineAbort: plait: the pipeline step stopped because pipeline rank {} (global rank {}) "
    "failed: RuntimeError: stage {}"
)


def _mismatch(where: str, what: str, actual: str, declared: str) -> str:
    """The failing rank's own error: the stage, then the actual and the declared shapes."""
    return (
        rf"RuntimeError: stage {where}, microbatch \d: {what}s \[torch.float32 {actual}\] do "
        rf"not match the declared {what}_args \[torch.float32 {declared}\]"
    )


@pytest.mark.parametrize(("case", "world"), [("first_step", 4), ("later_step", 2)])
def test_wrong_output_args_stop_every_rank(case: str, world: int) -> None:
    broken = case != "first_step"  # aborts after the first step leave transfers behind
    messages = run_on_ranks(
        world, _declared_body, case, timeout=TIMEOUT, leaves_group_broken=broken
    )
    actual, declared = _SHAPES[case]
    assert re.match(_mismatch("0", "output", actual, declared), messages[0]), messages[0]
    # Every other rank: PipelineAbort naming the rank, the stage and both shapes.
    for rank, message in enumerate(messages[1:], start=1):
        assert message.startswith(_FAILED.format(0, 0, 0)), (rank, message)
        assert re.search(actual, message) and re.search(declared, message), (rank, message)


def test_wrong_input_args_stop_every_rank() -> None:
    messages = run_on_ranks(2, _declared_body, "input", timeout=TIMEOUT, leaves_group_broken=True)
    expected = _mismatch("1", "input", r"\[2, 4, 6\]", r"\[2, 4, 7\]")
    assert re.match(expected, messages[1]), messages[1]
    assert messages[0].startswith(_FAILED.format(1, 1, 1)), messages[0]
