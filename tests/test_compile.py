"""``torch.compile`` around plait's APIs: every usual way to compile a parallel model.

The patterns are those torch users write: the whole wrapped model compiled; blocks compiled
in place (``block.compile()``) before ``fully_shard``; and torchtitan's, a
``torch.compile(block, fullgraph=True)`` wrapper registered in the block's place, with the
API applied to the wrapper or to the block inside it. plait's hooks must stay out of the
compiled graphs (they swap parameters, resize storage and talk to peers): a graph break at
a hook is fine, a crash or a wrong number is not. So the oracle is, as everywhere, the
single-process eager run on the global batch (``check_parity``): inductor may reorder
float operations, hence the usual fp32 tolerance (rtol 1e-5) rather than bitwise equality.

Every pattern runs once with inductor (the default backend; the machine compiles C++).
Models are tiny and each test resets dynamo, so compiling costs a few seconds per test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import functional as F

from plait import checkpoint, fully_shard, register_fsdp_forward_method, replicate
from plait.pipeline import (
    PipelineStage,
    ScheduleGPipe,
    ScheduleInterleavedZeroBubble,
    split_model,
    stages_of_rank,
)

from harness import run_on_ranks
from models import MLP, MLPStack, shard_blocks
from parity import StageModules, check_parity, default_step, random_batches

BACKEND = "inductor"


class _Eager(nn.Module):
    """The reference's stand-in for a compiled wrapper: same parameter names
    (``_orig_mod.<name>``), plain eager forward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod(*args, **kwargs)


def _compile(module: nn.Module, backend: str) -> nn.Module:
    """torchtitan's per-block compile: one graph per block, or an error."""
    compiled: nn.Module = torch.compile(module, backend=backend, fullgraph=True)  # type: ignore[assignment]
    return compiled


