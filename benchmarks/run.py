"""Command line: ``python -m benchmarks.run --suite replicate --nproc 2``.

Prints the Markdown table and writes the full JSON report (every step time included).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.harness import BenchConfig, launch
from benchmarks.modes import MODES, SUITES
from plait.train.model import GPTConfig


def main() -> None:
    default = BenchConfig()  # the defaults live in the config classes only
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--suite", choices=sorted(SUITES), help="a named list of modes")
    parser.add_argument("--modes", help=f"comma-separated modes, from: {', '.join(MODES)}")
    parser.add_argument("--nproc", type=int, default=default.nproc)
    parser.add_argument("--repeats", type=int, default=default.repeats)
    parser.add_argument(
        "--steps", type=int, default=default.steps, help="timed steps per mode per repeat"
    )
    parser.add_argument("--warmup", type=int, default=default.warmup)
    parser.add_argument("--batch", type=int, default=default.batch, help="sequences per rank")
    parser.add_argument("--layers", type=int, default=default.gpt.n_layer)
    parser.add_argument("--d-model", type=int, default=default.gpt.d_model)
    parser.add_argument("--heads", type=int, default=default.gpt.n_head)
    parser.add_argument("--seq-len", type=int, default=default.gpt.seq_len)
    parser.add_argument("--out", type=Path, default=Path("bench-results/latest.json"))
    args = parser.parse_args()

    names = SUITES[args.suite] if args.suite else []
    if args.modes:
        names += [n for n in args.modes.split(",") if n not in names]
    if not names:
        parser.error("give --suite or --modes")
    unknown = [n for n in names if n not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {sorted(MODES)}")

    cfg = BenchConfig(
        nproc=args.nproc,
        repeats=args.repeats,
        steps=args.steps,
        warmup=args.warmup,
        batch=args.batch,
        gpt=GPTConfig(
            n_layer=args.layers, d_model=args.d_model, n_head=args.heads, seq_len=args.seq_len
        ),
    )
    report = launch(cfg, [MODES[n] for n in names])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(report["markdown"])
    print(
        f"\n{args.nproc} ranks x 1 thread, {cfg.repeats} repeats x {cfg.steps} steps; "
        f"full report: {args.out}"
    )


if __name__ == "__main__":
    main()
