"""``plait plan`` against published runs: torchtitan's Llama 3.1 tables on H100.

Every row of ``shared/reference/published_runs.md`` that the planner can express is
evaluated with :func:`plait.plan.evaluate` at exactly the published layout, and printed as
a Markdown table beside the published figures::

    .venv/bin/python -m benchmarks.plan_published                 # print the table
    .venv/bin/python -m benchmarks.plan_published --update-readme # and rewrite it in README.md

Source of the figures: pytorch/torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md``
(Dec 2024), as copied into the reference file. Row 1 is the run the cost model's one
constant is fitted to (:mod:`plait.plan.calibration`); every other row is a prediction.

The published hosts have H100s with 96 GB of HBM2e (500 W) rather than the 80 GB of the
``h100`` preset, so the device is the preset with its memory overridden to 96 GiB
(:func:`plait.plan.devices.override`); memory only decides whether a layout fits, not its
predicted memory or speed. Published memory is torchtitan's peak *reserved* memory (the
caching allocator's pool), which the planner does not model: it predicts the bytes of the
tensors alive at the peak.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from plait.plan import Layout, Workload, device, evaluate, preset
from plait.plan.devices import override
from plait.plan.search import describe
from plait.plan.spec import DeviceSpec

__all__ = [
    "DEVICE",
    "PUBLISHED",
    "README_END",
    "README_START",
    "SOURCE",
    "Published",
    "Row",
    "format_table",
    "main",
    "published_table",
    "update_readme",
]

_GIB = 2.0**30

SOURCE = (
    "pytorch/torchtitan, `benchmarks/llama3_h100_202412_torchtitan.md` (Dec 2024), "
    "tables 1 to 5, as copied in `shared/reference/published_runs.md`"
)

DEVICE: DeviceSpec = override(device("h100"), memory=96 * _GIB)
"""The published hosts' H100: the preset (989 TFLOP/s bf16, NVLink 450 GB/s, 50 GB/s RDMA
per GPU) with 96 GiB of memory instead of 80."""

# Notes name what the run used that the planner does not model (README explains each).
_COMPILE = "torch.compile"
_FLOAT8 = "Float8"
_ASYNC_TP = "async TP"
_PP_DEFAULTS = "microbatches and stages per rank assumed (torchtitan's defaults)"


@dataclass(frozen=True)
class Published:
    """One published configuration: what ran, and what it measured (per GPU)."""

    run: str  # table and configuration, as the source names them
    model: str  # a plait.plan preset
    layout: Layout
    work: Workload
    tokens_per_s: float  # published tokens/s per GPU
    memory_gib: float  # published peak memory (GiB, reserved)
    notes: tuple[str, ...]  # what the run used that the planner does not model


@dataclass(frozen=True)
class Row:
    """A published configuration and the planner's prediction for it."""

    published: Published
    tokens_per_s: float  # predicted tokens/s per GPU
    memory_gib: float  # predicted peak memory of the largest rank (GiB)
    fits: bool  # the prediction fits in 90% of DEVICE's memory

    @property
    def tokens_diff(self) -> float:
        """Prediction minus publication, in % of the publication."""
        return 100.0 * (self.tokens_per_s / self.published.tokens_per_s - 1.0)

    @property
    def memory_diff(self) -> float:
        """Prediction minus publication, in % of the publication."""
        return 100.0 * (self.memory_gib / self.published.memory_gib - 1.0)


def _fsdp8_8b(run: str, tps: float, mem: float, notes: tuple[str, ...]) -> Published:
    # Table 1: 8 GPUs, local batch 2 (global 16), selective checkpointing, sequence 8192.
    layout = Layout(dp_shard=8, ac="selective")
    return Published(run, "llama3-8b", layout, Workload(8192, 16), tps, mem, notes)


def _fsdp128_8b(run: str, tps: float, mem: float, notes: tuple[str, ...]) -> Published:
    # Table 3: 128 GPUs, local batch 2 (global 256), selective checkpointing.
    layout = Layout(dp_shard=128, ac="selective")
    return Published(run, "llama3-8b", layout, Workload(8192, 256), tps, mem, notes)


def _fsdp_tp_70b(run: str, tps: float, mem: float, notes: tuple[str, ...]) -> Published:
    # Table 4: 256 GPUs as FSDP 32 x TP 8, local batch 16 (global 512), full checkpointing.
    layout = Layout(dp_shard=32, tp=8, ac="full")
    return Published(run, "llama3-70b", layout, Workload(8192, 512), tps, mem, notes)


