"""torch's schedule surface beyond the schedule classes: ``get_schedule_class``, the
forward-only schedule, and schedules as CSV files (``_load_csv`` / ``_dump_csv``, torch's
layout: one row per rank, one action per cell), read, written and run.
"""

from __future__ import annotations

import ast
import copy
import csv
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from plait import spmd
from plait.pipeline import (
    SCHEDULE_CLASSES,
    SCHEDULES,
    PipelineSchedule,
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleError,
    _PipelineScheduleRuntime,
    _ScheduleForwardOnly,
    add_communication,
    dump_csv,
    format_csv,
    generate,
    get_schedule_class,
    load_csv,
    parse_action,
    parse_csv,
    split_model,
    stages_of_rank,
)

from harness import run_on_ranks
from models import layer_stack

ATOL, RTOL = 1e-6, 1e-5


# --- get_schedule_class (pure) -----------------------------------------------------------


def test_get_schedule_class_is_case_insensitive() -> None:
    assert get_schedule_class("1f1b") is Schedule1F1B
    assert get_schedule_class("DUALPIPEV") is ScheduleDualPipeV
    assert get_schedule_class("pipelineschedulemulti") is PipelineScheduleMulti
    assert get_schedule_class("PipelineScheduleSingle") is PipelineScheduleSingle
    for name, cls in SCHEDULE_CLASSES.items():
        assert get_schedule_class(name.swapcase()) is cls
        assert issubclass(cls, PipelineSchedule)


def test_get_schedule_class_knows_torchs_names() -> None:
    from torch.distributed.pipelining.schedules import get_schedule_class as torch_get

    with pytest.raises(ValueError, match="valid options are") as info:
        torch_get("NoSuchSchedule")
    torch_names = ast.literal_eval(str(info.value).split("valid options are ")[1])
    for name in torch_names:
        assert get_schedule_class(name).__name__ == torch_get(name).__name__, name


def test_get_schedule_class_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="'ScheduleThatDoesNotExist'.*'DualPipeV'"):
        get_schedule_class("ScheduleThatDoesNotExist")


# --- CSV: text form in torch's layout (pure) ------------------------------------------


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_csv_round_trip(name: str, tmp_path: Path) -> None:
    per_rank = SCHEDULES[name].stages_per_rank or 2
    n_stages = 3 * per_rank
    m = max(5, SCHEDULES[name].min_microbatches(n_stages))
    for lowered in (False, True):
        schedule = generate(name, 3, n_stages, m, communication=lowered, fsdp=lowered)
        text = format_csv(schedule)
        assert text.splitlines()[0].split(",")[0] == str(schedule[0][0])
        assert parse_csv(text) == schedule
        dump_csv(schedule, tmp_path / "s.csv")
        assert load_csv(tmp_path / "s.csv") == schedule


