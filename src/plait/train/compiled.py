"""``plait train --compile``: each transformer block compiled by ``torch.compile``.

torchtitan compiles every transformer block on its own (one graph per block, reused by all
blocks of the same class), which is where most of a GPU step's speed-up comes from: norms,
residual adds, rotary embeddings and activations fuse around the matmuls. plait does the
same with one difference: it compiles a block's *forward method* (``block.forward``), not
the module's ``__call__``, so

* the hooks that plait's APIs put on the block (fully_shard's unshard and reshard,
  activation checkpointing's regions, context parallelism's mode) run eagerly around the
  compiled code instead of being traced or breaking it;
* parameter names do not change (no ``_orig_mod.``): checkpoints of compiled and eager
  runs are interchangeable, and Hugging Face name rules still hold.

What one graph covers (``fullgraph=True`` everywhere: a graph break is an error at the first
step, never a silent slowdown):

* a dense block: the whole block;
* a block whose attention is context-parallel (``--cp``): its norms and its feed-forward
  network, each one graph; the attention runs eagerly, because its SDPA is replaced by
  collectives under a torch function mode (:mod:`plait.context`);
* a mixture-of-experts block: its norms and attention, and inside the MoE the router and
  the shared experts, each one graph; the routed experts run eagerly (row counts are data:
  the expert all-to-all, the host sync of the row counts and the load counted over the
  data-parallel ranks live there; the experts themselves are one grouped GEMM).

:class:`CompileCounters` reads dynamo's counters so a run can show that compilation stops
after the first step (every later step reuses the graphs: no recompiles, no graph breaks).
Attention takes the same variant on every batch for that: under ``--compile`` each batch
carries its documents (``plait.train.step.step_batch``), so attention is masked by
document even where a batch packs one document per row. On GPUs that attention is flash's
variable-length kernel, whose document count and longest document the graphs take as
dynamic sizes from the first batch (:mod:`plait.train.packing`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.experts import MoE

__all__ = ["BACKEND", "CompileCounters", "compile_blocks", "compiled_parts"]

#: The backend ``--compile`` uses. Tests may set ``"aot_eager"``: the same graph capture and
#: autograd split, without generating and building C++ in every process.
BACKEND = "inductor"


def compiled_parts(block: nn.Module, context_parallel: bool) -> list[nn.Module]:
    """The modules of ``block`` whose forwards ``--compile`` compiles, each as one graph
    (module docstring): the block itself when it is dense and its attention is local."""
    mlp = getattr(block, "mlp", None)
    moe = isinstance(mlp, MoE)
    if not moe and not context_parallel:
        return [block]
    parts: list[nn.Module] = []
    for name, child in block.named_children():
        if name == "attn" and context_parallel:
            continue
        if isinstance(child, MoE):
            parts += [m for m in (child.router, child.shared_experts) if m is not None]
            continue
        parts.append(child)
    return parts


def compile_blocks(blocks: Sequence[nn.Module], context_parallel: bool) -> None:
    """Compile the forwards of ``blocks``' :func:`compiled_parts` in place.

    Call it after tensor parallelism (the graphs then see the DTensor pieces each rank
    holds) and before activation checkpointing and ``fully_shard``, whose hooks stay on
    the modules, outside the graphs. Modules keep their classes and parameter names.
    """
    for block in blocks:
        for part in compiled_parts(block, context_parallel):
            # An instance attribute shadowing the class's forward: nn.Module.__call__ runs
            # the hooks, then this compiled function (bound to ``part``).
            part.forward = _Compiled(part.forward)


class _Compiled:
    """A forward method compiled as one graph, called with a first argument that is not a
    view.

    Why the copy: under tensor parallelism the first block's input is the embedding's
    output as a local view of a DTensor (``to_local``); handed to a compiled graph as it
    is, torch 2.13 gives the view's gradient back as a plain tensor where the DTensor
    redistribution in the embedding's backward needs a DTensor (``'Tensor' object has no
    attribute '_local_tensor'``). A copy of one block's input per forward avoids it; other
    blocks' inputs are not views and pass untouched.
    """

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.graph = torch.compile(forward, backend=BACKEND, fullgraph=True)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, torch.Tensor) and x._is_view():
            x = x.clone()
        return self.graph(x, *args, **kwargs)


@dataclass(frozen=True)
class CompileCounters:
    """Dynamo's work so far in this process: graphs compiled (a recompile is one more) and
    graph breaks. The difference of two readings says what was compiled between them."""

    graphs: int
    graph_breaks: int

    @staticmethod
    def read() -> CompileCounters:
        """The counters now (zero when nothing was ever compiled in this process)."""
        from torch._dynamo.utils import counters

        return CompileCounters(
            graphs=int(counters["stats"]["unique_graphs"]),
            graph_breaks=int(sum(counters["graph_break"].values())),
        )

    def since(self, before: CompileCounters) -> CompileCounters:
        """What was compiled between ``before`` and this reading."""
        return CompileCounters(
            self.graphs - before.graphs,
            self.graph_breaks - before.graph_breaks,
        )
