"""Pipelines that run: the split backward, stages, schedules, composition (microbatching is
in test_pipeline_microbatch.py, divergence between pipeline ranks in test_spmd.py).

The oracle is the whole model on the whole batch in one process: every schedule must give
the same per-step loss and the same gradients, to float32 rounding. With bf16 stages the
one-process reference does fully_shard's casts by hand.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from plait import checkpoint, fully_shard, replicate
from plait.fsdp import MixedPrecisionPolicy
from plait.pipeline import (
    SCHEDULE_CLASSES,
    SCHEDULES,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    SkippedLayer,
    schedule_spec,
    split_model,
    stage_layers,
    stages_of_rank,
)
from plait.pipeline.backward import backward_full, backward_input, backward_weight
from plait.train.model import GPT, GPTConfig, lm_loss

from collective_spy import spy_collectives
from harness import run_on_ranks
from models import layer_stack
from parity import (
    StageModules,
    check_parity,
    default_optimizer,
    default_step,
    full_value,
    local_slice,
    random_batches,
)

ATOL, RTOL = 1e-6, 1e-5


def layers_with_parameters(module: nn.Module) -> list[nn.Module]:
    """The children of a stage module that kept their layer (the others are SkippedLayer)."""
    return [c for c in module.children() if any(True for _ in c.parameters())]


def per_rank(name: str) -> int:
    """Stages per rank for ``name``: its fixed count, else 2 (looped schedules)."""
    return SCHEDULES[name].stages_per_rank or 2


def tiny_gpt(n_layer: int = 4) -> GPT:
    return GPT(GPTConfig(vocab_size=32, seq_len=16, n_layer=n_layer, n_head=2, d_model=16))


# --- the split backward (one process) ------------------------------------------------------


class _Tied(nn.Module):
    """Embedding and head share a weight; a LayerNorm and a weight-only output branch."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.norm = nn.LayerNorm(6)
        self.scale = nn.Parameter(torch.randn(6))

    def forward(self, ids: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.norm(self.emb(ids) + h) @ self.emb.weight.t()
        return x, self.scale * 2  # the second output depends on weights only


@pytest.mark.parametrize("model_name", ["stack", "tied"])
def test_input_then_weight_halves_equal_one_full_backward(model_name: str) -> None:
    def run(split: bool) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        model: nn.Module = layer_stack(3) if model_name == "stack" else _Tied()
        h = torch.randn(4, 6, requires_grad=True)
        outs = model(h) if model_name == "stack" else model(torch.tensor([1, 2, 3, 1]), h)
        roots = [outs] if model_name == "stack" else list(outs)
        grads = [torch.randn_like(r) for r in roots]
        if split:
            (dh,), work = backward_input(roots, grads, [h])
            assert all(p.grad is None for p in model.parameters())  # no weight work in I
            backward_weight(work)
        else:
            (dh,) = backward_full(roots, grads, [h])
        return [dh, *(p.grad for p in model.parameters())]

    full, split = run(split=False), run(split=True)
    for a, b in zip(full, split, strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# --- splitting a model (one process) -------------------------------------------------------


def test_split_model_keeps_names_and_composes() -> None:
    model = layer_stack(5)
    parts = split_model(model, 2)
    names = [list(dict(p.named_parameters())) for p in parts]
    assert names[0] == [f"{i}.0.{w}" for i in range(3) for w in ("weight", "bias")]
    assert sum(len(n) for n in names) == len(list(model.parameters()))
    x = torch.randn(3, 6)
    assert torch.equal(parts[1](parts[0](x)), model(x))
    merged = {k: v for p in parts for k, v in p.state_dict().items()}
    assert merged.keys() == model.state_dict().keys()


def test_split_gpt_by_blocks() -> None:
    gpt = tiny_gpt(3)
    plan = stage_layers(gpt, 2, layers="blocks")
    assert plan == [["tok_emb", "pos_emb", "blocks.0", "blocks.1"], ["blocks.2", "ln_f", "head"]]
    first, last = split_model(gpt, plan)
    assert not first.head and isinstance(last.blocks[0], SkippedLayer)
    ids = torch.randint(0, 32, (2, 5))
    torch.testing.assert_close(last(first(ids)), gpt(ids))
    with pytest.raises(ValueError, match="given to stages 0 and 1"):
        split_model(gpt, [["head"], ["head"]])
    with pytest.raises(ValueError, match="inside 'blocks'"):
        split_model(gpt, [["blocks"], ["blocks.1"]])


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * scale


class _Looping(nn.Module):
    """A model whose forward just runs its parts in order, with no guard for missing ones
    (issue 14 #4): embedding, layers in a ModuleList or (torchtitan-style) a ModuleDict's
    values, taking an extra argument, and a head."""

    def __init__(self, container: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        blocks = [_Block() for _ in range(4)]
        self.layers: nn.Module = (
            nn.ModuleList(blocks)
            if container == "list"
            else nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        )
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        x = self.emb(ids)
        layers = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for layer in layers:
            x = layer(x, scale)
        return self.head(x)


@pytest.mark.parametrize("container", ["list", "dict"])
@pytest.mark.parametrize("n_stages", [2, 4])
def test_split_model_runs_a_plain_looping_forward_on_every_stage(
    container: str, n_stages: int
) -> None:
    model = _Looping(container)
    parts = split_model(model, n_stages, layers="layers")
    ids = torch.randint(0, 10, (5, 3))
    x: torch.Tensor = ids
    for part in parts:
        x = part(x, scale=0.5)
    torch.testing.assert_close(x, model(ids, scale=0.5), atol=0, rtol=0)
    # names unchanged: the stages' state dicts are a partition of the model's
    keys = [k for p in parts for k in p.state_dict()]
    assert sorted(keys) == sorted(model.state_dict()) and len(keys) == len(set(keys))
    assert not parts[-1].emb and bool(parts[0].emb)  # skipped layers are falsy
    with pytest.raises(TypeError, match="'emb' runs on pipeline stage 0"):
        parts[1].emb(input=ids)


# --- schedules on ranks: parity with one process -------------------------------------------


def test_every_schedule_has_its_class() -> None:
    assert list(SCHEDULE_CLASSES) == list(SCHEDULES)
    assert all(cls.name == name for name, cls in SCHEDULE_CLASSES.items())


def _build_schedule(
    name: str,
    model: nn.Module,
    n_stages: int,
    n_microbatches: int,
    loss_fn: Callable[..., torch.Tensor] | None,
    *,
    group: dist.ProcessGroup | None = None,
    layers: str | None = None,
    wrap: Callable[[nn.Module], nn.Module] = lambda m: m,
    **schedule_kwargs: Any,
) -> tuple[Any, list[nn.Module]]:
    """This rank's stages of ``model`` and the schedule ``name`` over them."""
    style = schedule_spec(name).style
    ids = stages_of_rank(dist.get_rank(group), dist.get_world_size(group), n_stages, style)
    modules = [wrap(m) for m in split_model(model, n_stages, layers=layers, stages=ids)]
    stages = [
        PipelineStage(m, s, n_stages, "cpu", group=group) for m, s in zip(modules, ids, strict=True)
    ]
    # The single-stage classes take a stage, the looped ones this rank's list of stages.
    given: Any = stages[0] if SCHEDULES[name].stages_per_rank == 1 else stages
    return SCHEDULE_CLASSES[name](given, n_microbatches, loss_fn, **schedule_kwargs), modules


def _assert_grads_match(modules: list[nn.Module], reference: nn.Module, what: str) -> None:
    ref = {n: p.grad for n, p in reference.named_parameters()}
    for module in modules:
        for name, p in module.named_parameters():
            got, want = p.grad, ref[name]
            assert got is not None and want is not None, f"{what}: {name} has no gradient"
            got = full_value(got)
            if not torch.allclose(got, want, atol=ATOL, rtol=RTOL):
                diff = (got - want).abs().max().item()
                raise AssertionError(f"{what}: gradient of {name} differs by {diff:.3g}")


def _parity_body(name: str, batches: list[tuple[int, int]], m: int) -> int:
    """Run ``name`` for steps with (batch, seq) shapes; compare every loss and gradient."""
    n_stages = per_rank(name) * dist.get_world_size()
    model = layer_stack(n_stages)
    reference = copy.deepcopy(model)
    schedule, modules = _build_schedule(name, model, n_stages, m, F.mse_loss)
    gen = torch.Generator().manual_seed(1)
    for step, (b, t) in enumerate(batches):
        x, y = torch.randn(b, t, 6, generator=gen), torch.randn(b, t, 6, generator=gen)
        for mod in [*modules, reference]:
            mod.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        out = schedule.step(x, target=y, losses=losses)
        ref_out = reference(x)
        F.mse_loss(ref_out, y).backward()
        if out is not None:  # this rank holds the last stage
            assert len(losses) == m
            torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL)
            rows = torch.tensor([len(c) for c in torch.tensor_split(x, m)], dtype=torch.float32)
            mean = (torch.stack(losses) * rows).sum() / rows.sum()
            torch.testing.assert_close(mean, F.mse_loss(ref_out, y), atol=ATOL, rtol=RTOL)
        _assert_grads_match(modules, reference, f"{name} step {step}")
    return len(modules)


@pytest.mark.parametrize("name", list(SCHEDULE_CLASSES))
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_matches_one_process(name: str, world: int) -> None:
    m = max(4, SCHEDULES[name].min_microbatches(per_rank(name) * world))  # DualPipeV: 8 at 4
    counts = run_on_ranks(world, _parity_body, name, [(8, 3), (8, 3)], m)
    assert counts == [per_rank(name)] * world


@pytest.mark.parametrize("name", ["1F1B", "ZBVZeroBubble"])
def test_uneven_microbatches_and_changing_shapes(name: str) -> None:
    # 7 rows in 4 microbatches (2, 2, 2, 1); then the sequence length changes, then the batch.
    run_on_ranks(2, _parity_body, name, [(7, 3), (7, 5), (9, 2), (7, 3)], 4)


def _gpt_body(name: str) -> None:
    """A real model: token ids in, logits out, cross-entropy; two sequence lengths."""
    gpt = tiny_gpt(4)
    reference = copy.deepcopy(gpt)
    schedule, modules = _build_schedule(name, gpt, 4, 4, lm_loss, layers="blocks")
    gen = torch.Generator().manual_seed(2)
    for t in (8, 5):
        ids = torch.randint(0, 32, (4, t + 1), generator=gen)
        for mod in [*modules, reference]:
            mod.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        schedule.step(ids[:, :-1], target=ids[:, 1:], losses=losses)
        ref_loss = lm_loss(reference(ids[:, :-1]), ids[:, 1:])
        ref_loss.backward()
        if losses:
            torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach())
        _assert_grads_match(modules, reference, f"gpt {name} seq {t}")


@pytest.mark.parametrize("name", ["Interleaved1F1B", "InterleavedZeroBubble"])
def test_gpt_pipeline_matches_one_process(name: str) -> None:
    run_on_ranks(2, _gpt_body, name)


def _checkpoint_body(name: str) -> None:
    """Activation checkpointing inside stages, also under the split (I / W) backward."""
    model = layer_stack(8)
    reference = copy.deepcopy(model)

    def wrap(m: nn.Module) -> nn.Module:
        for layer in layers_with_parameters(m):
            checkpoint(layer)
        return m

    schedule, modules = _build_schedule(name, model, 4, 4, F.mse_loss, wrap=wrap)
    x, y = torch.randn(8, 3, 6), torch.randn(8, 3, 6)
    schedule.step(x, target=y)
    F.mse_loss(reference(x), y).backward()
    _assert_grads_match(modules, reference, f"checkpointed {name}")


@pytest.mark.parametrize("name", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_checkpointed_stages_match_one_process(name: str) -> None:
    run_on_ranks(2, _checkpoint_body, name)


def _eval_body() -> list[bool]:
    model = layer_stack(4)
    reference = copy.deepcopy(model)
    schedule, modules = _build_schedule("Interleaved1F1B", model, 4, 2, F.mse_loss)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    losses: list[torch.Tensor] = []
    out = schedule.eval(x, target=y, losses=losses)
    no_grads = all(p.grad is None for m in modules for p in m.parameters())
    if out is not None:
        torch.testing.assert_close(out, reference(x))
        assert len(losses) == 2 and not out.requires_grad
    schedule.step(x, target=y)  # training after eval re-exchanges requires_grad metadata
    trained = all(p.grad is not None for m in modules for p in m.parameters())
    out = schedule.eval(x)
    return [no_grads, trained, out is None or torch.allclose(out, reference(x))]


def test_eval_runs_forwards_only_and_alternates_with_training() -> None:
    assert run_on_ranks(2, _eval_body) == [[True, True, True]] * 2


# --- errors -------------------------------------------------------------------------------


def _error_body(case: str) -> str:
    # A stage failing in its first step waits up to PLAIT_FAULT_TIMEOUT for its peers to
    # reach the schedule's agreement, to tell them; here rank 1 never runs a schedule.
    previous = os.environ.get("PLAIT_FAULT_TIMEOUT")
    os.environ["PLAIT_FAULT_TIMEOUT"] = "1"
    try:
        return _raised_by(case)
    finally:
        if previous is None:
            del os.environ["PLAIT_FAULT_TIMEOUT"]
        else:
            os.environ["PLAIT_FAULT_TIMEOUT"] = previous


def _raised_by(case: str) -> str:
    rank = dist.get_rank()
    model = layer_stack(4)
    try:
        if case == "too_many_stages":
            stage = PipelineStage(split_model(model, 4, stages=[rank])[0], rank, 4, "cpu")
            Schedule1F1B(stage, 4, F.mse_loss)
        elif case == "wrong_placement":  # loop placement wants stages {0, 2} on rank 0
            ids = [2 * rank, 2 * rank + 1]
            mods = split_model(model, 4, stages=ids)
            ScheduleInterleaved1F1B(
                [PipelineStage(m, s, 4, "cpu") for m, s in zip(mods, ids, strict=True)], 2
            )
        elif case == "one_stage_to_multi":
            stage = PipelineStage(split_model(model, 2, stages=[rank])[0], rank, 2, "cpu")
            ScheduleLoopedBFS(stage, 2)  # type: ignore[arg-type]
        elif case == "stage_index":
            PipelineStage(model, 2, 2, "cpu")
        elif case == "small_batch" and rank == 0:  # raised before any communication
            schedule, _ = _build_schedule("GPipe", model, 2, 4, F.mse_loss)
            schedule.step(torch.randn(3, 6), target=torch.randn(3, 6))
        elif case == "no_target" and rank == 1:
            schedule, _ = _build_schedule("GPipe", model, 2, 2, F.mse_loss)
            schedule.step(torch.randn(4, 6))
        elif case == "non_tensor_output" and rank == 0:
            stage = PipelineStage(_Dict(), 0, 2, "cpu")
            ScheduleGPipe(stage, 2, F.mse_loss).step(torch.randn(4, 6))
        elif case == "declared_output" and rank == 0:
            mod = split_model(model, 2, stages=[0])[0]
            bad = torch.ones(2, 5)  # 5 features declared, 6 produced
            stage = PipelineStage(mod, 0, 2, "cpu", output_args=bad)
            ScheduleGPipe(stage, 2, F.mse_loss).step(torch.randn(4, 6))
    except (ValueError, TypeError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return ""


class _Dict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": x}


@pytest.mark.parametrize(
    ("case", "rank", "match"),
    [
        ("too_many_stages", 0, "1F1B holds 1 stage.*n_stages must be 2"),
        ("wrong_placement", 0, r"places stages \[0, 2\] on pipeline rank 0.*given stages \[0, 1\]"),
        ("one_stage_to_multi", 1, "takes a list of this rank's stages"),
        ("stage_index", 0, "stage_index 2 is out of range"),
        ("small_batch", 0, "positional argument 0 has 3 rows along dim 0, fewer than the 4"),
        ("no_target", 1, "needs target="),
        ("non_tensor_output", 0, "TypeError: stage 0, microbatch 0: .*tensor"),
        ("declared_output", 0, "RuntimeError: stage 0, microbatch 0: outputs"),
    ],
)
def test_errors_are_clear(case: str, rank: int, match: str) -> None:
    messages = run_on_ranks(2, _error_body, case)
    assert messages[rank], f"{case} raised nothing on rank {rank}"
    assert re.search(match, messages[rank]), messages[rank]


# --- composition with data parallelism on a (dp, pp) mesh ---------------------------------


def _shard(module: nn.Module, mesh: Any, **kwargs: Any) -> nn.Module:
    for layer in layers_with_parameters(module):
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(module, mesh=mesh, **kwargs)
    return module


def _dp_pp_mesh() -> DeviceMesh:
    """A fresh 2 x 2 ("dp", "pp") mesh (the harness clears DTensor's caches between bodies)."""
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))


def _reductions_per_step(stages: nn.Module) -> int:
    """All-reduces (one per ``replicate`` bucket) plus reduce-scatters (one per unit)."""
    count = 0
    for module in stages._parts:  # type: ignore[union-attr]
        for m in module.modules():
            rep, fsdp = replicate.state(m), fully_shard.state(m)
            count += len(rep.buckets) if rep is not None else 0
            count += 1 if fsdp is not None and fsdp.unit is not None else 0
    return count


def _dp_pp_parity(mesh: Any, n_stages: int, parallelize: Any, step: Any, *, steps: int) -> None:
    """``parallelize``'d on the (dp 2, pp) ``mesh`` and trained by ``step``, a stack of
    ``n_stages`` layers trains like one process over ``steps`` batches of 16 rows."""
    check_parity(
        lambda: layer_stack(n_stages),
        parallelize,
        random_batches(steps, 16, 6, 6),
        step=step,
        data_rank=mesh["dp"].get_local_rank(),
        data_world=2,
    )


def _pp_dp_body(name: str, kind: str) -> None:
    mesh = _dp_pp_mesh()
    pp_group, dp_mesh = mesh["pp"].get_group(), mesh["dp"]
    n_stages = 2 * per_rank(name)
    schedules: dict[int, Any] = {}

    def wrap(m: nn.Module) -> nn.Module:
        return replicate(m, mesh=dp_mesh) if kind == "replicate" else _shard(m, dp_mesh)

    def parallelize(model: nn.Module) -> nn.Module:
        schedule, modules = _build_schedule(
            name, model, n_stages, 4, F.mse_loss, group=pp_group, wrap=wrap
        )
        if kind == "fully_shard":
            assert all(isinstance(p, DTensor) for m in modules for p in m.parameters())
        stages = StageModules(modules)
        schedules[id(stages)] = schedule
        return stages

    def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any) -> torch.Tensor:
        if id(model) not in schedules:  # the reference
            return default_step(model, x, y, loss_fn)
        losses: list[torch.Tensor] = []
        with spy_collectives("all_reduce", "reduce_scatter_single") as calls:
            schedules[id(model)].step(x, target=y, losses=losses)
        # Gradients are reduced once per step (per bucket / unit), not per microbatch.
        reductions = len(calls["all_reduce"]) + len(calls["reduce_scatter_single"])
        assert reductions == _reductions_per_step(model), calls
        return torch.stack(losses).mean() if losses else torch.zeros(())

    _dp_pp_parity(mesh, n_stages, parallelize, step, steps=3)


