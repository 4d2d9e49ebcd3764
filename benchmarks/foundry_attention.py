"""The fit of llm-foundry's Triton attention rate (:data:`plait.plan.stacks.TRITON_SLOWDOWN`).

llm-foundry's published tables (``scripts/train/benchmarking/README.md``) ran its Triton
flash attention, which no cited figure prices on the H100 or the A100. Priced as
FlashAttention-2, every model in both tables was over-predicted more the longer its
sequence (H100: from about 0.97 at 512 tokens to 1.21 at 65,536; A100: from 0.91 to
1.35), which is how a kernel slower than the one priced shows up: attention grows from a
few percent of a step to most of it. So that kernel's rate is fitted here, one factor per
device dividing FlashAttention-2's fractions of the peak, forward and backward alike, on the
rows of those two tables that no validation set counts (:data:`FIT_RUNS`: every row of the
two tables except those in ``benchmarks.published_runs`` (issue 28's set),
``published_holdout`` and ``published_fresh``, and the sizes the planner has no shape for).

The objective is each device's mean squared ``log(predicted / published)`` over its rows,
with the llm-foundry stack's scale and the Hopper scale refitted at each trial (they are
fitted on llm-foundry's A100 and H100 calibration rows, whose attention the factor moves
too); the other stacks' constants do not enter llm-foundry's predictions. A golden-section
search per device (the A100 first: the Hopper scale depends on the stack scale fitted
there)::

    .venv/bin/python -m benchmarks.foundry_attention

prints the fitted factors beside :data:`~plait.plan.stacks.TRITON_SLOWDOWN` and each row's
ratio with the stated factors and priced as FlashAttention-2 (factor 1).
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator

from benchmarks.plan_published import published_table
from benchmarks.published_runs import FOUNDRY_A100_80, FOUNDRY_H100, foundry_run
from plait.plan import calibration, compute_time, roofline, stacks
from plait.plan.calibration import PublishedRun

__all__ = ["FIT_RUNS", "fit", "objective", "triton_slowdown"]

# Columns as the README's: size, sequence, GPUs, MFU %, micro-batch, accumulations, global
# batch, tokens/s per GPU, activation checkpointing, NumParams.
_H100_ROWS = """
30b 4096 8 35.86 1 21 168 1802 1 29989894144
30b 2048 16 43.07 10 3 480 2263 1 29975214080
30b 2048 8 38.11 3 21 504 2002 1 29975214080
30b 1024 8 38.76 6 21 1008 2084 1 29967874048
13b 32768 8 31.68 1 3 24 1976 1 13011240960
13b 16384 8 35.55 3 3 72 2985 1 12927354880
13b 2048 32 39.95 2 1 64 4811 0 12853954560
13b 2048 16 39.58 2 1 32 4767 0 12853954560
13b 2048 8 39.79 2 1 16 4792 0 12853954560
13b 1024 8 44.27 40 3 960 5502 1 12848711680
7b 65536 8 28.59 1 2 16 1956 1 6918905856
7b 32768 8 30.94 2 2 32 3318 1 6784688128
7b 4096 8 40.42 16 2 256 8611 1 6667247616
7b 1024 8 42.83 64 2 1024 10203 1 6654664704
3b 65536 8 26.81 1 2 16 3262 1 2814366720
3b 32768 8 28.84 3 6 144 5873 1 2730480640
3b 16384 8 36.34 1 6 48 11152 0 2688537600
3b 4096 8 42.31 5 6 240 20964 0 2657080320
3b 2048 32 41.7 6 3 576 23021 0 2651837440
3b 2048 16 43.73 10 3 480 24142 0 2651837440
3b 1024 8 46.2 20 6 960 27046 0 2649216000
3b 512 8 46.32 40 6 1920 27965 0 2647905280
1b 65536 8 26.34 1 2 16 5506 1 1445974016
1b 16384 8 35.22 2 4 64 19649 0 1345310720
1b 8192 8 37.73 3 4 96 29157 0 1328533504
1b 4096 8 40.26 7 4 224 38535 0 1320144896
1b 2048 32 41.52 20 1 640 45130 0 1315950592
1b 2048 16 42.36 20 1 320 46037 0 1315950592
1b 2048 8 41.82 14 1 112 45455 0 1315950592
1b 1024 8 41.95 18 4 576 48910 0 1313853440
1b 512 8 43.21 56 4 1792 52275 0 1312804864
"""
_A100_ROWS = """
30b 8192 8 39.38 1 21 168 574 1 30019254272
30b 4096 8 51.37 1 21 168 814 1 29989894144
30b 1024 8 55.82 6 21 1008 946 1 29967874048
30b 512 8 56.4 12 21 2016 967 1 29964204032
13b 16384 8 54.07 3 3 72 1431 1 12927354880
13b 8192 8 56.07 5 3 120 1795 1 12885411840
13b 4096 8 57.62 10 3 240 2060 1 12864440320
13b 1024 8 59.48 40 3 960 2330 1 12848711680
7b 65536 8 46.97 1 2 16 1013 1 6918905856
7b 32768 8 49.46 2 2 32 1672 1 6784688128
7b 16384 8 51.96 4 2 64 2453 1 6717579264
7b 4096 8 54.84 16 2 256 3684 1 6667247616
7b 1024 8 58.01 64 2 1024 4357 1 6654664704
3b 65536 8 46.05 1 2 16 1767 1 2814366720
3b 32768 8 47.18 3 6 144 3029 1 2730480640
3b 16384 8 57.13 1 6 48 5529 0 2688537600
3b 4096 8 60.53 5 6 240 9457 0 2657080320
3b 1024 8 62.73 20 6 960 11580 0 2649216000
3b 512 8 63.71 40 6 1920 12127 0 2647905280
1b 65536 8 46.18 1 2 16 3044 1 1445974016
1b 32768 8 55.52 1 4 32 6275 0 1378865152
1b 16384 8 56.6 2 4 64 9956 0 1345310720
1b 8192 8 56.69 3 4 96 13814 0 1328533504
1b 4096 8 59.0 7 4 224 17807 0 1320144896
1b 1024 8 60.15 18 4 576 22112 0 1313853440
1b 512 8 60.68 56 4 1792 23148 0 1312804864
"""


def _rows(table: str, text: str) -> tuple[PublishedRun, ...]:
    out = []
    for line in text.split("\n"):
        if not line:
            continue
        size, seq, gpus, mfu, micro, accum, batch, tokens, ac, params = line.split()
        out.append(
            foundry_run(
                table,
                size,
                int(seq),
                int(gpus),
                float(mfu),
                int(micro),
                int(accum),
                int(batch),
                float(tokens),
                ac == "1",
                int(params),
                role="calibration",  # fitted to: never counted as a prediction
            )
        )
    return tuple(out)


FIT_RUNS: dict[str, tuple[PublishedRun, ...]] = {
    "h100": _rows(FOUNDRY_H100, _H100_ROWS),
    "a100": _rows(FOUNDRY_A100_80, _A100_ROWS),
}
"""Per device, the rows the factor is fitted on (module docstring)."""


@contextlib.contextmanager
def triton_slowdown(chip: str, factor: float) -> Iterator[None]:
    """Price llm-foundry's attention on ``chip`` at ``factor`` (its scales refitted), and
    restore every constant after."""
    fa2 = stacks.ATTENTION[("fa2", chip)]
    tables = (
        stacks.ATTENTION,
        stacks.TRITON_SLOWDOWN,
        compute_time.STACK_SCALE,
        compute_time.DEVICE_SCALE,
    )
    kept = [dict(table) for table in tables]
    try:
        stacks.TRITON_SLOWDOWN[chip] = factor
        stacks.ATTENTION[("triton", chip)] = (fa2[0] / factor, fa2[1] / factor)
        _refit()
        yield
    finally:
        for table, saved in zip(tables, kept, strict=True):
            table.clear()
            table.update(saved)
        _clear_caches()


def _clear_caches() -> None:
    roofline.block_kernels.cache_clear()  # priced once per shape: the rates changed
    roofline.head_kernels.cache_clear()


def _refit() -> None:
    _clear_caches()
    run = next(r for r in calibration.CALIBRATION_RUNS if r.software.kernels == "llm-foundry")
    compute_time.STACK_SCALE.update(calibration.calibrate_stacks((run,)))
    compute_time.DEVICE_SCALE.update(calibration.calibrate_devices())


def ratios(chip: str) -> list[float]:
    """Predicted over published throughput of ``chip``'s fitting rows, as priced now."""
    return [row.ratio for row in published_table(FIT_RUNS[chip])]