def _swap_blocks(model: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> list[nn.Module]:
    """Register ``wrap(block)`` in each block's place (torchtitan's ``register_module``)."""
    wrappers = []
    for name, block in list(model.blocks.named_children()):  # type: ignore[union-attr]
        wrapper = wrap(block)
        model.blocks.register_module(name, wrapper)  # type: ignore[union-attr]
        wrappers.append(wrapper)
    return wrappers


class _CountRecomputes:
    """``context_fn`` for ``checkpoint``: counts recomputes (they must still happen)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        return nullcontext(), self._recompute()

    @contextmanager
    def _recompute(self) -> Iterator[None]:
        self.count += 1
        yield


# Each pattern: (parallelize the model in place given a backend and a recompute counter,
# build the reference's eager twin with the same parameter names).
Parallelize = Callable[[nn.Module, str, _CountRecomputes], nn.Module]


def _fsdp_whole(model: nn.Module, backend: str, _: _CountRecomputes) -> nn.Module:
    return torch.compile(shard_blocks(model), backend=backend)  # type: ignore[return-value]


def _fsdp_in_place(model: nn.Module, backend: str, _: _CountRecomputes) -> nn.Module:
    for block in model.blocks:  # type: ignore[union-attr]
        block.compile(backend=backend)
        fully_shard(block)
    return fully_shard(model)  # type: ignore[return-value]


def _fsdp_on_wrapper(model: nn.Module, backend: str, _: _CountRecomputes) -> nn.Module:
    for wrapper in _swap_blocks(model, lambda b: _compile(b, backend)):
        fully_shard(wrapper)
    return fully_shard(model)  # type: ignore[return-value]


def _fsdp_on_inner_block(model: nn.Module, backend: str, _: _CountRecomputes) -> nn.Module:
    for wrapper in _swap_blocks(model, lambda b: _compile(b, backend)):
        fully_shard(wrapper._orig_mod)
    return fully_shard(model)  # type: ignore[return-value]


def _replicate_whole(model: nn.Module, backend: str, _: _CountRecomputes) -> nn.Module:
    return torch.compile(replicate(model), backend=backend)  # type: ignore[return-value]


def _replicate_blocks(model: nn.Module, backend: str, _: _CountRecomputes) -> nn.Module:
    _swap_blocks(model, lambda b: _compile(b, backend))
    return replicate(model)


def _checkpoint_blocks(model: nn.Module, counter: _CountRecomputes) -> None:
    for block in model.blocks:  # type: ignore[union-attr]
        checkpoint(block, context_fn=counter)


def _checkpoint_whole(model: nn.Module, backend: str, counter: _CountRecomputes) -> nn.Module:
    _checkpoint_blocks(model, counter)
    return torch.compile(model, backend=backend)  # type: ignore[return-value]


def _checkpoint_compiled_blocks(
    model: nn.Module, backend: str, counter: _CountRecomputes
) -> nn.Module:
    _checkpoint_blocks(model, counter)
    _swap_blocks(model, lambda b: _compile(b, backend))
    return model


def _checkpoint_compile_fsdp(
    model: nn.Module, backend: str, counter: _CountRecomputes
) -> nn.Module:
    """torchtitan's order: activation checkpointing, then compile, then fully_shard."""
    _checkpoint_blocks(model, counter)
    for wrapper in _swap_blocks(model, lambda b: _compile(b, backend)):
        fully_shard(wrapper)
    return fully_shard(model)  # type: ignore[return-value]


def _checkpoint_replicate_whole(
    model: nn.Module, backend: str, counter: _CountRecomputes
) -> nn.Module:
    _checkpoint_blocks(model, counter)
    return torch.compile(replicate(model), backend=backend)  # type: ignore[return-value]


def _same(model: nn.Module) -> nn.Module:
    return model


def _whole_twin(model: nn.Module) -> nn.Module:
    return _Eager(model)


def _blocks_twin(model: nn.Module) -> nn.Module:
    _swap_blocks(model, _Eager)
    return model


# name: (parallelize, reference twin, world size, checkpointed)
PATTERNS: dict[str, tuple[Parallelize, Callable[[nn.Module], nn.Module], int, bool]] = {
    "fully_shard_whole_model": (_fsdp_whole, _whole_twin, 2, False),
    "fully_shard_compiled_in_place": (_fsdp_in_place, _same, 2, False),
    "fully_shard_on_wrapper": (_fsdp_on_wrapper, _blocks_twin, 2, False),
    "fully_shard_on_inner_block": (_fsdp_on_inner_block, _blocks_twin, 2, False),
    "replicate_whole_model": (_replicate_whole, _whole_twin, 2, False),
    "replicate_compiled_blocks": (_replicate_blocks, _blocks_twin, 2, False),
    "checkpoint_whole_model": (_checkpoint_whole, _whole_twin, 1, True),
    "checkpoint_compiled_blocks": (_checkpoint_compiled_blocks, _blocks_twin, 1, True),
    "checkpoint_compile_fully_shard": (_checkpoint_compile_fsdp, _blocks_twin, 2, True),
    "checkpoint_replicate_whole_model": (_checkpoint_replicate_whole, _whole_twin, 2, True),
}
STEPS, BLOCKS = 3, 2


def _reset_dynamo() -> None:
    """Start from no compiled code and zero counters (workers outlive tests)."""
    torch._dynamo.reset()
    counters.clear()


def _graphs() -> int:
    """Graphs dynamo compiled since ``_reset_dynamo``: proof that compilation happened."""
    return int(counters["stats"]["unique_graphs"])


def _pattern_body(name: str, backend: str) -> tuple[float, float]:
    """Train the pattern beside the one-process reference; the largest loss and parameter
    differences (within tolerance, or check_parity raises)."""
    _reset_dynamo()
    parallelize, twin, _, checkpointed = PATTERNS[name]
    counter = _CountRecomputes()
    report = check_parity(
        lambda: MLPStack(BLOCKS),
        lambda m: parallelize(m, backend, counter),
        random_batches(STEPS, 8, 8, 8),
        build_reference=lambda: twin(MLPStack(BLOCKS)),
    )
    assert _graphs() >= 1, f"{name}: nothing was compiled"
    if checkpointed:  # the compiled forwards were checkpointed, and recomputed in backward
        assert counter.count == BLOCKS * STEPS, counter.count
    pairs = zip(report.parallel_losses, report.reference_losses, strict=True)
    return max(abs(a - b) for a, b in pairs), report.max_param_diff


@pytest.mark.parametrize("name", list(PATTERNS))
def test_compiled_pattern_trains_like_one_process(name: str) -> None:
    world = PATTERNS[name][2]
    run_on_ranks(world, _pattern_body, name, BACKEND, timeout=300)


# --- pipeline stages ----------------------------------------------------------------------


def _stage_stack() -> nn.Sequential:
    return nn.Sequential(*(MLP(8, 16) for _ in range(4)))


def _compiled_layers(stage: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """Every layer the stage kept (the others are parameterless stand-ins) wrapped."""
    for name, layer in list(stage.named_children()):
        if any(True for _ in layer.parameters()):
            stage.register_module(name, wrap(layer))
    return stage


def _schedule_step(schedules: dict[int, Any]) -> Any:
    """check_parity's step: the pipeline schedule of a parallel copy, plain for the reference."""

    def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any) -> torch.Tensor:
        if id(model) not in schedules:  # the reference
            return default_step(model, x, y, loss_fn)
        losses: list[torch.Tensor] = []
        schedules[id(model)].step(x, target=y, losses=losses)
        return torch.stack(losses).mean() if losses else torch.zeros(())

    return step


def _pipeline_body(backend: str, dp: int) -> None:
    """GPipe over compiled blocks; with ``dp=2`` on a (dp, pp) mesh, blocks also sharded."""
    _reset_dynamo()
    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "pp"))
    pp_rank, pp_group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
    schedules: dict[int, ScheduleGPipe] = {}

    def parallelize(model: nn.Module) -> nn.Module:
        (stage,) = split_model(model, 2, stages=[pp_rank])
        _compiled_layers(stage, lambda b: _compile(b, backend))
        if dp > 1:
            for wrapper in stage.children():
                if any(True for _ in wrapper.parameters()):
                    fully_shard(wrapper, mesh=mesh["dp"])
            fully_shard(stage, mesh=mesh["dp"])
        schedule = ScheduleGPipe(
            PipelineStage(stage, pp_rank, 2, "cpu", group=pp_group), 2, F.mse_loss
        )
        stages = StageModules([stage])
        schedules[id(stages)] = schedule
        return stages

    check_parity(
        _stage_stack,
        parallelize,
        random_batches(STEPS, 8, 8, 8),
        step=_schedule_step(schedules),
        data_rank=mesh["dp"].get_local_rank(),
        data_world=dp,
        build_reference=lambda: _compiled_layers(_stage_stack(), _Eager),
    )
    assert _graphs() >= 1, "no stage block was compiled"


