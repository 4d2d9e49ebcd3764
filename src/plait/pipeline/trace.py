"""The tracing frontend: split a model into pipeline stages without editing its forward.

torch's names: :func:`pipeline` traces ``module`` on one microbatch with ``torch.export``
and cuts the graph at split points, which are either

* calls of :func:`pipe_split` in the forward (a no-op when the model runs eagerly), or
* ``split_spec={"layers.2": SplitPoint.BEGINNING, ...}``: a split just before (or, with
  ``SplitPoint.END``, just after) the named submodule runs, so the forward stays as it
  is, or
* ``split_policy``: a function that receives the traced ``fx.GraphModule`` and returns it
  with :func:`pipe_split` calls inserted (``graph.call_function(pipe_split_op)``).

The result is a :class:`Pipe`: ``num_stages``, ``get_stage_module(i)``, ``info()``,
``build_stage(i, device, group)`` (a :class:`~plait.pipeline.stage.PipelineStage` that any
schedule runs), ``split_gm`` (a graph module calling the stages in order) and, as an
``nn.Module``, the whole pipeline in one process (``pipe(*args, **kwargs)`` returns the
flat tuple of the model's outputs, as torch's ``Pipe``).

Stage modules. Each is an ``fx.GraphModule`` whose parameters and buffers keep the fully
qualified names they have in ``module`` (``layers.0.weight``), so a stage's
``state_dict`` loads into the original model and back, and optimizers and checkpoints
need no renaming. They share their tensors with ``module`` (no copy). How values flow:

* stage 0 takes the model's own arguments (positional and keyword, as ``module``);
* every later stage takes, positionally, what the previous stage returns: the values
  computed before it that it or a later stage still needs. A value used two stages later
  (a skip connection), or an input of the model needed by a later stage (a mask), is
  passed through the stages in between, so every message goes to the neighbour;
* the last stage returns the model's output, in the model's structure. Later stages accept
  keyword arguments and ignore them: what they need arrives from the previous stage.

Limits, the same as torch's (both trace once, on one microbatch): shapes are those of the
example microbatch wherever the model bakes them in (``view(B, ...)``), so run the traced
stages with microbatches of that size; a parameter used by two stages (tied weights) is
present in both, each stage computing its part of the gradient (sum the two before the
optimizer step, as for tied embeddings in any pipeline); values crossing a stage boundary
must be tensors.
"""

from __future__ import annotations

import copy
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from plait.pipeline.stage import PipelineStage

__all__ = ["Pipe", "PipeInfo", "SplitPoint", "build_stage", "pipe_split", "pipeline"]

# The split marker, an operator with a side effect so that export keeps it in the graph.
torch.library.define("plait::pipe_split", "() -> ()")


@torch.library.impl("plait::pipe_split", "BackendSelect")
def _pipe_split_impl() -> None:
    return None


@torch.library.register_fake("plait::pipe_split")  # type: ignore[untyped-decorator]
def _pipe_split_fake() -> None:
    return None


pipe_split_op = torch.ops.plait.pipe_split.default
"""The operator :func:`pipe_split` calls; a ``split_policy`` inserts it into graphs."""
fx.node.has_side_effect(pipe_split_op)

_GUARDS = "_guards_fn"  # ep.module()'s input-guard submodule: not part of any stage
# Attribute of the last stage: the structure of the model's output. Not ``_out_spec``: that
# name belongs to fx.GraphModule, whose recompile() overwrites it with its codegen's output
# spec (None for stage 0, which takes the model's inputs but not its output structure), and
# a one-stage pipe's only stage is both stage 0 and the last.
_OUT_SPEC = "_pipe_out_spec"


def pipe_split() -> None:
    """Mark a stage boundary in a forward; does nothing when the model runs eagerly."""
    pipe_split_op()


class SplitPoint(Enum):
    """Where ``split_spec`` puts a boundary around the named submodule."""

    BEGINNING = 1  # before the submodule runs
    END = 2  # after it runs


@dataclass(frozen=True)
class PipeInfo:
    """What a stage needs to know about its pipeline (torch's ``PipeInfo``)."""

    graph: fx.Graph
    num_stages: int
    has_loss_and_backward: bool = False  # plait's schedules take the loss as loss_fn