@pytest.mark.parametrize("kind", ["replicate", "fully_shard"])
@pytest.mark.parametrize("name", ["1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_pipeline_composes_with_data_parallelism(name: str, kind: str) -> None:
    run_on_ranks(4, _pp_dp_body, name, kind)


def _fsdp_schedule_points_body() -> dict[str, Any]:
    """Record, per action, whether the stage's parameters are sharded; count collectives."""
    import plait.pipeline.runtime as runtime

    mesh = _dp_pp_mesh()
    model = layer_stack(4)
    schedule, (module,) = _build_schedule(
        "1F1B",
        model,
        2,
        4,
        F.mse_loss,
        group=mesh["pp"].get_group(),
        wrap=lambda m: _shard(m, mesh["dp"]),
    )
    trace: list[tuple[str, bool]] = []
    original = runtime._Runner.run

    def recording(self: Any, action: Any) -> None:
        original(self, action)
        if not action.kind.is_comm:  # only compute and FSDP actions change sharding
            sharded = all(isinstance(p, DTensor) for p in module.parameters())
            trace.append((str(action), sharded))

    runtime._Runner.run = recording  # type: ignore[method-assign]
    try:
        x, y = torch.randn(8, 6), torch.randn(8, 6)
        schedule.step(x, target=y)  # first step: lazy initialisation, metadata
        trace.clear()
        with spy_collectives("all_gather_single", "reduce_scatter_single") as calls:
            out = schedule.step(x, target=y)
    finally:
        runtime._Runner.run = original  # type: ignore[method-assign]
    evaluated = schedule.eval(x)
    assert (out is None) == (evaluated is None)
    if out is not None:  # eval runs the same forward (on sharded-then-gathered parameters)
        torch.testing.assert_close(evaluated, out)
    assert all(isinstance(p, DTensor) for p in module.parameters())
    # One unit per kept layer; the stage's root unit owns no parameters of its own.
    units = len(layers_with_parameters(module))
    return {
        "trace": trace,
        "gathers": len(calls["all_gather_single"]),
        "reduces": len(calls["reduce_scatter_single"]),
        "units": units,
    }


def test_fully_shard_follows_the_schedule_fsdp_actions() -> None:
    for result in run_on_ranks(4, _fsdp_schedule_points_body):
        trace = result["trace"]
        names = [a for a, _ in trace]
        first = names.index(next(a for a in names if a.endswith("UNSHARD")))
        last = max(i for i, a in enumerate(names) if a.endswith("RESHARD"))
        reduce_at = max(i for i, a in enumerate(names) if a.endswith("REDUCE_GRAD"))
        # UNSHARD issues the gathers and the first compute awaits them: unsharded from that
        # compute (inclusive) to RESHARD (exclusive).
        assert [s for _, s in trace] == [i <= first or i >= last for i in range(len(trace))]
        assert all(not n.endswith(("B0", "B1", "B2", "B3")) for n in names[reduce_at:])
        assert names.count(names[first]) == 1 and names[last].endswith("RESHARD")
        # One all-gather and one reduce-scatter per unit per step, not per microbatch.
        assert result["gathers"] == result["units"] == result["reduces"]


def _bounded_residency_body(name: str, bound: int) -> None:
    """``max_active_stages``: at most ``bound`` stages full at once, stages gathered again
    when they come back, and the same training as one process."""
    import plait.pipeline.runtime as runtime

    mesh = _dp_pp_mesh()
    n_stages = 4 * per_rank(name) if SCHEDULES[name].stages_per_rank is None else 4
    schedules: dict[int, Any] = {}
    modules_of: dict[int, list[nn.Module]] = {}

    def parallelize(model: nn.Module) -> nn.Module:
        schedule, modules = _build_schedule(
            name,
            model,
            n_stages,
            4,
            F.mse_loss,
            group=mesh["pp"].get_group(),
            wrap=lambda m: _shard(m, mesh["dp"]),
            max_active_stages=bound,
        )
        stages = StageModules(modules)
        schedules[id(stages)], modules_of[id(stages)] = schedule, modules
        return stages

    most = 0
    original = runtime._Runner.run

    def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any) -> torch.Tensor:
        nonlocal most
        if id(model) not in schedules:  # the reference
            return default_step(model, x, y, loss_fn)
        modules = modules_of[id(model)]

        def recording(self: Any, action: Any) -> None:
            original(self, action)
            nonlocal most
            full = [m for m in modules if not any(isinstance(p, DTensor) for p in m.parameters())]
            most = max(most, len(full))

        losses: list[torch.Tensor] = []
        runtime._Runner.run = recording  # type: ignore[method-assign]
        try:
            with spy_collectives("all_gather_single", "reduce_scatter_single") as calls:
                schedules[id(model)].step(x, target=y, losses=losses)
        finally:
            runtime._Runner.run = original  # type: ignore[method-assign]
        units = sum(len(layers_with_parameters(m)) for m in modules)
        # Gathered again as stages come back into the window; reduced once per unit.
        assert len(calls["all_gather_single"]) > units
        assert len(calls["reduce_scatter_single"]) == units
        return torch.stack(losses).mean() if losses else torch.zeros(())

    _dp_pp_parity(mesh, n_stages, parallelize, step, steps=2)
    assert most == bound, f"{most} stages were full at once"  # never more, and one to compute
    with pytest.raises(ValueError, match="max_active_stages must be >= 1"):
        _build_schedule(
            name,
            layer_stack(n_stages),
            n_stages,
            4,
            F.mse_loss,
            group=mesh["pp"].get_group(),
            max_active_stages=0,
        )


@pytest.mark.parametrize(("name", "bound"), [("Interleaved1F1B", 1), ("ZBVZeroBubble", 1)])
def test_bounded_stage_residency_trains_as_one_process(name: str, bound: int) -> None:
    run_on_ranks(4, _bounded_residency_body, name, bound)


# --- mixed precision: bf16 fully_shard stages ----------------------------------------------

BF16 = torch.bfloat16


def _float_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


def _reference_bf16(
    master: nn.Module, x: torch.Tensor, y: torch.Tensor, microbatches: int, dp: int
) -> tuple[dict[str, torch.Tensor], list[list[torch.Tensor]]]:
    """What the pipeline over bf16 fully_shard stages computes, by hand, in one process:
    per dp rank, a bf16 copy of the fp32 master runs each microbatch of its slice, the
    backward seeded with the microbatch's share of rows; its bf16 gradients are cast to
    fp32 and summed; each rank's sum is divided by the dp world and the ranks' parts added.
    Returns the gradients and each dp rank's per-microbatch losses."""
    grads: dict[str, torch.Tensor] = {}
    losses = []
    for rank in range(dp):
        low = copy.deepcopy(master).to(BF16)
        xs, ys = local_slice(x, rank, dp), local_slice(y, rank, dp)
        summed: dict[str, torch.Tensor] = {}
        rank_losses = []
        chunks = zip(xs.tensor_split(microbatches), ys.tensor_split(microbatches), strict=True)
        for xc, yc in chunks:
            loss = _float_mse(low(xc.to(BF16)), yc)
            low.zero_grad(set_to_none=True)
            (loss * (len(xc) / len(xs))).backward()
            rank_losses.append(loss.detach())
            for name, p in low.named_parameters():
                assert p.grad is not None and p.grad.dtype == BF16
                g = p.grad.float()
                summed[name] = g if name not in summed else summed[name] + g
        for name, g in summed.items():
            part = g / dp
            grads[name] = part if name not in grads else grads[name] + part
        losses.append(rank_losses)
    return grads, losses


def _mixed_precision_body(name: str) -> None:
    """bf16 parameters, fp32 reduction, on a 2 x 2 (dp, pp) mesh, against hand-made casts."""
    mesh = _dp_pp_mesh()
    dp_rank = mesh["dp"].get_local_rank()
    n_stages, m = 2 * per_rank(name), 2
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    master = layer_stack(n_stages)
    schedule, modules = _build_schedule(
        name,
        copy.deepcopy(master),
        n_stages,
        m,
        _float_mse,
        group=mesh["pp"].get_group(),
        wrap=lambda mod: _shard(mod, mesh["dp"], mp_policy=policy),
    )
    params = [p for mod in modules for p in mod.parameters()]
    opt, ref_opt = default_optimizer(params), default_optimizer(master.parameters())
    for step, (x, y) in enumerate(random_batches(3, 8, 6, 6)):
        want, ref_losses = _reference_bf16(master, x, y, m, dp=2)
        losses: list[torch.Tensor] = []
        dp_x, dp_y = local_slice(x, dp_rank, 2), local_slice(y, dp_rank, 2)
        schedule.step(dp_x, target=dp_y, losses=losses)
        if losses:  # the last stage's ranks: the same losses, microbatch by microbatch
            torch.testing.assert_close(losses, ref_losses[dp_rank], atol=0, rtol=0)
        for mod in modules:
            for pname, p in mod.named_parameters():
                assert p.dtype == torch.float32 and p.grad is not None, pname
                assert p.grad.dtype == torch.float32, pname
                torch.testing.assert_close(
                    full_value(p.grad), want[pname], atol=1e-6, rtol=1e-5, msg=f"{step} {pname}"
                )
        for pname, p in master.named_parameters():
            p.grad = want[pname]
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for mod in modules:
        for pname, p in mod.named_parameters():
            got, ref = full_value(p.detach()), master.get_parameter(pname).detach()
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4, msg=pname)


@pytest.mark.parametrize("name", ["1F1B", "ZBVZeroBubble"])
def test_bf16_fully_shard_stages_accumulate_in_the_reduce_dtype(name: str) -> None:
    """Seed 002: pipeline + fully_shard with a bf16 MixedPrecisionPolicy. Gradients of the
    microbatches are summed in fp32, also those that ZBV's split backward (W) adds."""
    run_on_ranks(4, _mixed_precision_body, name)