def test_compiled_pipeline_stages_train_like_one_process() -> None:
    run_on_ranks(2, _pipeline_body, BACKEND, 1, timeout=300)


def test_compiled_sharded_pipeline_stages_on_a_dp_pp_mesh() -> None:
    # aot_eager: the same dynamo capture and autograd split as inductor, without four
    # processes compiling C++ at once on a 2-core machine (inductor runs in the tests above).
    run_on_ranks(4, _pipeline_body, "aot_eager", 2, timeout=300)


def _fullgraph_inner_body() -> int:
    _reset_dynamo()
    model = MLPStack(BLOCKS)
    for wrapper in _swap_blocks(model, lambda b: _compile(b, "aot_eager")):
        checkpoint(wrapper._orig_mod)
        fully_shard(wrapper._orig_mod)
    fully_shard(model)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
    return _graphs()


def test_hooks_never_enter_a_fullgraph_region() -> None:
    """issue 18 #8: with fullgraph=True on the block inside, plait's hooks are frames dynamo
    skips, not ops it fails on (``Unsupported: torch.* op returned non-Tensor``)."""
    graphs = run_on_ranks(2, _fullgraph_inner_body, timeout=300)
    assert min(graphs) >= BLOCKS, graphs


def _eager_beside_compiled_body() -> float:
    _reset_dynamo()
    compiled, eager, reference = MLPStack(BLOCKS), MLPStack(BLOCKS), MLPStack(BLOCKS)
    eager.load_state_dict(compiled.state_dict())
    reference.load_state_dict(compiled.state_dict())
    _swap_blocks(compiled, lambda b: _compile(b, "aot_eager"))
    _checkpoint_blocks(eager, _CountRecomputes())
    x = torch.randn(4, 8)
    for model in (compiled, eager, reference):
        model(x).sum().backward()
    assert _graphs() >= 1
    pairs = zip(eager.parameters(), reference.parameters(), strict=True)
    return max((p.grad - q.grad).abs().max().item() for p, q in pairs)  # type: ignore[operator]


def test_eager_checkpoint_recomputes_eagerly_beside_compiled_code() -> None:
    """A checkpointed module run eagerly recomputes eagerly, even when its class's forward
    has compiled code (another instance was compiled): bitwise the plain eager gradients."""
    assert run_on_ranks(1, _eager_beside_compiled_body) == [0.0]


class _WithMethod(MLPStack):
    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def _forward_method_body() -> float:
    _reset_dynamo()
    torch.manual_seed(0)
    reference = _WithMethod(BLOCKS)
    torch.manual_seed(0)
    model = shard_blocks(_WithMethod(BLOCKS))
    register_fsdp_forward_method(model, "features")
    x = torch.randn(4, 8)
    compiled = torch.compile(lambda t: model.features(t).sum(), backend="aot_eager")
    got = compiled(x)
    got.backward()
    assert _graphs() >= 1
    return (got - reference.features(x).sum()).abs().item()


def test_registered_forward_method_called_from_compiled_code() -> None:
    """The unshard / reshard around a registered method stays out of the graph too."""
    assert run_on_ranks(2, _forward_method_body) == [0.0, 0.0]


def _zero_bubble_body() -> None:
    """Split backward (I then W) over compiled blocks: torch refuses compiled stages with
    zero-bubble schedules; plait's W half reuses the graph autograd recorded, so it runs."""
    _reset_dynamo()
    rank = torch.distributed.get_rank()
    schedules: dict[int, ScheduleInterleavedZeroBubble] = {}

    def parallelize(model: nn.Module) -> nn.Module:
        ids = stages_of_rank(rank, 2, 4, "loop")
        modules = [
            _compiled_layers(m, lambda b: _compile(b, BACKEND))
            for m in split_model(model, 4, stages=ids)
        ]
        stages = [PipelineStage(m, s, 4, "cpu") for m, s in zip(modules, ids, strict=True)]
        view = StageModules(modules)
        schedules[id(view)] = ScheduleInterleavedZeroBubble(stages, 4, F.mse_loss)
        return view

    check_parity(
        _stage_stack,
        parallelize,
        random_batches(STEPS, 8, 8, 8),
        step=_schedule_step(schedules),
        data_rank=0,
        data_world=1,
        build_reference=lambda: _compiled_layers(_stage_stack(), _Eager),
    )
    assert _graphs() >= 1, "no stage block was compiled"


def test_compiled_stages_under_a_zero_bubble_schedule() -> None:
    run_on_ranks(2, _zero_bubble_body, timeout=300)
