"""Where the planner has missed published runs by more than usual, said beside a plan.

The cost model is checked against published runs (``benchmarks/published_runs.py``, the
fitting set; ``published_holdout.py`` and ``published_fresh.py``, never fitted to;
``docs/plan.md``, "Step time"): most are predicted within a few percent, but some kinds of
run are missed further, for reasons not modelled (``docs/plan.md``, "Not modelled"). When
the layout planned is of such a kind (:data:`REGIMES`), ``plait plan`` says how far off the
planner was on the counted published runs of that kind, as the range of predicted over
published throughput, so a plan there is read with that error in mind.

The figures are what the benchmarks give today: ``tests/test_plan_accuracy.py`` evaluates
every counted published run a regime covers and holds each regime's range and count to
them, so a change of the cost model that moves them must restate them here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from plait.plan.spec import Layout, ModelSpec, Workload

__all__ = ["REGIMES", "Regime", "accuracy_notes"]


@dataclass(frozen=True)
class Regime:
    """A kind of run the planner misses further than most.

    ``covers(layout, model, work)``: whether a run is of this kind; ``low`` / ``high``:
    the smallest and largest predicted / published throughput over the ``runs`` counted
    published runs it covers; ``what``: the kind, in words; ``why``: what is known of the
    miss."""

    name: str
    covers: Callable[[Layout, ModelSpec, Workload], bool]
    runs: int
    low: float
    high: float
    what: str
    why: str

    def note(self) -> str:
        return (
            f"accuracy: {self.what}: the {self.runs} published runs of this kind were "
            f"predicted at {self.low:.2f}-{self.high:.2f}x their tokens/s ({self.why})"
        )


REGIMES: tuple[Regime, ...] = (
    Regime(
        "long-context",
        lambda layout, model, work: layout.cp > 1 and work.seq_len >= 65536,
        runs=6,
        low=0.92,
        high=1.28,
        what="context parallelism at 64k tokens or more",
        why="torchtitan's, 64k-256k tokens: the longer, the more over-predicted; not "
        "understood, docs/plan.md 'Not modelled'",
    ),
    Regime(
        "moe",
        lambda layout, model, work: model.experts > 0,
        runs=2,
        low=0.86,
        high=0.89,
        what="a mixture of experts",
        why="Qwen3 MoE on H100, NeMo AutoModel and Megatron-Core: under-predicted",
    ),
)
"""The kinds of run the planner misses further than most (module docstring)."""


def accuracy_notes(layout: Layout, model: ModelSpec, work: Workload) -> list[str]:
    """One line per regime of :data:`REGIMES` that covers this run."""
    return [r.note() for r in REGIMES if r.covers(layout, model, work)]