def test_csv_is_torchs_layout(tmp_path: Path) -> None:
    """torch reads plait's file cell by cell, and plait reads torch's, including its empty
    cells and its OVERLAP_F_B pairs (expanded to their F then B)."""
    from torch.distributed.pipelining.schedules import _Action

    schedule = generate("DualPipeV", 2, 4, 5, communication=True)
    dump_csv(schedule, tmp_path / "plait.csv")
    with open(tmp_path / "plait.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert [[str(_Action.from_str(c)) for c in row] for row in rows] == [
        [str(a) for a in schedule[r]] for r in range(2)
    ]
    with open(tmp_path / "torch.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["0F0", None, "(0F1;3B0)OVERLAP_F_B", "0B0"])
        writer.writerow([])
        writer.writerow(["1UNSHARD", "1RECV_F0"])
    assert load_csv(tmp_path / "torch.csv") == {
        0: [parse_action(t) for t in ("0F0", "0F1", "3B0", "0B0")],
        1: [],
        2: [parse_action(t) for t in ("1UNSHARD", "1RECV_F0")],
    }
    with pytest.raises(ValueError, match=r"CSV row 1 \(rank 1\), cell 1: Invalid action '1X0'"):
        parse_csv("0F0\n1F0,1X0\n")


def test_torchs_dualpipe_v_file_loads_as_plaits_order(tmp_path: Path) -> None:
    """torch's own DualPipeV order, dumped the way torch dumps it, reads back as
    plait's generated order (torch's overlapped pairs become consecutive F, B)."""
    from torch.distributed.pipelining import schedules as ts

    obj = object.__new__(ts.ScheduleDualPipeV)
    obj.pp_group_size, obj._n_microbatches, obj._num_stages = 4, 10, 8
    try:
        order = {r: obj._calculate_single_rank_operations(r) for r in range(4)}
    except (AttributeError, TypeError) as err:
        pytest.skip(f"torch's private DualPipeV helpers changed: {err}")
    with open(tmp_path / "dualpipev_4rank_10mb.csv", "w", newline="") as f:
        csv.writer(f).writerows(order[r] for r in range(4))
    assert load_csv(tmp_path / "dualpipev_4rank_10mb.csv") == generate("DualPipeV", 4, 8, 10)


# --- running loaded schedules and the forward-only schedule on ranks -------------------


def _v_stages(n_stages: int, model: nn.Module) -> tuple[list[PipelineStage], list[nn.Module]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = stages_of_rank(rank, world, n_stages, "v" if n_stages == 2 * world else "loop")
    modules = split_model(model, n_stages, stages=ids)
    return [
        PipelineStage(m, s, n_stages, "cpu") for m, s in zip(modules, ids, strict=True)
    ], modules


def _train_and_compare(schedule: Any, modules: list[nn.Module], model: nn.Module) -> None:
    """One step of ``schedule`` against the whole model on the whole batch (sum loss)."""
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    losses: list[torch.Tensor] = []
    out = schedule.step(x, target=y, losses=losses)
    reference = F.mse_loss(model(x), y, reduction="sum")
    reference.backward()
    if out is not None:
        torch.testing.assert_close(sum(losses), reference.detach(), atol=ATOL, rtol=RTOL)
    ref = dict(model.named_parameters())
    for mod in modules:
        for name, p in mod.named_parameters():
            torch.testing.assert_close(p.grad, ref[name].grad, atol=ATOL, rtol=RTOL)


def _csv_body(path: str, fmt: str, n_stages: int) -> str:
    model = layer_stack(n_stages)
    reference = copy.deepcopy(model)
    stages, modules = _v_stages(n_stages, model)
    loss = F.mse_loss
    schedule = _PipelineScheduleRuntime(
        stages, 4, loss_fn=lambda o, t: loss(o, t, reduction="sum"), scale_grads=False
    )
    schedule._load_csv(path, format=fmt)
    _train_and_compare(schedule, modules, reference)
    rows = [" ".join(map(str, schedule.pipeline_order_with_comms[r])) for r in range(2)]
    return "\n".join(rows)


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_loaded_schedule_runs_and_matches_one_process(fmt: str, tmp_path: Path) -> None:
    # A hand-made order no schedule class generates: rank 1 runs B before its next F, and
    # rank 0's backwards come in reverse microbatch order.
    compute = parse_csv("0F0,0F1,0F2,0F3,0B3,0B2,0B1,0B0\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n")
    lowered = add_communication(compute, 2, "loop", 2)
    dump_csv(compute if fmt == "compute_only" else lowered, tmp_path / "s.csv")
    orders = run_on_ranks(2, _csv_body, str(tmp_path / "s.csv"), fmt, 2)
    expected = "\n".join(" ".join(map(str, lowered[r])) for r in range(2))
    assert orders == [expected] * 2


def _dump_then_load_body(path: str) -> bool:
    """A DualPipeV schedule's order, dumped and loaded into the plain runtime: the same
    order, and the same training step."""
    model = layer_stack(4)
    reference = copy.deepcopy(model)
    stages, modules = _v_stages(4, model)
    dual = ScheduleDualPipeV(stages, 4, loss_fn=F.mse_loss)
    if dist.get_rank() == 0:
        dual._dump_csv(path, "compute_only")
    dist.barrier()
    runtime = _PipelineScheduleRuntime(
        stages, 4, loss_fn=lambda o, t: F.mse_loss(o, t, reduction="sum"), scale_grads=False
    )
    runtime._load_csv(path)
    _train_and_compare(runtime, modules, reference)
    return runtime.pipeline_order_with_comms == dual.pipeline_order_with_comms


def test_dumped_schedule_reloads_and_runs(tmp_path: Path) -> None:
    assert run_on_ranks(2, _dump_then_load_body, str(tmp_path / "dual.csv")) == [True, True]


def _load_errors_body(case: str, path: str) -> str:
    stages, _ = _v_stages(2, layer_stack(2))
    schedule = _PipelineScheduleRuntime(stages, 2, loss_fn=F.mse_loss)
    try:
        if case == "no_schedule":
            schedule.step(torch.randn(4, 6), target=torch.randn(4, 6))
        elif case == "unknown_format":
            schedule._load_csv(path, format="compute_and_more")  # type: ignore[arg-type]
        else:
            schedule._load_csv(path, format="compute_only")
    except (ValueError, RuntimeError, NotImplementedError) as err:
        return f"{type(err).__name__}: {err}"
    return ""


@pytest.mark.parametrize(
    ("case", "text", "match"),
    [
        ("no_schedule", "", "RuntimeError: PipelineScheduleRuntime has no schedule to run"),
        ("unknown_format", "", "NotImplementedError: format='compute_and_more'"),
        ("comms_as_compute", "0F0,0SEND_F0\n1F0\n", "found 0SEND_F0 at rank 0, position 1"),
        ("missing_rank", "0F0,0B0\n", "ScheduleError: .*stages \\[1\\]"),
        ("missing_backward", "0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", "0B1 is missing"),
        ("deadlock", "0B0,0F0,0F1,0B1\n1F0,1B0,1F1,1B1\n", "0B0 runs before 0F0"),
    ],
)
def test_loading_a_bad_schedule_raises_before_running(
    case: str, text: str, match: str, tmp_path: Path
) -> None:
    (tmp_path / "s.csv").write_text(text)
    messages = run_on_ranks(2, _load_errors_body, case, str(tmp_path / "s.csv"))
    for message in messages:  # every rank finds it on its own: no rank waits for another
        assert re.search(match, message), message
    assert issubclass(ScheduleError, ValueError)


def _forward_only_body(iters: int) -> list[Any]:
    """torch's test: feed the last stage's output back into the first, ``iters`` times."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = layer_stack(world)
    reference = copy.deepcopy(model)
    stage = PipelineStage(split_model(model, world, stages=[rank])[0], rank, world, "cpu")
    schedule = _ScheduleForwardOnly(stage, 2 * world, scale_grads=False)
    kinds = {a.kind.value for row in schedule.pipeline_order.values() for a in row}
    x = torch.randn(8, 6)
    x_ref = x.clone()
    out = None
    for _ in range(iters):
        if rank == 0:
            schedule.step(x)
            dist.recv(x, src=world - 1)
        elif rank == world - 1:
            out = schedule.step()
            dist.send(out, dst=0)
        else:
            schedule.step()
    errors = []
    for kwargs in ({"target": torch.randn(8, 6)}, {"losses": []}):
        try:
            schedule.step(x, **kwargs)
        except RuntimeError as err:
            errors.append(str(err))
    if out is not None:
        with torch.no_grad():
            for _ in range(iters):
                x_ref = reference(x_ref)
        torch.testing.assert_close(out, x_ref, atol=ATOL, rtol=RTOL)
        assert not out.requires_grad
    no_grads = all(p.grad is None for p in model.parameters())
    return [sorted(kinds), no_grads, len(errors), errors[0]]


@pytest.mark.parametrize("world", [2, 4])
def test_forward_only_schedule(world: int) -> None:
    for kinds, no_grads, n_errors, message in run_on_ranks(world, _forward_only_body, 3):
        assert kinds == ["F"] and no_grads and n_errors == 2
        assert "ForwardOnly does not support loss computation" in message


def _different_orders_body(paths: list[str]) -> str:
    """Each rank loads its own file: two valid orders, but not the same one."""
    stages, _ = _v_stages(2, layer_stack(2))
    schedule = _PipelineScheduleRuntime(stages, 2, loss_fn=F.mse_loss)
    schedule._load_csv(paths[dist.get_rank()])
    try:
        schedule.step(torch.randn(4, 6), target=torch.randn(4, 6))
    except spmd.DivergenceError as err:
        return str(err)
    return ""


def test_ranks_that_load_different_orders_fail_fast(tmp_path: Path) -> None:
    # GPipe's order in rank 0's file, 1F1B's in rank 1's: same class, microbatches and
    # stages, so only the order checksum tells them apart (mismatched orders can deadlock).
    paths = [str(tmp_path / "gpipe.csv"), str(tmp_path / "1f1b.csv")]
    dump_csv(generate("GPipe", 2, 2, 2), paths[0])
    dump_csv(generate("1F1B", 2, 2, 2), paths[1])
    messages = run_on_ranks(2, _different_orders_body, paths, timeout=60)
    for message in messages:
        assert "disagree on the schedule" in message
        assert re.search(
            r"rank 0 .*PipelineScheduleRuntime with 2 microbatches over 2 stages", message
        )
        assert "order checksum" in message and "same loaded order" in message


def _torch_actions_body() -> bool:
    """torch's own DualPipeV ``pipeline_order`` (its ``_Action`` objects, OVERLAP_F_B pairs
    included) handed to plait's runtime, as torch's tests hand it to theirs."""
    from torch.distributed.pipelining import schedules as ts

    obj = object.__new__(ts.ScheduleDualPipeV)
    obj.pp_group_size, obj._n_microbatches, obj._num_stages = 2, 4, 4
    torch_order = {r: obj._calculate_single_rank_operations(r) for r in range(2)}
    model = layer_stack(4)
    reference = copy.deepcopy(model)
    stages, modules = _v_stages(4, model)
    schedule = _PipelineScheduleRuntime(
        stages, 4, loss_fn=lambda o, t: F.mse_loss(o, t, reduction="sum"), scale_grads=False
    )
    schedule._prepare_schedule_with_comms(torch_order)
    _train_and_compare(schedule, modules, reference)
    return schedule.pipeline_order == generate("DualPipeV", 2, 4, 4)


def test_torchs_action_lists_run() -> None:
    assert run_on_ranks(2, _torch_actions_body) == [True, True]


@pytest.mark.parametrize(
    "name",
    [
        "ScheduleGPipe",
        "Schedule1F1B",
        "ScheduleInterleaved1F1B",
        "ScheduleLoopedBFS",
        "ScheduleInterleavedZeroBubble",
        "ScheduleZBVZeroBubble",
        "ScheduleDualPipeV",
        "PipelineScheduleSingle",
        "PipelineScheduleMulti",
    ],
)
def test_constructors_take_torchs_positional_order(name: str) -> None:
    """Code that passes torch's constructor arguments by position binds them the same."""
    import inspect

    import torch.distributed.pipelining.schedules as torch_schedules

    import plait.pipeline as plait_pipeline

    def positional(cls: type) -> list[str]:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return [p.name for p in params if p.kind in kinds]

    theirs = positional(getattr(torch_schedules, name))
    ours = positional(getattr(plait_pipeline, name))
    assert ours[: len(theirs)] == theirs, (ours, theirs)