_SELECTIVE = "calibration row; torchtitan's selective AC keeps attention's output"
_T2 = "torch.compile, Float8; CP 1 of a CP run"
_T45 = (_COMPILE, _FLOAT8)

PUBLISHED: tuple[Published, ...] = (
    _fsdp8_8b("T1 8B FSDP 8", 5762, 82.4, (_SELECTIVE,)),
    _fsdp8_8b("T1 8B FSDP 8 + compile", 6667, 77.0, (_COMPILE,)),
    _fsdp8_8b("T1 8B FSDP 8 + compile + Float8", 8532, 76.8, (_COMPILE, _FLOAT8)),
    Published(
        "T2 8B FSDP 8, CP 1",
        "llama3-8b",
        Layout(dp_shard=8, ac="full"),
        Workload(32768, 8),
        3890,
        83.9,
        (_T2,),
    ),
    _fsdp128_8b("T3 8B FSDP 128", 5605, 67.0, ()),
    _fsdp128_8b("T3 8B FSDP 128 + compile", 6514, 62.0, (_COMPILE,)),
    _fsdp128_8b("T3 8B FSDP 128 + compile + Float8", 8380, 61.8, (_COMPILE, _FLOAT8)),
    _fsdp_tp_70b("T4 70B FSDP 32 x TP 8", 829, 71.9, _T45),
    _fsdp_tp_70b("T4 70B FSDP 32 x TP 8 + async TP", 876, 67.6, (*_T45, _ASYNC_TP)),
    Published(
        "T5 405B PP 8 x FSDP 8 x TP 8, 1F1B",
        "llama3-405b",
        Layout(dp_shard=8, tp=8, pp=8, schedule="1F1B", microbatches=8, ac="full"),
        Workload(8192, 256),
        100,
        82.5,
        (*_T45, _ASYNC_TP, _PP_DEFAULTS),
    ),
    Published(
        "T5 405B PP 8 x FSDP 8 x TP 8, interleaved 1F1B",
        "llama3-405b",
        Layout(
            dp_shard=8,
            tp=8,
            pp=8,
            schedule="Interleaved1F1B",
            stages_per_rank=2,
            microbatches=16,
            ac="full",
        ),
        Workload(8192, 256),
        128,
        72.7,
        (*_T45, _ASYNC_TP, _PP_DEFAULTS),
    ),
)
"""Every configuration of tables 1 to 5 the planner can express (table 2's CP 2, 4 and 8
rows need context parallelism, which it does not model)."""


def published_table(rows: tuple[Published, ...] = PUBLISHED) -> list[Row]:
    """The planner's prediction of each published configuration (``evaluate`` on
    :data:`DEVICE`, the default efficiency)."""
    out = []
    for p in rows:
        got = evaluate(preset(p.model), p.layout, p.work, DEVICE)
        out.append(Row(p, got.timing.tokens_per_s_per_device, got.memory.total / _GIB, got.fits))
    return out


def _layout_text(p: Published) -> str:
    gpus = p.layout.world
    local = p.work.global_batch // p.layout.dp
    return f"{gpus} GPUs: {describe(p.layout)}, local batch {local} x {p.work.seq_len}"


def format_table(rows: list[Row]) -> str:
    """``rows`` as a Markdown table (one line per row, a header, no trailing newline)."""
    lines = [
        "| # | run | layout | published tok/s/GPU (GiB) | predicted tok/s/GPU (GiB) "
        "| diff tok/s | diff memory | notes |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for i, r in enumerate(rows, 1):
        p = r.published
        notes = ", ".join(p.notes) or "-"
        if not r.fits:
            notes += "; predicted over 90% of 96 GiB"
        lines.append(
            f"| {i} | {p.run} | {_layout_text(p)} "
            f"| {p.tokens_per_s:,.0f} ({p.memory_gib:.1f}) "
            f"| {r.tokens_per_s:,.0f} ({r.memory_gib:.1f}) "
            f"| {round(r.tokens_diff):+d}% | {round(r.memory_diff):+d}% | {notes} |"
        )
    return "\n".join(lines)


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
    """Print the table; with ``--update-readme``, also write it into README.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--update-readme",
        action="store_true",
        help="rewrite the table between the plan-published markers of README.md",
    )
    args = parser.parse_args(argv)
    table = format_table(published_table())
    print(table)
    if args.update_readme:
        readme = Path(__file__).resolve().parent.parent / "README.md"
        changed = update_readme(readme, table)
        print(f"{readme}: {'updated' if changed else 'already up to date'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
