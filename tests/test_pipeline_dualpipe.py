"""DualPipeV as data: its order, its constraints, the validator and simulator on it, and
runs at 2 and 4 ranks against one process (the oracle: the whole model on the whole batch).

torch's ``ScheduleDualPipeV`` wraps the steady state's forward / backward pairs in one
``OVERLAP_F_B`` action; plait keeps them as consecutive F and B actions (torch's runtime
runs the pair one after the other as well), so the orders compare after expanding torch's
pairs (tests/test_pipeline_schedules.py compares them over many shapes).
"""

from __future__ import annotations

import copy
import itertools
import re

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from plait.pipeline import (
    SCHEDULES,
    Action,
    ActionKind,
    PipelineStage,
    ScheduleDualPipeV,
    ScheduleError,
    dualpipe_v,
    generate,
    parse_action,
    simulate,
    split_model,
    stages_of_rank,
    validate,
)

from harness import run_on_ranks
from models import dualpipe_v_stages, layer_stack

K = ActionKind
ATOL, RTOL = 1e-6, 1e-5


def acts(text: str) -> list[Action]:
    return [parse_action(t) for t in text.split()]


# --- the order (pure) ------------------------------------------------------------------


def test_known_order_two_ranks() -> None:
    # rank 0 holds stages 0 and 3, rank 1 stages 1 and 2. Steady state: (F, B) pairs of
    # the two local stages; cool-down: the last backwards split into I and W.
    schedule = dualpipe_v(2, 5)
    assert schedule[0] == acts(
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 0F4 3B2 3F3 0B1 3B3 3F4 0B2 3B4 "
        "0I3 0W3 0I4 0W4"
    )
    assert schedule[1] == acts(
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 1F4 2B2 2F4 1B2 2B3 1B3 2I4 1I4 2W4 1W4"
    )


@pytest.mark.parametrize(("n_ranks", "m"), [(2, 4), (2, 9), (4, 8), (4, 13), (6, 12)])
def test_steady_state_pairs_a_forward_with_the_other_stages_backward(n_ranks: int, m: int) -> None:
    schedule = dualpipe_v(n_ranks, m)
    for rank, actions in schedule.items():
        local = {rank, 2 * n_ranks - 1 - rank}
        pairs = [
            (f, b)
            for f, b in itertools.pairwise(actions)
            if f.kind is K.FORWARD and b.kind is K.FULL_BACKWARD
        ]
        # m - 2p + 1 + r rounds of two pairs, then p - 1 - r more: the bulk of the work.
        assert len(pairs) >= 2 * (m - 2 * n_ranks + 1 + rank)
        assert all({f.stage, b.stage} == local for f, b in pairs)
        # Every microbatch's backward of a stage is a B, or an I whose W follows later.
        for stage in local:
            for i in range(m):
                b, ii, w = (
                    Action(stage, kind, i)
                    for kind in (K.FULL_BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT)
                )
                assert (b in actions) != (ii in actions)
                if ii in actions:
                    assert actions.index(ii) < actions.index(w)


@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4, 5])
def test_validates_with_communication_and_fsdp(n_ranks: int) -> None:
    n_stages = 2 * n_ranks
    for m in range(n_stages, n_stages + 6):
        for comm, fsdp in [(False, False), (True, False), (True, True)]:
            schedule = generate("DualPipeV", n_ranks, n_stages, m, communication=comm, fsdp=fsdp)
            validate(schedule, n_ranks, n_stages, m, style="v")


def test_rejects_what_torch_rejects() -> None:
    # torch: ValueError unless 2 stages per rank and n_microbatches >= num_stages.
    with pytest.raises(ValueError, match="use at least 8 microbatches"):
        dualpipe_v(4, 7)
    with pytest.raises(ValueError, match="use n_microbatches >= 4"):
        generate("DualPipeV", 2, 4, 3)
    with pytest.raises(ValueError, match="2 stage\\(s\\) per rank"):
        generate("DualPipeV", 2, 6, 8)
    assert SCHEDULES["DualPipeV"].style == "v"
    assert SCHEDULES["DualPipeV"].min_microbatches(8) == 8


def test_validator_names_a_broken_pair() -> None:
    schedule = dualpipe_v(2, 4)
    row = schedule[1]
    # Move rank 1's first B (2B0) ahead of the forward it differentiates.
    b = row.index(Action(2, K.FULL_BACKWARD, 0))
    row.insert(row.index(Action(2, K.FORWARD, 0)), row.pop(b))
    with pytest.raises(ScheduleError, match="rank 1: 2B0 runs before 2F0, its own forward"):
        validate(schedule, 2, 4, 4, style="v")


def test_simulator_bubble_and_memory() -> None:
    # F = 1, B = 2 (I = W = 1): DualPipeV idles less than interleaved 1F1B over the same
    # 2 stages per rank, and holds at most 2 * p + 1 half-size activations per rank
    # (DeepSeek-V3's table: PP + 1 chunks of the model's size).
    for p in (2, 4, 8):
        for m in (2 * p, 3 * p, 4 * p):
            dual = simulate(generate("DualPipeV", p, 2 * p, m))
            looped = simulate(generate("Interleaved1F1B", p, 2 * p, m))
            assert dual.bubble_fraction < looped.bubble_fraction, (p, m)
            assert max(dual.peak_activations.values()) <= 2 * p + 1, (p, m)
    # Lowering adds no time when communication is free, and the text chart prints pairs.
    plain = simulate(generate("DualPipeV", 4, 8, 8))
    lowered = simulate(generate("DualPipeV", 4, 8, 8, communication=True, fsdp=True))
    assert lowered.makespan == plain.makespan