def objective(chip: str, factor: float) -> float:
    """Mean squared ``log(predicted / published)`` over ``chip``'s rows at ``factor``."""
    with triton_slowdown(chip, factor):
        logs = [math.log(r) for r in ratios(chip)]
    return sum(x * x for x in logs) / len(logs)


def fit(chip: str, low: float = 1.0, high: float = 2.5, tol: float = 0.005) -> float:
    """The factor minimizing :func:`objective` on ``chip`` (golden-section search)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = low, high
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = objective(chip, c), objective(chip, d)
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = objective(chip, c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = objective(chip, d)
    return (a + b) / 2


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    for chip in ("a100", "h100"):
        fitted = fit(chip)
        stated = stacks.TRITON_SLOWDOWN[chip]
        print(f"{chip}: fitted {fitted:.3f}, stated {stated}")
        with triton_slowdown(chip, 1.0):
            as_fa2 = ratios(chip)
        print("| row | as FlashAttention-2 | stated factor |\n|---|---:|---:|")
        for run, old, new in zip(FIT_RUNS[chip], as_fa2, ratios(chip), strict=True):
            print(f"| {run.name} | {old:.2f} | {new:.2f} |")
        rms = math.sqrt(objective(chip, stated))
        print(f"rms log error at the stated factor: {rms:.3f}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
