"""The tracing frontend: ``pipeline(module, mb_args, split_spec=...)`` -> ``Pipe`` -> stages.

In spirit of torch's test_pipe.py, test_unflatten.py, test_microbatch.py::test_chunk_spec
and the tracer cases of test_stage.py / test_schedule_multiproc.py: a traced model split at
``pipe_split()`` markers, at ``split_spec`` points or by a ``split_policy`` computes what
the model computes, its stage modules keep the model's parameter names, and a traced 2-
and 4-stage pipeline trains exactly like the single-process model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import fx, nn
from torch.nn import functional as F
from torch.utils._pytree import tree_leaves, tree_map

from plait.pipeline import (
    Pipe,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    SplitPoint,
    TensorChunkSpec,
    build_stage,
    merge_chunks,
    pipe_split,
    pipeline,
    split_args_kwargs_into_chunks,
)
from plait.pipeline.trace import pipe_split_op

from harness import run_on_ranks

D = 8


class _SkipAndSharedParam(nn.Module):
    """torch's ExampleCode: a skip connection over two stages, a parameter used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.mm_param1 = nn.Parameter(torch.randn(D, D))
        self.mm_param2 = nn.Parameter(torch.randn(D, D))
        self.lin1 = nn.Linear(D, D)
        self.lin2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = torch.mm(x, self.mm_param1)
        skip = x
        x = torch.relu(x + y)
        pipe_split()
        x = self.lin1(torch.mm(x, self.mm_param1))
        pipe_split()
        x = torch.mm(torch.relu(x) + skip, self.mm_param2)
        pipe_split()
        return torch.relu(self.lin2(x))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Linear(D, D)
        self.lin1 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, constant: torch.Tensor) -> torch.Tensor:
        x = self.lin0(x)
        pipe_split()  # inside a submodule: the frontend unflattens nothing by hand
        return torch.relu(self.lin1(x + constant))


