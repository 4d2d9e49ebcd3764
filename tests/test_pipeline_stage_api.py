"""torch's ``PipelineStage`` / schedule surface on plait: what ``step`` / ``eval`` take, the
constructor arguments torch 2.13 and torchtitan pass, eval and inference mode, many steps.

In spirit of torch's test_schedule_multiproc.py (test_return_output, loss kwargs,
test_eval_inference_mode, test_multi_iter, test_zero_bubble_with_model_kwargs) and
test_stage.py (test_custom_dw_errors); issues 14 #3, 18 #3 / #5, 19 #2 / #6. The oracle is
the whole model on the whole batch in one process.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from plait.pipeline import (
    SCHEDULE_CLASSES,
    SCHEDULES,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    SplitPoint,
    pipeline,
    schedule_spec,
    split_model,
    stages_of_rank,
)

from harness import run_on_ranks

D = 6


class _Masked(nn.Module):
    """A layer that takes a per-row mask keyword (every stage gets the keywords)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        return y if mask is None else y * mask


def _stack(n: int) -> nn.Sequential:
    return nn.Sequential(*(_Masked() for _ in range(n)))


class _MaskedStack(nn.Module):
    """Layers looped with the mask passed on (an nn.Sequential cannot pass keywords)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Masked() for _ in range(n))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask=mask)
        return x


def _schedule(
    name: str,
    model: nn.Module,
    m: int,
    loss_fn: Any,
    layers: str | None = None,
    *,
    traced: bool = False,
    **options: Any,
) -> tuple[Any, list[nn.Module]]:
    """This rank's stages of ``model`` under schedule ``name``: cut by split_model, or, with
    ``traced``, by the tracing frontend (one stage per layer of an nn.Sequential)."""
    world = dist.get_world_size()
    if traced:
        assert isinstance(model, nn.Sequential) and SCHEDULES[name].stages_per_rank == 1
        spec = {str(i): SplitPoint.BEGINNING for i in range(1, world)}
        pipe = pipeline(model, (torch.randn(2, D),), split_spec=spec)
        stage = pipe.build_stage(dist.get_rank(), "cpu")
        return SCHEDULE_CLASSES[name](stage, m, loss_fn, **options), [stage.submod]
    n_stages = (SCHEDULES[name].stages_per_rank or 2) * world
    ids = stages_of_rank(dist.get_rank(), world, n_stages, schedule_spec(name).style)
    modules = split_model(model, n_stages, layers=layers, stages=ids)
    stages = [PipelineStage(mod, s, n_stages, "cpu") for mod, s in zip(modules, ids, strict=True)]
    given: Any = stages[0] if SCHEDULES[name].stages_per_rank == 1 else stages
    return SCHEDULE_CLASSES[name](given, m, loss_fn, **options), modules


def _weighted_mse(out: torch.Tensor, target: torch.Tensor, *, weight: float) -> torch.Tensor:
    return F.mse_loss(out, target) * weight


# --- step's arguments ------------------------------------------------------------------------


def _step_arguments_body(name: str) -> list[str]:
    """return_outputs=False, loss_kwargs, and the microbatch-list form against the whole
    model; returns what each check saw, for the driver to compare."""
    world = dist.get_world_size()
    n_layers = (SCHEDULES[name].stages_per_rank or 2) * world
    model = _MaskedStack(n_layers)
    reference = copy.deepcopy(model)
    schedule, modules = _schedule(name, model, 4, _weighted_mse, layers="layers")
    last = any(m.layers[-1] for m in modules)  # this rank holds the last stage
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, D, generator=gen), torch.randn(8, D, generator=gen)
    mask = (torch.rand(8, 1, generator=gen) > 0.3).float()
    seen = []

    # 1. Whole batch, loss_kwargs to the loss, no outputs returned.
    losses: list[torch.Tensor] = []
    out = schedule.step(
        x, target=y, losses=losses, return_outputs=False, loss_kwargs={"weight": 2.0}, mask=mask
    )
    ref_loss = _weighted_mse(reference(x, mask=mask), y, weight=2.0)
    ref_loss.backward()
    seen.append(f"return_outputs=False -> {out!r}")
    if last:
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach())
    _assert_grads(modules, reference)

    # 2. The caller's microbatches (one mask each), torchtitan's call.
    for mod in [*modules, reference]:
        mod.zero_grad(set_to_none=True)
    xs, ys, masks = x.chunk(4), y.chunk(4), mask.chunk(4)
    first = any(m.layers[0] for m in modules)
    losses = []
    out = schedule.step(
        arg_mbs=[(t,) for t in xs] if first else None,
        kwarg_mbs=[{"mask": k} for k in masks],
        target_mbs=list(ys) if last else None,
        losses=losses,
        loss_kwargs={"weight": 0.5},
        return_outputs=True,
    )
    ref_out = reference(x, mask=mask)
    _weighted_mse(ref_out, y, weight=0.5).backward()
    if last:
        torch.testing.assert_close(out, ref_out.detach())
        assert len(losses) == 4
    _assert_grads(modules, reference)

    # 3. eval with microbatch lists: forwards only, the losses all the same.
    for mod in modules:
        mod.zero_grad(set_to_none=True)
    losses = []
    out = schedule.eval(
        arg_mbs=[(t,) for t in xs] if first else None,
        kwarg_mbs=[{"mask": k} for k in masks],
        target_mbs=list(ys) if last else None,
        losses=losses,
        loss_kwargs={"weight": 1.0},
    )
    assert all(p.grad is None for mod in modules for p in mod.parameters())
    if last:
        torch.testing.assert_close(out, ref_out.detach())
        assert len(losses) == 4

    # 4. Mixing the two forms, or a list of the wrong length, is refused by name.
    for call, match in [
        (lambda: schedule.step(x, arg_mbs=[(t,) for t in xs]), "not both"),
        (lambda: schedule.step(kwarg_mbs=[{}] * 3), "kwarg_mbs has 3 entries"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    return seen


def _assert_grads(modules: list[nn.Module], reference: nn.Module) -> None:
    ref = dict(reference.named_parameters())
    for mod in modules:
        for name, p in mod.named_parameters():
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, ref[name].grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["1F1B", "InterleavedZeroBubble"])
def test_step_takes_return_outputs_loss_kwargs_and_microbatch_lists(name: str) -> None:
    for seen in run_on_ranks(2, _step_arguments_body, name):
        assert seen == ["return_outputs=False -> None"]


# --- eval, inference mode, grad mode -------------------------------------------------------


def _eval_modes_body(name: str, traced: bool) -> list[bool]:
    world = dist.get_world_size()
    model = _stack((SCHEDULES[name].stages_per_rank or 2) * world)
    reference = copy.deepcopy(model).eval()
    schedule, modules = _schedule(name, model, 4, F.mse_loss, traced=traced, scale_grads=False)
    for mod in modules:
        mod.eval()
    x, y = torch.randn(8, D), torch.randn(8, D)
    results = []
    for mode in (torch.inference_mode, torch.no_grad):
        losses: list[torch.Tensor] = []
        with mode():
            out = schedule.eval(x, target=y, losses=losses)
        results.append(all(p.grad is None for mod in modules for p in mod.parameters()))
        if out is not None:
            with torch.no_grad():
                torch.testing.assert_close(out, reference(x))
            results.append(len(losses) == 4)
    for mode in (torch.inference_mode, torch.no_grad):  # a training step cannot run there
        with mode(), pytest.raises(RuntimeError, match="call schedule.eval"):
            schedule.step(x, target=y)
    return results


@pytest.mark.parametrize(("name", "traced"), [("GPipe", True), ("Interleaved1F1B", False)])
def test_eval_under_inference_mode_and_no_grad_computes_no_gradients(
    name: str, traced: bool
) -> None:
    for result in run_on_ranks(2, _eval_modes_body, name, traced):
        assert result and all(result), result


def _multi_iter_body(name: str, traced: bool) -> None:
    """20 steps (torch's test_multi_iter), alternating with eval: the same as the model."""
    model = _stack(dist.get_world_size())
    reference = copy.deepcopy(model)
    schedule, modules = _schedule(name, model, 4, F.mse_loss, traced=traced, scale_grads=False)
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7)
    for step in range(20):
        x, y = torch.randn(8, D, generator=gen), torch.randn(8, D, generator=gen)
        opt.zero_grad()
        ref_opt.zero_grad()
        schedule.step(x, target=y)
        sum(
            F.mse_loss(o, t) for o, t in zip(reference(x).chunk(4), y.chunk(4), strict=True)
        ).backward()
        opt.step()
        ref_opt.step()
        if step % 5 == 4:
            out = schedule.eval(x)
            if out is not None:
                with torch.no_grad():
                    torch.testing.assert_close(out, reference(x), atol=1e-5, rtol=1e-5)
    ref = dict(reference.named_parameters())
    for mod in modules:
        for pname, p in mod.named_parameters():
            torch.testing.assert_close(p, ref[pname], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("name", "traced"), [("GPipe", True), ("1F1B", False)])