# --- runs on ranks: parity with one process -------------------------------------------


def _dualpipe_body(m: int, shapes: list[tuple[int, int]]) -> list[int]:
    """Train a few steps with DualPipeV; compare outputs, losses and gradients with one
    process. Rank 0 holds the first and the last stage, so it both feeds and scores."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = layer_stack(2 * world)
    reference = copy.deepcopy(model)
    schedule, modules, ids = dualpipe_v_stages(model, m, rank, world)
    gen = torch.Generator().manual_seed(3)
    for b, t in shapes:
        x, y = torch.randn(b, t, 6, generator=gen), torch.randn(b, t, 6, generator=gen)
        for mod in [*modules, reference]:
            mod.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        out = schedule.step(x, target=y, losses=losses)
        ref_out = reference(x)
        F.mse_loss(ref_out, y).backward()
        assert (out is not None) == (rank == 0)
        if out is not None:
            torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL)
            rows = torch.tensor([len(c) for c in torch.tensor_split(x, m)], dtype=torch.float32)
            mean = (torch.stack(losses) * rows).sum() / rows.sum()
            torch.testing.assert_close(mean, F.mse_loss(ref_out, y), atol=ATOL, rtol=RTOL)
        ref = dict(reference.named_parameters())
        for mod in modules:
            for name, p in mod.named_parameters():
                assert p.grad is not None, name
                torch.testing.assert_close(p.grad, ref[name].grad, atol=ATOL, rtol=RTOL)
    return ids


@pytest.mark.parametrize(("world", "m"), [(2, 4), (2, 7), (4, 8)])
def test_dualpipe_v_matches_one_process(world: int, m: int) -> None:
    placed = run_on_ranks(world, _dualpipe_body, m, [(8, 3), (9, 2)])
    assert placed == [[r, 2 * world - 1 - r] for r in range(world)]


def _errors_body(case: str) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = layer_stack(4)
    try:
        if case == "few_microbatches":
            ids = stages_of_rank(rank, world, 4, "v")
            mods = split_model(model, 4, stages=ids)
            ScheduleDualPipeV(
                [PipelineStage(m, s, 4, "cpu") for m, s in zip(mods, ids, strict=True)], 3
            )
        elif case == "one_stage_per_rank":
            mod = split_model(model, 2, stages=[rank])[0]
            ScheduleDualPipeV([PipelineStage(mod, rank, 2, "cpu")], 4)
        elif case == "looped_placement":  # stages {r, r + 2}, not the V {r, 3 - r}
            ids = [rank, rank + 2]
            mods = split_model(model, 4, stages=ids)
            ScheduleDualPipeV(
                [PipelineStage(m, s, 4, "cpu") for m, s in zip(mods, ids, strict=True)], 4
            )
    except ValueError as err:
        return f"ValueError: {err}"
    return ""


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("few_microbatches", "as many microbatches as stages.*n_microbatches >= 4"),
        ("one_stage_per_rank", "2 stage\\(s\\) per rank, so n_stages must be 4"),
        ("looped_placement", r"places stages \[0, 3\] on pipeline rank 0 \('v' placement\)"),
    ],
)
def test_bad_input_raises_value_error_as_torch(case: str, match: str) -> None:
    messages = run_on_ranks(2, _errors_body, case)
    assert messages[0].startswith("ValueError"), messages
    assert re.search(match, messages[0]), messages[0]


def _beside_torch_body(m: int) -> bool:
    """plait's and torch's DualPipeV on copies of one model: the same losses and gradients
    (returns whether they are bitwise equal, which the same order of operations allows)."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import ScheduleDualPipeV as TorchDualPipeV

    world, rank = dist.get_world_size(), dist.get_rank()
    n_stages = 2 * world
    model = layer_stack(n_stages)
    ids = stages_of_rank(rank, world, n_stages, "v")
    ours = split_model(model, n_stages, stages=ids)
    theirs = [copy.deepcopy(mod) for mod in ours]
    loss_fn = F.mse_loss
    plait_schedule = ScheduleDualPipeV(
        [PipelineStage(mod, s, n_stages, "cpu") for mod, s in zip(ours, ids, strict=True)],
        m,
        loss_fn=loss_fn,
    )
    torch_schedule = TorchDualPipeV(
        [
            TorchStage(mod, s, n_stages, torch.device("cpu"))
            for mod, s in zip(theirs, ids, strict=True)
        ],
        m,
        loss_fn=loss_fn,
    )
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    ours_losses: list[torch.Tensor] = []
    theirs_losses: list[torch.Tensor] = []
    plait_schedule.step(x, target=y, losses=ours_losses)
    torch_schedule.step(x, target=y, losses=theirs_losses)
    if rank == 0:  # the last stage lives on rank 0 in the V
        torch.testing.assert_close(torch.stack(ours_losses), torch.stack(theirs_losses))
    bitwise = True
    for a, b in zip(ours, theirs, strict=True):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=RTOL, msg=name)
            bitwise = bitwise and torch.equal(p.grad, q.grad)
    return bitwise


def test_dualpipe_v_matches_torch_implementation() -> None:
    # 4 microbatches: scaling by 1/4 is exact, so plait's scaling of each microbatch's loss
    # and torch's division of the summed gradients agree to the last bit.
    results = run_on_ranks(2, _beside_torch_body, 4)
    assert results == [True, True], "plait and torch agree to rounding but not bitwise"