class _Nested(nn.Module):
    """torch's test_unflatten model: split points in submodules, a keyword input used by
    every stage, and a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.block0 = _Block()
        self.block1 = _Block()

    def forward(self, x: torch.Tensor, constant: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.block0(x, constant=constant)
        pipe_split()
        return {"out": self.block1(x, constant=constant)}


def _check_names(module: nn.Module, pipe: Pipe) -> set[str]:
    """Every stage's state-dict key is one of the model's; returns their union."""
    names = set(module.state_dict())
    seen: set[str] = set()
    for i in range(pipe.num_stages):
        keys = set(pipe.get_stage_module(i).state_dict())
        assert keys <= names, keys - names
        seen |= keys
    return seen


def test_pipe_split_markers_with_skip_connection_and_shared_parameter() -> None:
    model = _SkipAndSharedParam()
    x, y = torch.randn(4, D), torch.randn(4, D)
    pipe = pipeline(model, (x, y))
    assert pipe.num_stages == 4 and pipe.info().num_stages == 4
    torch.testing.assert_close(pipe(x, y)[0], model(x, y), atol=0, rtol=0)
    assert _check_names(model, pipe) == set(model.state_dict())
    # The parameter used by stages 0 and 1 is present in both, under its own name.
    assert "mm_param1" in pipe.get_stage_module(0).state_dict()
    assert "mm_param1" in pipe.get_stage_module(1).state_dict()
    # Stage modules run on their own: stage 1 takes what stage 0 returns, and so on.
    out: tuple[torch.Tensor, ...] = pipe.get_stage_module(0)(x, y)
    for i in range(1, pipe.num_stages):
        result = pipe.get_stage_module(i)(*out)
        out = result if isinstance(result, tuple) else (result,)
    torch.testing.assert_close(out[0], model(x, y), atol=0, rtol=0)


def test_split_points_inside_submodules_keyword_inputs_and_dict_output() -> None:
    model = _Nested()
    x, constant = torch.randn(3, D), torch.randn(3, D)
    pipe = pipeline(model, (x,), {"constant": constant})
    assert pipe.num_stages == 4
    torch.testing.assert_close(pipe(x, constant=constant)[0], model(x, constant)["out"])
    torch.testing.assert_close(pipe(x, constant)[0], model(x, constant)["out"])
    assert _check_names(model, pipe) == set(model.state_dict())
    last = pipe.get_stage_module(3)
    first_out = pipe.get_stage_module(0)(x, constant=constant)
    mid = pipe.get_stage_module(2)(*pipe.get_stage_module(1)(*first_out))
    assert set(last(*mid, ignored=1)) == {"out"}  # the model's output structure; kwargs ignored


def test_split_spec_needs_no_edit_of_the_forward_and_leaves_the_model_unchanged() -> None:
    seq = nn.Sequential(*(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4)))
    x = torch.randn(5, D)
    pipe = pipeline(seq, (x,), split_spec={"0": SplitPoint.END, "2": SplitPoint.BEGINNING})
    assert pipe.num_stages == 3
    keys = [list(pipe.get_stage_module(i).state_dict()) for i in range(3)]
    assert keys == [
        ["0.0.weight", "0.0.bias"],
        ["1.0.weight", "1.0.bias"],
        [
            "2.0.weight",
            "2.0.bias",
            "3.0.weight",
            "3.0.bias",
        ],
    ]
    torch.testing.assert_close(pipe(x)[0], seq(x), atol=0, rtol=0)
    assert not seq[0]._forward_hooks and not seq[2]._forward_pre_hooks  # no marks left behind


def test_split_policy_inserts_split_points_in_the_traced_graph() -> None:
    seq = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))

    def after_first_linear(gm: fx.GraphModule) -> fx.GraphModule:
        first = next(n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n))
        with gm.graph.inserting_after(first):
            gm.graph.call_function(pipe_split_op)
        gm.recompile()
        return gm

    x = torch.randn(2, D)
    pipe = pipeline(seq, (x,), split_policy=after_first_linear)
    assert pipe.num_stages == 2
    assert list(pipe.get_stage_module(1).state_dict()) == ["2.weight", "2.bias"]
    torch.testing.assert_close(pipe(x)[0], seq(x), atol=0, rtol=0)


def test_chunk_spec_then_trace_on_one_microbatch() -> None:
    """torch's test_chunk_spec: split with specs, trace on microbatch 0, run the whole batch."""
    model = _Nested()
    x, constant = torch.randn(8, D), torch.randn(8, D)
    args, kwargs = split_args_kwargs_into_chunks(
        (x,),
        {"constant": constant},
        4,
        TensorChunkSpec.from_tuple((0,)),
        TensorChunkSpec.from_dict({"constant": 0}),
    )
    pipe = pipeline(model, args[0], kwargs[0])
    torch.testing.assert_close(pipe(x, constant)[0], model(x, constant)["out"])