def test_many_iterations_match_one_process(name: str, traced: bool) -> None:
    run_on_ranks(2, _multi_iter_body, name, traced)


# --- keyword arguments of other batch sizes -----------------------------------------------


class _UnusedKwarg(nn.Module):
    """torch's MultiMLPKwargs: every layer takes a keyword it does not use."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, unused_kwarg: torch.Tensor | None = None) -> torch.Tensor:
        return torch.relu(self.lin(x))


def _kwargs_other_batch_body(name: str) -> None:
    model = nn.ModuleList(_UnusedKwarg() for _ in range(4))
    schedule, modules = _schedule(name, _Chain(model), 4, F.mse_loss, layers="layers")
    reference = _Chain(copy.deepcopy(model))
    x, y = torch.randn(16, D), torch.randn(16, D)
    unused = torch.ones(1).unsqueeze(0).expand(4, -1)  # 4 rows for 4 microbatches, x has 16
    for mod in [*modules, reference]:
        mod.zero_grad(set_to_none=True)
    schedule.step(x, target=y, unused_kwarg=unused)
    F.mse_loss(reference(x), y).backward()
    _assert_grads(modules, reference)


class _Chain(nn.Module):
    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor, unused_kwarg: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, unused_kwarg=unused_kwarg)
        return x


@pytest.mark.parametrize("name", ["Interleaved1F1B", "InterleavedZeroBubble"])
def test_keyword_arguments_of_another_batch_size_are_cut_on_their_own(name: str) -> None:
    run_on_ranks(2, _kwargs_other_batch_body, name)


# --- torch's constructor arguments ---------------------------------------------------------


def _constructor_body() -> list[str]:
    rank = dist.get_rank()
    (module,) = split_model(_stack(2), 2, stages=[rank])
    example = torch.randn(2, D)
    meshes: list[Any] = []
    # torch 2.13's positional order, then torchtitan's get_mesh keyword.
    stage = PipelineStage(
        module,
        rank,
        2,
        torch.device("cpu"),
        (example,),
        (example,),
        None,
        None,
        dist.group.WORLD,
        None,
        get_mesh=meshes.append,
    )
    assert stage.get_mesh is not None and stage.group is dist.group.WORLD
    seen = []
    for cls in (ScheduleGPipe, Schedule1F1B):
        schedule = cls(
            stage,
            2,
            F.mse_loss,
            None,
            None,
            None,
            False,
            backward_requires_autograd=False,
            defer_pp_recv=True,
            use_full_backward=None,
        )
        with torch.no_grad():  # allowed: backward_requires_autograd=False
            out = schedule.step(*(() if rank else (torch.randn(4, D),)), target=torch.randn(4, D))
        seen.append(
            f"{cls.__name__}: trained={all(p.grad is not None for p in module.parameters())}"
        )
        module.zero_grad(set_to_none=True)
        assert (out is None) == (rank == 0)
    stage.clear_runtime_states()
    # W before its I: torch's AssertionError naming backward_one_chunk.
    custom = PipelineStage(module, rank, 2, "cpu", dw_builder=lambda: lambda: None)
    with pytest.raises(AssertionError, match="backward_one_chunk"):
        custom.backward_weight_one_chunk(bwd_chunk_id=0)
    return seen


def test_stage_and_schedules_take_torchs_arguments() -> None:
    for seen in run_on_ranks(2, _constructor_body):
        assert seen == ["ScheduleGPipe: trained=True", "Schedule1F1B: trained=True"]


# --- a failing rank ends the step on every rank ---------------------------------------------


class _FailsOn(nn.Module):
    """A layer that raises on the microbatch with this many rows (to fail mid-step)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.lin, self.rows = nn.Linear(D, D), rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == self.rows:
            raise ValueError(f"bad microbatch of {self.rows} rows")
        return self.lin(x)