class Pipe(nn.Module):
    """A traced model cut into ``num_stages`` stage modules; see the module docstring."""

    def __init__(self, split_gm: fx.GraphModule, num_stages: int) -> None:
        super().__init__()
        self.split_gm = split_gm
        self.num_stages = num_stages

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Every stage in order, in this process: the flat tuple of the model's outputs."""
        return tuple(self.split_gm(*args, **kwargs))

    def get_stage_module(self, stage_idx: int) -> nn.Module:
        if not 0 <= stage_idx < self.num_stages:
            raise ValueError(
                f"stage index {stage_idx} is out of range: the pipe has {self.num_stages} "
                f"stages (0..{self.num_stages - 1})"
            )
        return self.split_gm.get_submodule(_submod(stage_idx))

    def info(self) -> PipeInfo:
        return PipeInfo(self.split_gm.graph, self.num_stages)

    def build_stage(
        self,
        stage_index: int,
        device: torch.device | str | int,
        group: dist.ProcessGroup | None = None,
    ) -> PipelineStage:
        """The :class:`PipelineStage` running stage ``stage_index`` on ``device``."""
        return build_stage(
            self.get_stage_module(stage_index), stage_index, self.info(), device, group
        )


def build_stage(
    stage_module: nn.Module,
    stage_index: int,
    pipe_info: PipeInfo,
    device: torch.device | str | int,
    group: dist.ProcessGroup | None = None,
) -> PipelineStage:
    """A :class:`PipelineStage` for a stage module of a :class:`Pipe` (moved to ``device``)."""
    return PipelineStage(
        stage_module.to(device), stage_index, pipe_info.num_stages, device, group=group
    )


def pipeline(
    module: nn.Module,
    mb_args: tuple[Any, ...] | Any,
    mb_kwargs: dict[str, Any] | None = None,
    split_spec: dict[str, SplitPoint] | dict[str, Any] | None = None,
    split_policy: Callable[[fx.GraphModule], fx.GraphModule] | None = None,
) -> Pipe:
    """Trace ``module`` on one microbatch (``mb_args`` / ``mb_kwargs``) and cut it into
    stages at its split points; see the module docstring.

    ``split_spec`` takes plait's :class:`SplitPoint` or torch's. Raises ValueError for both
    ``split_spec`` and ``split_policy``, an unknown submodule name in ``split_spec``, a
    ``split_spec`` entry whose submodule the forward runs not exactly once (no boundary, or
    several: the pipe would not have ``len(split_spec) + 1`` stages), a split point that
    leaves a stage empty, or a non-tensor value crossing a stage boundary. A pipe without
    any split point (one stage) warns: a model whose markers went unseen must not pass
    silently.
    """
    if split_spec is not None and split_policy is not None:
        raise ValueError("pipeline(): give split_spec or split_policy, not both")
    if not isinstance(mb_args, tuple):
        mb_args = (mb_args,)
    marks = _SplitMarks(module, split_spec or {})
    try:
        exported = torch.export.export(module, mb_args, mb_kwargs or {}, strict=False)
    finally:
        marks.remove()
    marks.check()
    traced = exported.module()
    assert isinstance(traced, fx.GraphModule)
    if split_policy is not None:
        traced = split_policy(traced)
    pipe = Pipe(*_split(traced))
    if pipe.num_stages == 1:
        _warn_single_stage(module)
    return pipe


def _split_point(name: str, point: object) -> SplitPoint:
    """``point`` as plait's :class:`SplitPoint`; torch's own enum (``torch.distributed
    .pipelining.SplitPoint``, which model code and torch's tests pass) is read by member name."""
    if isinstance(point, SplitPoint):
        return point
    if isinstance(point, Enum) and point.name in SplitPoint.__members__:
        return SplitPoint[point.name]
    raise ValueError(f"split_spec[{name!r}] must be a SplitPoint (BEGINNING or END), got {point!r}")