class _Outputs(nn.Module):
    """torch's ModelWithKwargs, ``n_splits`` split points, output of any ``kind``:

    * ``"tensor"``: one tensor, and every stage hands one tensor to the next;
    * ``"tuple"`` / ``"dict"``: two tensors, and a skip connection over every boundary, so
      every stage but the last hands a tuple to the next.
    """

    def __init__(self, n_splits: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.mm_param0 = nn.Parameter(torch.randn(D, D))
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(n_splits + 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> object:
        x = torch.mm(x, self.mm_param0)
        if y is not None:
            x = x + y
        skip = x
        for i, lin in enumerate(self.lins):
            if i:
                pipe_split()
            x = torch.relu(lin(x))
        if self.kind == "tensor":
            return x
        if self.kind == "tuple":
            return x + skip, x
        return {"out": x + skip, "hidden": x}


def _run_stages(pipe: Pipe, args: tuple[torch.Tensor, ...], kwargs: dict[str, object]) -> object:
    """Every stage module in turn, as a pipeline does: the last returns the model's output."""
    out = pipe.get_stage_module(0)(*args, **kwargs)
    for i in range(1, pipe.num_stages):
        out = pipe.get_stage_module(i)(*(out if isinstance(out, tuple) else (out,)))
    return out


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict"])
@pytest.mark.parametrize("n_splits", [0, 1, 3])
def test_split_and_merge_microbatches_through_the_traced_pipe(n_splits: int, kind: str) -> None:
    """torch's test_microbatch.py pattern: split a batch into microbatches, run each through
    the pipe traced on microbatch 0 (the split module, and its stages one by one), merge,
    and get the unsplit model's output. Without split points the pipe has one stage, both
    first and last, whose output structure was once lost (``tree_unflatten(..., None)``)."""
    model = _Outputs(n_splits, kind)
    x, y = torch.randn(16, D), torch.randn(16, D)
    args, kwargs = split_args_kwargs_into_chunks((x,), {"y": y}, 4)
    pipe = pipeline(model, mb_args=args[0], mb_kwargs=kwargs[0])
    assert pipe.num_stages == n_splits + 1
    expected = model(x, y=y)
    by_stage = merge_chunks([_run_stages(pipe, a, k) for a, k in zip(args, kwargs, strict=True)])
    torch.testing.assert_close(by_stage, expected, atol=0, rtol=0)
    flat = merge_chunks([pipe(*a, **k) for a, k in zip(args, kwargs, strict=True)])
    assert isinstance(flat, tuple)  # the pipe returns the flat tuple of the output's leaves
    torch.testing.assert_close(list(flat), tree_leaves(expected), atol=0, rtol=0)


def test_split_policy_may_build_a_graph_without_output_structure() -> None:
    """A split_policy returning a new graph module, whose graph returns one node (no pytree
    output spec): the last stage returns that value as it is."""
    seq = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))

    def rebuild(gm: fx.GraphModule) -> fx.GraphModule:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in gm.graph.nodes:
            if node.op == "output":
                graph.output(env[node.args[0][0]])  # the single tensor, not a tuple
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
                if node.op == "call_function" and node.target is torch.ops.aten.relu.default:
                    graph.call_function(pipe_split_op)
        return fx.GraphModule(gm, graph)

    x = torch.randn(2, D)
    pipe = pipeline(seq, (x,), split_policy=rebuild)
    assert pipe.num_stages == 2
    torch.testing.assert_close(_run_stages(pipe, (x,), {}), seq(x), atol=0, rtol=0)
    torch.testing.assert_close(pipe(x)[0], seq(x), atol=0, rtol=0)


def test_frontend_errors_name_the_fix() -> None:
    seq = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))
    x = torch.randn(2, D)
    with pytest.raises(ValueError, match="not both"):
        pipeline(seq, (x,), split_spec={"0": SplitPoint.END}, split_policy=lambda g: g)
    with pytest.raises(ValueError, match="'5', which is not a submodule"):
        pipeline(seq, (x,), split_spec={"5": SplitPoint.END})
    with pytest.raises(ValueError, match=r"stages \[0\] of 2 without any computation"):
        pipeline(seq, (x,), split_spec={"0": SplitPoint.BEGINNING})
    pipe = pipeline(seq, (x,), split_spec={"0": SplitPoint.END})
    with pytest.raises(ValueError, match="stage index 2 is out of range"):
        pipe.get_stage_module(2)
    with pytest.raises(ValueError, match=r"split_spec\['0'\] must be a SplitPoint"):
        pipeline(seq, (x,), split_spec={"0": "beginning"})


