"""``plait plan`` against published runs it was (mostly) not tuned on: issue 28's table.

Every run of :mod:`benchmarks.published_runs` (Megatron-LM on A100 and H100, torchtitan,
llm-foundry, Meta's Llama 3) is evaluated with :func:`plait.plan.evaluate` at exactly its
published layout, and printed as a Markdown table beside the published MFU, converted to
plait's definition (:func:`benchmarks.published_runs.plait_mfu`), followed by the
statistics over the validation rows::

    .venv/bin/python -m benchmarks.plan_published                 # print the table
    .venv/bin/python -m benchmarks.plan_published --update-readme # and rewrite it in README.md

Rows marked ``calibration`` are those the cost model's constants may be fitted to; every
``validation`` row is a prediction. Rows whose run used what the planner does not model
(Float8, ``torch.compile``, async TP) are listed with the reason and left out of the
statistics.

Each run's device is its preset (``h100``: 989 TFLOP/s bf16; ``a100``: 312) with the
published GPU's memory (:func:`plait.plan.devices.override`: memory only decides whether a
layout fits, never the predicted speed). Data parallelism runs as the source ran it:
FSDP as ``dp_shard``; DDP as ``dp_replicate``; Megatron's distributed optimizer as
``dp_replicate`` with ZeRO-1 (a :class:`plait.plan.spec.PlanLayout`), and Megatron runs
with Megatron's activation recipe.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.published_runs import (
    AUTOMODEL,
    FMS_FSDP,
    FOUNDRY,
    LIT_GPT,
    LLAMA3,
    MAXTEXT,
    MEGATRON,
    MEGATRON_DEEPSPEED,
    NEMO,
    RUNS,
    TORCHTITAN,
    PublishedRun,
    plait_mfu,
)
from plait.layout import LAYOUT_FIELDS
from plait.plan import evaluate
from plait.plan.devices import device, node_network, override
from plait.plan.models import param_counts
from plait.plan.search import describe
from plait.plan.spec import DeviceSpec, Layout, PlanLayout

__all__ = [
    "README_END",
    "README_START",
    "Row",
    "Series",
    "Stats",
    "format_report",
    "format_stats",
    "format_table",
    "main",
    "planner_device",
    "planner_layout",
    "published_table",
    "series_trends",
    "stats",
    "update_readme",
]

_GIB = 2.0**30


def planner_device(run: PublishedRun) -> DeviceSpec:
    """``run``'s device preset with the published GPU's memory and, where the source states
    it, its network (``node_network_gbps`` over the node's GPUs)."""
    spec = override(device(run.device), memory=run.memory_gib * _GIB)
    return node_network(spec, run.node_network_gbps)


#: Each code base's activation recipe (``plait.plan.memory.RECIPE_KEEPS``).
#: What each code base keeps for backward (``plait.plan.memory.RECIPE_KEEPS``): NeMo and
#: Megatron-DeepSpeed are Megatron's; fms-fsdp, NeMo AutoModel, MaxText and lit-gpt keep what
#: eager FSDP PyTorch keeps (torchtitan's).
RECIPE_OF = {
    MEGATRON: "megatron",
    TORCHTITAN: "torchtitan",
    FOUNDRY: "foundry",
    LLAMA3: "llama3",
    NEMO: "megatron",
    MEGATRON_DEEPSPEED: "megatron",
    FMS_FSDP: "torchtitan",
    AUTOMODEL: "torchtitan",
    MAXTEXT: "torchtitan",
    LIT_GPT: "torchtitan",
}


def planner_layout(run: PublishedRun) -> Layout:
    """The layout the planner evaluates: ``run.layout``, as a
    :class:`~plait.plan.spec.PlanLayout` with the run's ZeRO stage and its framework's
    activation recipe (what it keeps for backward: :data:`RECIPE_OF`)."""
    fields = {name: getattr(run.layout, name) for name in LAYOUT_FIELDS}
    return PlanLayout(**fields, zero=run.zero, recipe=RECIPE_OF[run.code_base])


@dataclass(frozen=True)
class Row:
    """A published run and the planner's prediction for it."""

    run: PublishedRun
    mfu: float  # predicted, plait's definition
    tokens_per_s: float  # predicted, per GPU
    memory_gib: float  # predicted peak of the largest rank
    fits: bool  # within 90% of the published GPU's memory

    @property
    def published_mfu(self) -> float:
        return plait_mfu(self.run)

    @property
    def ratio(self) -> float:
        """Predicted over published MFU (the same FLOP count on both sides)."""
        return self.mfu / self.published_mfu

    @property
    def counted(self) -> bool:
        """A validation row the planner models: one the statistics count."""
        return self.run.role == "validation" and not self.run.excluded


def published_table(runs: tuple[PublishedRun, ...] = RUNS) -> list[Row]:
    """The planner's prediction of each run (``evaluate``, default efficiency)."""
    out = []
    for run in runs:
        got = evaluate(
            run.model, planner_layout(run), run.work, planner_device(run), software=run.software
        )
        t = got.timing
        out.append(Row(run, t.mfu, t.tokens_per_s_per_device, got.memory.total / _GIB, got.fits))
    return out


@dataclass(frozen=True)
class Series:
    """One source's size series: the sign of the MFU change from its smallest model to its
    largest, published and predicted."""

    name: str
    smallest: str
    largest: str
    published: float  # published MFU of the largest minus the smallest's
    predicted: float

    @property
    def agrees(self) -> bool:
        return (self.published > 0) == (self.predicted > 0)


def _params(row: Row) -> float:
    return float(param_counts(row.run.model).total(row.run.model.layers))


def series_trends(rows: list[Row]) -> list[Series]:
    """Every size series among the modelled rows (calibration rows included: the trend is
    the cost model's shape, not a fit), smallest to largest model by parameter count."""
    by_name: dict[str, list[Row]] = {}
    for r in rows:
        if r.run.series and not r.run.excluded:
            by_name.setdefault(r.run.series, []).append(r)
    out = []
    for name, members in by_name.items():
        if len(members) < 2:
            continue
        small, large = min(members, key=_params), max(members, key=_params)
        out.append(
            Series(
                name,
                small.run.size,
                large.run.size,
                large.published_mfu - small.published_mfu,
                large.mfu - small.mfu,
            )
        )
    return out


@dataclass(frozen=True)
class Stats:
    """The validation rows' agreement (issue 28's acceptance measures)."""

    rows: int
    code_bases: tuple[str, ...]
    median: float  # median |ratio - 1|
    worst: float  # largest |ratio - 1|
    worst_row: str
    series: tuple[Series, ...]


def stats(rows: list[Row]) -> Stats:
    """Statistics over the counted rows (validation, modelled)."""
    counted = [r for r in rows if r.counted]
    errors = [abs(r.ratio - 1) for r in counted]
    worst = max(counted, key=lambda r: abs(r.ratio - 1))
    return Stats(
        rows=len(counted),
        code_bases=tuple(sorted({r.run.code_base for r in counted})),
        median=statistics.median(errors),
        worst=max(errors),
        worst_row=worst.run.name,
        series=tuple(series_trends(rows)),
    )


def _sources(rows: list[Row]) -> list[str]:
    """The distinct sources, in row order (the table's footnotes)."""
    out: list[str] = []
    for r in rows:
        if r.run.source not in out:
            out.append(r.run.source)
    return out


def _layout_text(run: PublishedRun) -> str:
    text = describe(run.layout)
    if run.zero:
        text = text.replace("dp_replicate", f"dp_replicate(ZeRO-{run.zero})")
    if run.layout.tp > 1 and not run.layout.sequence_parallel:
        text += " no-SP"
    local = run.work.global_batch // run.layout.dp
    return f"{text}, local batch {local} x {run.work.seq_len}"


def _published_text(run: PublishedRun) -> str:
    unit = {"tflops": "TFLOP/s", "tokens": "tok/s", "mfu": "MFU"}[run.metric]
    value = f"{run.value:,.4g}" if run.metric != "tokens" else f"{run.value:,.0f}"
    text = f"{value} {unit}"
    if run.stated_mfu:
        text += f" ({run.stated_mfu:.1%})"
    return text


def format_table(rows: list[Row]) -> str:
    """``rows`` as a Markdown table, then its sources (no trailing newline)."""
    sources = _sources(rows)
    lines = [
        "| # | run | role | source | GPUs | layout | published (as stated) "
        "| published MFU | predicted MFU | ratio | notes |",
        "|---|---|---|---|---:|---|---|---:|---:|---:|---|",
    ]
    for i, r in enumerate(rows, 1):
        run = r.run
        notes = []
        if run.excluded:
            notes.append(f"not modelled: {run.excluded}")
        notes.append(f"{run.device} {run.memory_gib:.0f} GB, {run.dp_flavour}")
        if not r.fits:
            notes.append(f"predicted {r.memory_gib:.0f} GiB, over 90% of memory")
        lines.append(
            f"| {i} | {run.name} | {run.role} | [{sources.index(run.source) + 1}] "
            f"| {run.gpus:,} | {_layout_text(run)} | {_published_text(run)} "
            f"| {r.published_mfu:.1%} | {r.mfu:.1%} | {r.ratio:.2f} | {'; '.join(notes)} |"
        )
    lines.append("")
    lines.extend(f"{i}. {s}" for i, s in enumerate(sources, 1))
    return "\n".join(lines)


def format_stats(s: Stats) -> str:
    """The statistics as Markdown (no trailing newline)."""
    lines = [
        f"Validation rows the planner models: {s.rows}, from {len(s.code_bases)} code bases "
        f"({', '.join(s.code_bases)}). Median |predicted / published MFU - 1|: "
        f"**{s.median:.2f}**; worst: **{s.worst:.2f}** ({s.worst_row}).",
        "",
        "| size series | smallest -> largest | published change | predicted change | sign |",
        "|---|---|---:|---:|---|",
    ]
    for t in s.series:
        lines.append(
            f"| {t.name} | {t.smallest} -> {t.largest} | {t.published:+.1%} "
            f"| {t.predicted:+.1%} | {'right' if t.agrees else 'wrong'} |"
        )
    return "\n".join(lines)


def format_report(rows: list[Row]) -> str:
    """The table, its sources and the statistics: what the README holds."""
    return f"{format_table(rows)}\n\n{format_stats(stats(rows))}"


README_START = "<!-- plan-published: start (python -m benchmarks.plan_published) -->"
README_END = "<!-- plan-published: end -->"


def update_readme(path: Path, table: str) -> bool:
    """Replace the text between :data:`README_START` and :data:`README_END` in ``path``
    with ``table``; True when the file changed. ValueError when the markers are missing."""
    text = path.read_text()
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"{path}: no {README_START!r} ... {README_END!r} block to update")
    head = text[: start + len(README_START)]
    new = f"{head}\n{table}\n{text[end:]}"
    if new == text:
        return False
    path.write_text(new)
    return True


def main(argv: list[str] | None = None) -> int:
    """Print the table and statistics; with ``--update-readme``, also write them into
    README.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--update-readme",
        action="store_true",
        help="rewrite the table between the plan-published markers of README.md",
    )
    args = parser.parse_args(argv)
    report = format_report(published_table())
    print(report)
    if args.update_readme:
        readme = Path(__file__).resolve().parent.parent / "README.md"
        changed = update_readme(readme, report)
        print(f"{readme}: {'updated' if changed else 'already up to date'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