class _SplitMarks:
    """Hooks that call :func:`pipe_split` around ``split_spec``'s submodules while tracing,
    counting how often each one cut: each must cut exactly once, or the pipe would have
    another number of stages than ``split_spec`` asks for."""

    def __init__(self, module: nn.Module, split_spec: dict[str, Any]) -> None:
        self.module = module
        self.cuts = dict.fromkeys(split_spec, 0)
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        for name, point in split_spec.items():
            self._mark(name, _split_point(name, point))

    def _mark(self, name: str, point: SplitPoint) -> None:
        try:
            target = self.module.get_submodule(name)
        except AttributeError as err:
            raise ValueError(
                f"split_spec names {name!r}, which is not a submodule of "
                f"{type(self.module).__name__}: {err}"
            ) from None

        def cut(*_: object) -> None:
            self.cuts[name] += 1
            pipe_split()

        if point is SplitPoint.BEGINNING:
            self.handles.append(target.register_forward_pre_hook(cut))
        else:
            self.handles.append(target.register_forward_hook(cut))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def check(self) -> None:
        """ValueError naming each split point that did not cut exactly once."""
        for name, times in self.cuts.items():
            if times == 0:
                raise ValueError(
                    f"split_spec[{name!r}]: {type(self.module).__name__}'s forward never "
                    f"called {name!r} while tracing on the example microbatch, so no stage "
                    "boundary was made there: name a submodule the forward runs"
                )
            if times > 1:
                raise ValueError(
                    f"split_spec[{name!r}]: {name!r} ran {times} times in one forward (a "
                    f"shared or looped submodule), which would cut {times} boundaries "
                    "instead of one: name a submodule that runs once per forward"
                )


def _warn_single_stage(module: nn.Module) -> None:
    warnings.warn(
        f"pipeline(): {type(module).__name__}'s forward has no split point, so the pipe has "
        "a single stage. Mark boundaries with split_spec={'layers.4': SplitPoint.BEGINNING}, "
        "pipe_split() calls in the forward (plait's or torch's), or a split_policy",
        UserWarning,
        stacklevel=3,
    )


# --- cutting the traced graph -----------------------------------------------------------------


def _submod(i: int) -> str:
    return f"submod_{i}"


# torch's own marker (``torch.distributed.pipelining.pipe_split``), recognised by name so
# that a model file still calling it splits the same (plait imports nothing from there).
_TORCH_SPLIT_MARKER = "pippy::_pipe_split"


def _is_split_marker(target: object) -> bool:
    if target is pipe_split_op:
        return True
    return isinstance(target, torch._ops.OpOverload) and target.name() == _TORCH_SPLIT_MARKER


class _Cut:
    """The traced graph's nodes, by stage, and the values live across each boundary."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.nodes = list(gm.graph.nodes)
        self.output = next(n for n in self.nodes if n.op == "output")
        # What the graph returns, as leaves, and the model output's structure over them.
        self.returned, self.out_spec = _output_structure(gm)
        self.stage_of: dict[fx.Node, int] = {}
        stage = 0
        for node in self.nodes:
            if node.op == "call_function" and _is_split_marker(node.target):
                stage += 1
            elif node.op in ("call_function", "call_method", "call_module") and not (
                node.op == "call_module" and node.target == _GUARDS
            ):
                self.stage_of[node] = stage
        self.n_stages = stage + 1
        empty = [s for s in range(self.n_stages) if s not in self.stage_of.values()]
        if empty:
            raise ValueError(
                f"the split points leave stages {empty} of {self.n_stages} without any "
                "computation (two split points in a row, or one at the very beginning or end "
                "of the forward): remove one"
            )
        self.live = self._live_across()

    def used_at(self, node: fx.Node) -> set[int]:
        """The stages that use ``node``'s value."""
        stages = {self.stage_of[u] for u in node.users if u in self.stage_of}
        if self.output in node.users:
            stages.add(self.n_stages - 1)
        return stages

    def _live_across(self) -> list[list[fx.Node]]:
        """``live[b]``: the values made at stage <= b (inputs at stage 0) and used after b,
        in graph order; the values that cross boundary b (stage b -> b + 1)."""
        live: list[list[fx.Node]] = [[] for _ in range(self.n_stages - 1)]
        for node in self.nodes:
            if node.op == "placeholder":
                home = 0
            elif node in self.stage_of:
                home = self.stage_of[node]
            else:
                continue  # parameters and constants are copied where used, never sent
            last = max(self.used_at(node), default=home)
            for b in range(home, last):
                val = node.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    raise ValueError(
                        f"the value {node.name!r} ({type(val).__name__}) crosses the boundary "
                        f"between pipeline stages {b} and {b + 1}, but only tensors can be "
                        "sent between stages: move the split point, or compute it on both sides"
                    )
                live[b].append(node)
        return live


