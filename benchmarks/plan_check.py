"""The planner's step time against real ``plait train`` runs on this machine's CPU.

A benchmark, not a test (issue 16: predicted step time within 25% of the measured one for
the same layouts). It

1. measures this machine as ``plait train`` uses it (:func:`plait.plan.measure.measure_cpu`:
   matrix-multiply FLOP/s of one worker at its thread count, gloo bandwidth and latency,
   the optimizer's throughput), once per world size, with all workers running at once;
2. runs real ``plait train`` for every layout (a subprocess, fresh run directory), reads
   ``step_time`` from its metrics, drops the first ``--warmup`` steps and takes the median;
   layouts are interleaved, ``--repeats`` rounds, each round in a rotated order, and the
   reported time is the median over rounds (this machine is small and shared: one timing
   means little);
3. predicts each with the planner (:func:`plait.plan.train_plan.plan_of_config` of the
   resolved configuration on the measured device) and prints measured, predicted, their
   ratio and whether it is within 25%.

Run from the repository root::

    .venv/bin/python -m benchmarks.plan_check [--steps 7] [--repeats 2] [--json out.json]

``--predict-only`` skips the runs (the machine is still measured).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from plait.plan.measure import Shapes, measure_cpu
from plait.plan.models import gpt, param_counts
from plait.plan.spec import DeviceSpec
from plait.plan.train_plan import plan_of_config
from plait.train.cli import build_config
from plait.train.metrics import read_metrics
from plait.train.resolve import resolve
from plait.train.worker import threads_per_worker

MODEL = ["--n-layer", "4", "--d-model", "256", "--n-head", "4", "--seq-len", "128"]
BATCH = 16
BF16_BATCH = 4
TOLERANCE = 0.25


@dataclass(frozen=True)
class Case:
    """One layout: a name, its world size, and its ``plait train`` flags."""

    name: str
    nproc: int
    flags: tuple[str, ...]


CASES = [
    Case("fsdp", 2, ("--dp-shard", "2")),
    Case("replicate", 2, ("--dp-replicate", "2", "--dp-shard", "1")),
    Case("fsdp ac=full", 2, ("--dp-shard", "2", "--ac", "full")),
    Case("fsdp ac=selective", 2, ("--dp-shard", "2", "--ac", "selective")),
    # bf16 matrix products are slow on CPUs without bf16 instructions: a smaller batch.
    Case(
        f"fsdp bf16 (batch {BF16_BATCH})",
        2,
        ("--dp-shard", "2", "--mp", "bf16", "--batch-size", str(BF16_BATCH)),
    ),
    Case("fsdp", 4, ("--dp-shard", "4")),
    Case("hsdp 2x2", 4, ("--dp-replicate", "2", "--dp-shard", "2")),
    Case("replicate", 4, ("--dp-replicate", "4", "--dp-shard", "1")),
    Case("pp2 x fsdp2 1F1B", 4, ("--pp", "2", "--dp-shard", "2", "--schedule", "1F1B")),
    Case("pp2 x fsdp2 GPipe", 4, ("--pp", "2", "--dp-shard", "2", "--schedule", "GPipe")),
]


def _flags(case: Case, steps: int, run_dir: str) -> list[str]:
    return [
        *MODEL,
        "--batch-size",
        str(BATCH),
        "--steps",
        str(steps),
        "--nproc",
        str(case.nproc),
        "--device",
        "cpu",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--ckpt-every",
        "0",
        "--keep",
        "1",
        *case.flags,
        "--run-dir",
        run_dir,
    ]


def _config(case: Case) -> Any:
    """The resolved configuration ``plait train`` runs for ``case``."""
    args = _flags(case, 1, "unused")
    flags = {
        a[2:].replace("-", "_"): int(b) if b.isdigit() else b
        for a, b in zip(args[::2], args[1::2], strict=True)
    }
    return resolve(build_config(flags))


def run_once(case: Case, steps: int, warmup: int, timeout: float) -> float:
    """Median ``step_time`` of one fresh ``plait train`` run of ``case``, its first
    ``warmup`` steps dropped. RuntimeError with the output's tail if the run fails."""
    run_dir = tempfile.mkdtemp(prefix="plait-plan-check-")
    try:
        cmd = [str(Path(sys.executable).parent / "plait"), "train", *_flags(case, steps, run_dir)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode:
            tail = (done.stdout + done.stderr)[-2000:]
            raise RuntimeError(f"{case.name} on {case.nproc} failed ({done.returncode}):\n{tail}")
        times = [r["step_time"] for r in read_metrics(run_dir) if "step_time" in r]
        return statistics.median(times[warmup:])
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _shapes(nproc: int) -> Shapes:
    """Measurement shapes of the benchmark model: tokens of one rank's microbatch in the
    data-parallel layouts (bf16: in the bf16 case's), the model's width, one rank's
    parameter elements under FSDP."""
    model = gpt(4, 4, 256, 128)
    total = param_counts(model).total(model.layers)
    return Shapes(
        tokens=BATCH * 128 // nproc,
        d_model=256,
        params=total // nproc,
        bf16_tokens=BF16_BATCH * 128 // nproc,
    )


def _median_device(measured: list[DeviceSpec]) -> DeviceSpec:
    """Field by field, the median of the measurements of one world size."""
    first = measured[0]
    values: dict[str, Any] = {}
    for name, value in asdict(first).items():
        if isinstance(value, float):
            values[name] = statistics.median(getattr(m, name) for m in measured)
        else:
            values[name] = value
    return DeviceSpec(**values)


def _row(case: Case, measured: list[float], device: DeviceSpec) -> dict[str, Any]:
    timing = plan_of_config(_config(case), device).timing
    median = statistics.median(measured) if measured else float("nan")
    ratio = timing.step_time / median if measured else float("nan")
    return {
        "layout": case.name,
        "ranks": case.nproc,
        "flags": " ".join(case.flags),
        "measured_s": median,
        "runs_s": measured,
        "predicted_s": timing.step_time,
        "predicted_compute_s": timing.compute,
        "predicted_exposed_comm_s": timing.exposed_comm,
        "predicted_host_s": timing.host,
        "ratio": ratio,
        "within": bool(measured) and abs(ratio - 1) <= TOLERANCE,
    }


def _device_row(nproc: int, d: DeviceSpec) -> dict[str, Any]:
    return {
        "ranks": nproc,
        "threads_per_worker": threads_per_worker(nproc),
        "fp32_gflops": d.flops_fp32 / 1e9,
        "bf16_gflops": d.flops / 1e9,
        "gloo_MBps_per_rank": d.intra_node_bw / 1e6,
        "latency_us": d.latency * 1e6,
        "update_Melems_per_s": d.update_rate / 1e6,
    }


def _table(devices: dict[int, DeviceSpec], rows: list[dict[str, Any]]) -> str:
    lines = [
        "machine (per worker, all workers running at once; medians over rounds):",
        "| ranks | threads | fp32 GFLOP/s | bf16 GFLOP/s | gloo MB/s per rank | "
        "latency us | optimizer M elem/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, d in devices.items():
        r = _device_row(n, d)
        lines.append(
            f"| {n} | {r['threads_per_worker']} | {r['fp32_gflops']:.1f} | "
            f"{r['bf16_gflops']:.2f} | {r['gloo_MBps_per_rank']:.0f} | {r['latency_us']:.0f} | "
            f"{r['update_Melems_per_s']:.0f} |"
        )
    lines += [
        "",
        "| layout | ranks | measured s (runs) | predicted s | of which comm / host "
        "| predicted / measured | within 25% |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        runs = ", ".join(f"{t:.3f}" for t in r["runs_s"])
        lines.append(
            f"| {r['layout']} | {r['ranks']} | {r['measured_s']:.3f} ({runs}) | "
            f"{r['predicted_s']:.3f} | {r['predicted_exposed_comm_s']:.3f} / "
            f"{r['predicted_host_s']:.3f} | {r['ratio']:.2f} | {'yes' if r['within'] else 'NO'} |"
        )
    within = sum(r["within"] for r in rows)
    lines.append(f"\n{within} of {len(rows)} layouts within {TOLERANCE:.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_check", description=__doc__)
    parser.add_argument("--steps", type=int, default=6, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps dropped per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every layout")
    parser.add_argument("--only", default="", help="run only layouts whose name has this")
    parser.add_argument("--predict-only", action="store_true", help="measure, predict, no runs")
    parser.add_argument("--json", help="also write the results here as JSON")
    parser.add_argument(
        "--runs-from", help="take the measured step times of an earlier --json (no runs)"
    )
    parser.add_argument("--machine", help="reuse the measured machine of an earlier --json")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    cases = [c for c in CASES if args.only in c.name]
    began = time.perf_counter()
    sizes = sorted({c.nproc for c in cases})
    measured: dict[Case, list[float]] = {c: [] for c in cases}
    machines: dict[int, list[DeviceSpec]] = {n: [] for n in sizes}
    loads: list[float] = []
    if args.machine:
        saved = json.loads(Path(args.machine).read_text())["devices"]
        machines = {int(n): [DeviceSpec(**{"measured": True, **d})] for n, d in saved.items()}
    if args.runs_from:
        saved_rows = json.loads(Path(args.runs_from).read_text())["rows"]
        runs = {(r["layout"], r["ranks"]): r["runs_s"] for r in saved_rows}
        measured = {c: list(runs.get((c.name, c.nproc), [])) for c in cases}
    run = not (args.predict_only or args.runs_from)

    def measure() -> None:
        for n in sizes:
            machines[n].append(measure_cpu(n, _shapes(n)))
            print(f"  measured {n} workers: {machines[n][-1]}", file=sys.stderr, flush=True)

    # The machine is measured before every round and after the last, between the runs: it
    # is shared, its speed drifts, and the figures should describe the runs' minutes.
    if not args.machine:
        measure()
    for round_ in range(args.repeats if run else 0):
        shift = round_ * len(cases) // args.repeats
        for case in cases[shift:] + cases[:shift]:  # rotated: no layout always first
            loads.append(os.getloadavg()[0])
            t = run_once(case, args.steps, args.warmup, args.timeout)
            measured[case].append(t)
            print(f"  {case.name} on {case.nproc}: {t:.3f} s", file=sys.stderr, flush=True)
        if not args.machine:
            measure()
    devices = {n: _median_device(m) for n, m in machines.items() if m}
    rows = [_row(c, measured[c], devices[c.nproc]) for c in cases]
    print(_table(devices, rows))
    if loads:
        print(f"load average (1 min) at the runs' starts: {min(loads):.1f} to {max(loads):.1f}")
    print(f"(took {time.perf_counter() - began:.0f} s)")
    if args.json:
        out = {
            "command": " ".join(["python -m benchmarks.plan_check", *(argv or sys.argv[1:])]),
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "machine": [_device_row(n, d) for n, d in devices.items()],
            "devices": {n: asdict(d) for n, d in devices.items()},
            "device_rounds": {n: [asdict(d) for d in m] for n, m in machines.items()},
            "load_average": loads,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
