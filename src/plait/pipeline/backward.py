"""Backward of one stage and microbatch: whole (B), or split into input (I) and weight (W).

Zero-bubble schedules run a stage's backward in two halves: ``I`` computes the gradient
of the stage's inputs (the previous stage is waiting for it), ``W`` the gradients of its
weights later, to fill what would be idle time. ``W`` must not redo ``I``'s work.

How the graph is cut. Call a node of the autograd graph *weight-only* if every path from
it ends at a weight (a leaf that is not a stage input): an ``AccumulateGrad`` of a
parameter, the ``t()`` of a linear layer's weight, ... A *boundary* node is one that is
not weight-only but has a weight-only child: the matmul of a linear layer, a layer norm.
``I`` asks autograd for the gradients of the stage inputs *and* of the edges into every
boundary node, keeping the graph; autograd computes only what leads there, so the
boundary nodes compute their input-side outputs but none of their weight-side ones.
``W`` then runs each boundary node from its captured gradient down to its weights, and
adds the results to ``.grad``: exactly the work ``I`` skipped. (One autograd call per
boundary node: a single call from all of them would also re-run the paths between them.)
When a weight hangs below two boundary nodes (tied weights), ``W`` instead runs one call
from the stage outputs to all weights: correct, but it repeats ``I``'s work.

Gradients ``W`` computes are added to ``.grad`` by hand, so parameter hooks
(``register_post_accumulate_grad_hook``) do not fire for them: data-parallel gradient
reduction for pipelined stages is done explicitly by the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGradWork", "backward_full", "backward_input", "backward_weight"]


def backward_full(
    roots: Sequence[torch.Tensor],
    root_grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
) -> list[torch.Tensor | None]:
    """Backward through the stage: weights accumulate ``.grad`` (their hooks fire) and the
    gradients of ``inputs`` (leaves) are returned."""
    if roots:
        torch.autograd.backward(list(roots), list(root_grads))
    return [x.grad for x in inputs]


@dataclass
class WeightGradWork:
    """What ``W`` needs: per boundary node, its in-edges with their captured gradients."""

    boundaries: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]]
    # (edges into the node, their gradients, the weights below it)


def backward_input(
    roots: Sequence[torch.Tensor],
    root_grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradWork]:
    """``I``: the gradients of ``inputs``, and the captured state for :func:`backward_weight`."""
    graph = _StageGraph(roots, inputs)
    edges = graph.boundary_edges()
    # autograd takes tensors and edges mixed; the stubs only admit one kind per list.
    targets: list[Any] = [*inputs, *edges]
    if not roots or not targets:
        return [None] * len(inputs), WeightGradWork([])
    grads = torch.autograd.grad(
        list(roots), targets, list(root_grads), retain_graph=True, allow_unused=True
    )
    captured = dict(zip(edges, grads[len(inputs) :], strict=True))
    boundaries = []
    for node, node_edges in graph.edges_by_node(edges).items():
        kept = [e for e in node_edges if captured[e] is not None]
        if kept:
            boundaries.append((kept, [captured[e] for e in kept], graph.weights_below(node)))
    if _shares_weights(boundaries):
        # A weight below two boundary nodes (tied weights) is also reachable from the upper
        # one through activations, so per-node calls would count that path twice: fall
        # back to one call from the roots (correct, at the cost of redoing I's work).
        weights = list({id(w): w for b in boundaries for w in b[2]}.values())
        pairs = [(get_gradient_edge(r), g) for r, g in zip(roots, root_grads, strict=True)]
        boundaries = [([e for e, _ in pairs], [g for _, g in pairs], weights)]
    return list(grads[: len(inputs)]), WeightGradWork(boundaries)


def _shares_weights(boundaries: list[tuple[Any, Any, list[torch.Tensor]]]) -> bool:
    seen: set[int] = set()
    for _, _, weights in boundaries:
        ids = {id(w) for w in weights}
        if ids & seen:
            return True
        seen |= ids
    return False


def backward_weight(work: WeightGradWork) -> None:
    """``W``: run each boundary node down to its weights and add the results to ``.grad``."""
    for edges, grads, weights in work.boundaries:
        results: tuple[torch.Tensor | None, ...] = torch.autograd.grad(
            edges, weights, grads, retain_graph=True, allow_unused=True
        )
        for weight, grad in zip(weights, results, strict=True):
            if grad is None:
                continue
            if weight.grad is None:
                weight.grad = grad
            else:
                weight.grad += grad
    work.boundaries.clear()  # drop the graph


class _StageGraph:
    """The autograd graph from a stage's outputs, classified for the I / W split."""

    def __init__(self, roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
        self.roots = [r for r in roots if r.grad_fn is not None]
        self.input_ids = {id(x) for x in inputs}
        self._weight_only: dict[Node, bool] = {}

    def is_weight_only(self, node: Node) -> bool:
        """Every path from ``node`` ends at a weight (iterative: graphs can be deep)."""
        known = self._weight_only.get(node)
        if known is not None:
            return known
        stack = [node]
        while stack:
            top = stack[-1]
            if top in self._weight_only:
                stack.pop()
                continue
            variable = getattr(top, "variable", None)
            if variable is not None:  # AccumulateGrad: a leaf
                self._weight_only[top] = id(variable) not in self.input_ids
                stack.pop()
                continue
            children = _children(top)
            pending = [c for c in children if c not in self._weight_only]
            if pending:
                stack += pending
                continue
            self._weight_only[top] = bool(children) and all(self._weight_only[c] for c in children)
            stack.pop()
        return self._weight_only[node]

    def is_boundary(self, node: Node) -> bool:
        return not self.is_weight_only(node) and any(
            self.is_weight_only(c) for c in _children(node)
        )

    def boundary_edges(self) -> list[GradientEdge]:
        """Every distinct edge (node, output number) leading into a boundary node, in the
        order first met; a weight-only root counts as a boundary of its own."""
        found: dict[tuple[Node, int], GradientEdge] = {}
        seen: set[Node] = set()
        stack: list[tuple[Node, int]] = []
        for r in self.roots:
            assert r.grad_fn is not None
            stack.append((r.grad_fn, r.output_nr))
        while stack:
            node, nr = stack.pop()
            weight_only = self.is_weight_only(node)
            if weight_only or self.is_boundary(node):
                found.setdefault((node, nr), GradientEdge(node, nr))
            if weight_only or node in seen:
                continue
            seen.add(node)
            stack += [
                (c, k)
                for c, k in node.next_functions
                if c is not None and not self.is_weight_only(c)
            ]
        return list(found.values())

    @staticmethod
    def edges_by_node(edges: list[GradientEdge]) -> dict[Node, list[GradientEdge]]:
        grouped: dict[Node, list[GradientEdge]] = {}
        for e in edges:
            grouped.setdefault(e.node, []).append(e)
        return grouped

    def weights_below(self, node: Node) -> list[torch.Tensor]:
        """The weights reached from ``node`` through weight-only children, deduplicated."""
        start = [node] if self.is_weight_only(node) else []
        stack = start + [c for c in _children(node) if self.is_weight_only(c)]
        weights: dict[int, torch.Tensor] = {}
        seen: set[Node] = set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            variable = getattr(n, "variable", None)
            if variable is not None:
                weights.setdefault(id(variable), variable)
            else:
                stack += _children(n)
        return list(weights.values())


def _children(node: Node) -> list[Node]:
    return [c for c, _ in node.next_functions if c is not None]