def _split(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """Cut ``gm`` (``ExportedProgram.module()``) at its split markers: the graph module
    calling the stage modules in order (``submod_i``), and the number of stages."""
    cut = _Cut(gm)
    setattr(gm, _OUT_SPEC, cut.out_spec)  # read by the last stage (its get_attr)
    stages = [_stage_module(gm, cut, s) for s in range(cut.n_stages)]
    root = nn.Module()
    for i, stage in enumerate(stages):
        root.add_module(_submod(i), stage)
    graph = fx.Graph()
    inputs = [graph.node_copy(n) for n in cut.nodes if n.op == "placeholder"]
    values: list[fx.Node] = inputs
    for s in range(cut.n_stages):
        result = graph.call_module(_submod(s), tuple(values))
        if s == cut.n_stages - 1:
            graph.output(graph.call_function(pytree.tree_leaves, (result,)))
        elif len(cut.live[s]) == 1:
            values = [result]
        else:
            n = len(cut.live[s])
            values = [graph.call_function(operator.getitem, (result, i)) for i in range(n)]
    _take_inputs_as(gm, graph)
    split_gm = fx.GraphModule(root, graph)
    _copy_in_spec(gm, split_gm)
    return split_gm, cut.n_stages


def _stage_module(gm: fx.GraphModule, cut: _Cut, stage: int) -> fx.GraphModule:
    """Stage ``stage`` of ``gm`` as a graph module whose parameters keep their names."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    last = stage == cut.n_stages - 1
    if stage == 0:
        for node in cut.nodes:
            if node.op == "placeholder":
                env[node] = graph.node_copy(node)
    else:
        for node in cut.live[stage - 1]:
            env[node] = graph.placeholder(node.name)
            env[node].meta = copy.copy(node.meta)
        graph.placeholder("**kwargs")  # accepted and ignored (see the module docstring)
    for node in cut.nodes:
        if node.op == "get_attr" and stage in cut.used_at(node):
            env[node] = graph.node_copy(node)  # same qualified name: FQNs are kept
        elif cut.stage_of.get(node) == stage:
            env[node] = graph.node_copy(node, lambda n: env[n])
    if last:
        flat = [fx.map_arg(leaf, lambda n: env[n]) for leaf in cut.returned]
        spec = graph.get_attr(_OUT_SPEC)
        graph.output(graph.call_function(pytree.tree_unflatten, (flat, spec)))
    else:
        outs = [env[n] for n in cut.live[stage]]
        graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    if stage == 0:
        _take_inputs_as(gm, graph)
    module = fx.GraphModule(gm, graph)  # copies the attributes the graph reads, by name
    if stage == 0:
        _copy_in_spec(gm, module)
    return module


def _take_inputs_as(gm: fx.GraphModule, graph: fx.Graph) -> None:
    """``graph`` takes the model's own arguments (positional and keyword): ``gm``'s input
    handling, without its output structure (the last stage restores that)."""
    codegen = copy.copy(gm.graph._codegen)  # shallow: its specs are immutable
    info = getattr(codegen, "pytree_info", None)
    if info is not None:
        codegen.pytree_info = info._replace(out_spec=None)  # type: ignore[attr-defined]
    graph._codegen = codegen


def _copy_in_spec(gm: fx.GraphModule, module: fx.GraphModule) -> None:
    if hasattr(gm, "_in_spec"):
        module._in_spec = gm._in_spec
    module.recompile()


def _output_structure(gm: fx.GraphModule) -> tuple[list[Any], pytree.TreeSpec]:
    """The leaves the graph returns (its nodes and constants) and the structure that the
    model's output gives them."""
    returned = gm.graph.output_node().args[0]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    spec = getattr(info, "out_spec", None)
    if spec is not None:  # export's graphs return the flat leaves; the spec rebuilds them
        assert isinstance(returned, (tuple, list)), returned
        return list(returned), spec
    # A graph without output structure (one a split_policy built anew) returns what it
    # returns: a single value, or a container of them, as written in the graph.
    return pytree.tree_flatten(returned)