def _failing_rank_body(case: str, name: str) -> tuple[str, float]:
    """Every rank steps; one fails mid-step (``case``: in its model or its loss); each
    returns its error and how long it took."""
    world = dist.get_world_size()
    layers = [nn.Linear(D, D) for _ in range((SCHEDULES[name].stages_per_rank or 2) * world)]
    if case == "model":  # the last stage fails on the last (smaller) microbatch
        layers[-1] = _FailsOn(rows=1)
    schedule, _ = _schedule(name, nn.Sequential(*layers), 4, F.mse_loss)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if case == "loss":
            raise KeyError("the loss needs a mask")
        return F.mse_loss(out, target)

    schedule._loss_fn = loss
    x, y = torch.randn(7, D), torch.randn(7, D)  # microbatches of 2, 2, 2, 1 rows
    start = time.monotonic()
    try:
        schedule.step(x, target=y)
    except Exception as error:
        return f"{type(error).__name__}: {error}", time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.parametrize(
    ("case", "name", "world", "failing", "cause"),
    [
        ("loss", "Interleaved1F1B", 2, 1, "KeyError: 'the loss needs a mask'"),
        ("model", "1F1B", 4, 3, "ValueError: bad microbatch of 1 rows"),
    ],
)
def test_a_failing_rank_ends_the_step_on_every_rank_with_the_cause(
    case: str, name: str, world: int, failing: int, cause: str
) -> None:
    results = run_on_ranks(
        world, _failing_rank_body, case, name, timeout=60, leaves_group_broken=True
    )
    for rank, (message, seconds) in enumerate(results):
        assert cause in message, (rank, message)
        if rank != failing:
            assert message.startswith("PipelineAbort: plait: the pipeline step stopped because")
            assert f"pipeline rank {failing} (global rank {failing}) failed" in message
        assert seconds < 20, (rank, seconds)  # at once, not after a deadline