class _Skips(nn.Module):
    """``unused`` never runs; ``shared`` runs twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.unused, self.last = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.shared(torch.relu(self.shared(x))))


def test_a_split_that_would_give_another_stage_count_is_refused_at_pipeline_time() -> None:
    """Each ``split_spec`` entry must cut exactly once: a submodule the forward never runs
    (no boundary: silently one stage fewer) or runs twice (one more) is refused when
    ``pipeline()`` is called, naming the entry; a pipe without any split point warns."""
    model, x = _Skips(), torch.randn(2, D)
    with pytest.raises(ValueError, match=r"split_spec\['unused'\].*never called 'unused'"):
        pipeline(model, (x,), split_spec={"unused": SplitPoint.BEGINNING})
    with pytest.raises(ValueError, match=r"split_spec\['shared'\]: 'shared' ran 2 times"):
        pipeline(model, (x,), split_spec={"shared": SplitPoint.END})
    assert pipeline(model, (x,), split_spec={"last": SplitPoint.BEGINNING}).num_stages == 2
    with pytest.warns(UserWarning, match="_Skips's forward has no split point"):
        assert pipeline(model, (x,)).num_stages == 1


# --- traced pipelines on ranks: parity with one process ------------------------------------


class _Stack(nn.Module):
    """Layers in a ModuleList, a keyword input used by the first layer only, and a head."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(n))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is not None:
            x = x + bias
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class _TorchMarkedStack(_Stack):
    """A model file written for torch: torch's own ``pipe_split`` before every layer but
    the first (a no-op when it runs eagerly, the reference run below)."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from torch.distributed.pipelining import pipe_split as torch_pipe_split

        if bias is not None:
            x = x + bias
        for i, layer in enumerate(self.layers):
            if i:
                torch_pipe_split()
            x = torch.tanh(layer(x))
        return self.head(x)


def _split_spec(split_with: str, world: int) -> dict[str, object] | None:
    """Boundaries before layers 1.. by ``split_with``: plait's SplitPoint, torch's, or none
    (the model's own torch markers)."""
    if split_with == "torch_marker":
        return None
    if split_with == "torch_spec":
        from torch.distributed.pipelining import SplitPoint as TorchSplitPoint

        return {f"layers.{i}": TorchSplitPoint.BEGINNING for i in range(1, world)}
    return {f"layers.{i}": SplitPoint.BEGINNING for i in range(1, world)}


def _traced_parity_body(
    schedule_name: str, use_kwargs: bool, build_from_info: bool, split_with: str = "plait"
) -> None:
    """Train a traced pipeline (one stage per rank) and the whole model for 2 steps: the
    losses, the output and the parameters must agree; stage state dicts load back."""
    world, rank, m = dist.get_world_size(), dist.get_rank(), 4
    model = _TorchMarkedStack(world) if split_with == "torch_marker" else _Stack(world)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, D, generator=gen), torch.randn(8, 3, generator=gen)
    bias = torch.randn(8, D, generator=gen)
    kwargs = {"bias": bias} if use_kwargs else {}
    mb_kwargs = {"bias": bias.chunk(m)[0]} if use_kwargs else None
    split_spec = _split_spec(split_with, world)
    pipe = pipeline(model, (x.chunk(m)[0],), mb_kwargs, split_spec=split_spec)
    assert pipe.num_stages == world
    if build_from_info:
        stage = build_stage(pipe.get_stage_module(rank), rank, pipe.info(), "cpu")
    else:
        stage = pipe.build_stage(rank, "cpu")
    assert isinstance(stage, PipelineStage)
    cls = ScheduleGPipe if schedule_name == "GPipe" else Schedule1F1B
    schedule = cls(stage, m, loss_fn=F.mse_loss)
    stage_module = pipe.get_stage_module(rank)
    opt = torch.optim.SGD(stage_module.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            out = schedule.step(x, **kwargs)
        elif rank == world - 1:
            out = schedule.step(target=y, losses=losses)
        else:
            out = schedule.step()
        ref_out = reference(x, **kwargs)
        ref_loss = F.mse_loss(ref_out, y)
        ref_loss.backward()
        if rank == world - 1:
            torch.testing.assert_close(out, ref_out.detach())
            torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach())
        opt.step()
        ref_opt.step()
    ref_params = dict(reference.named_parameters())
    for name, p in stage_module.named_parameters():  # the model's own names
        torch.testing.assert_close(p, ref_params[name], atol=1e-6, rtol=1e-5)
    fresh = _Stack(world)
    fresh.load_state_dict(stage_module.state_dict(), strict=False)
    for name, p in stage_module.named_parameters():
        assert torch.equal(fresh.get_parameter(name), p)


@pytest.mark.parametrize("world", [2, 4])
def test_traced_pipeline_trains_like_one_process(world: int) -> None:
    run_on_ranks(world, _traced_parity_body, "1F1B", False, False)


def test_traced_pipeline_with_keyword_inputs_and_build_stage() -> None:
    run_on_ranks(2, _traced_parity_body, "GPipe", True, True)


@pytest.mark.parametrize(("split_with", "world"), [("torch_spec", 2), ("torch_marker", 4)])
def test_torchs_split_points_train_like_one_process(split_with: str, world: int) -> None:
    """Model files and drivers written for torch: torch's ``SplitPoint`` in ``split_spec``,
    or torch's ``pipe_split()`` in the model's forward, cut plait's traced pipeline into one
    stage per rank, and it trains like the whole model in one process."""
    run_on_ranks(world, _traced_parity_body, "1F1B", False, False, split_with)


def _output_kinds_body(kind: str) -> None:
    """A traced pipeline, one stage per rank (one rank: a single stage, first and last),
    whose last stage returns ``kind``: a schedule step trains it as the whole model."""
    world, rank, m = dist.get_world_size(), dist.get_rank(), 4
    model = _Outputs(world - 1, kind)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    x, y, target = (torch.randn(8, D, generator=gen) for _ in range(3))
    args, kwargs = split_args_kwargs_into_chunks((x,), {"y": y}, m)
    pipe = pipeline(model, args[0], kwargs[0])
    assert pipe.num_stages == world
    stage_module = pipe.get_stage_module(rank)
    schedule = ScheduleGPipe(pipe.build_stage(rank, "cpu"), m, loss_fn=_loss_of_leaves)
    losses: list[torch.Tensor] = []
    last = rank == world - 1
    step_args = (x,) if rank == 0 else ()
    step_kwargs: dict[str, object] = {"y": y} if rank == 0 else {}
    if last:
        step_kwargs.update(target=target, losses=losses)
    out = schedule.step(*step_args, **step_kwargs)
    ref_out = reference(x, y=y)
    ref_loss = _loss_of_leaves(ref_out, target)
    ref_loss.backward()
    if last:
        torch.testing.assert_close(out, tree_map(torch.Tensor.detach, ref_out))
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach())
    ref_params = dict(reference.named_parameters())
    for name, p in stage_module.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_params[name].grad)


def _loss_of_leaves(output: object, target: torch.Tensor) -> torch.Tensor:
    losses = [F.mse_loss(t, target) for t in tree_leaves(output)]
    return torch.stack(losses).sum()


@pytest.mark.parametrize(
    ("kind", "world"), [("tensor", 1), ("tensor", 2), ("tuple", 2), ("dict", 2)]
)
def test_traced_output_structures_through_a_schedule_step(kind: str, world: int) -> None:
    run_on_ranks(world, _output_kinds_body, kind)


class _TorchMarked(nn.Module):
    """A model file written for torch: it calls torch's own ``pipe_split``."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.pipelining import pipe_split as torch_pipe_split

        x = torch.relu(self.first(x))
        torch_pipe_split()
        return self.second(x)


def test_torchs_pipe_split_marker_splits_too() -> None:
    """Only the driver's imports moved to plait: the model's torch markers still cut."""
    model = _TorchMarked()
    x = torch.randn(4, D)
    pipe = pipeline(model, mb_args=(x,))
    assert pipe.num_stages == 2
    torch.testing.assert_close(_run_stages(pipe, (x,), {}), model(x), atol=0, rtol=0)
