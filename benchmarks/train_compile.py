"""``plait train`` eager vs ``--compile``: tokens/s of the GPT and of a Llama-family model.

Command line (from the repository root)::

    .venv/bin/python -m benchmarks.train_compile --repeats 3 --steps 12

Every run is a real ``plait train`` (its launcher, its workers, its recipe) at
``--dp-shard 2`` on local CPU processes (gloo); the runs of all variants are interleaved,
repeat by repeat, so slow phases of a noisy machine hit every variant alike. A run's speed
is the median step time of its steps after ``--warmup`` (the first steps compile: their
time is reported apart, as the compile cost), and a variant's figure is the median over its
runs. Compiled and eager runs of one model must train the same losses: the table shows the
largest difference of their final losses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

#: name: the flags that build the model
MODELS = {
    "gpt": ["--d-model", "256", "--n-layer", "4", "--n-head", "4"],
    "tiny-llama": ["--model-config", "tiny-llama"],
}


@dataclass
class Variant:
    model: str
    compiled: bool
    step_ms: list[float] = field(default_factory=list)  # per run: median step after warm-up
    first_ms: list[float] = field(default_factory=list)  # per run: the first step
    tokens_per_step: int = 0
    final_loss: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.model} {'--compile' if self.compiled else 'eager'}"


def _run(variant: Variant, args: argparse.Namespace) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="plait-bench-compile-"))
    command = [
        sys.executable, "-m", "plait.cli", "train",
        *MODELS[variant.model],
        "--dp-shard", "2", "--device", "cpu",
        "--steps", str(args.steps), "--seq-len", str(args.seq_len),
        "--batch-size", str(args.batch_size),
        "--eval-every", "0", "--eval-batches", "1", "--ckpt-every", "0",
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    if variant.compiled:
        command.append("--compile")
    subprocess.run(command, check=True, capture_output=True, text=True)
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    times = [r["step_time"] * 1e3 for r in records]
    variant.first_ms.append(times[0])
    variant.step_ms.append(statistics.median(times[args.warmup :]))
    variant.tokens_per_step = args.batch_size * args.seq_len
    variant.final_loss.append(records[-1]["loss"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args(argv)
    variants = [Variant(m, c) for m in args.models for c in (False, True)]
    for repeat in range(args.repeats):
        for variant in variants:
            _run(variant, args)
            print(
                f"repeat {repeat + 1}: {variant.name}: {variant.step_ms[-1]:.1f} ms/step",
                file=sys.stderr,
                flush=True,
            )
    print(
        f"plait train --dp-shard 2 on CPU (gloo), seq {args.seq_len} x batch "
        f"{args.batch_size}, {args.steps} steps, median of steps {args.warmup + 1}.., "
        f"{args.repeats} interleaved runs each\n"
    )
    print("| model | mode | median step ms | tokens/s | vs eager | first step ms | final loss |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for variant in variants:
        ms = statistics.median(variant.step_ms)
        eager = next(v for v in variants if v.model == variant.model and not v.compiled)
        ratio = statistics.median(eager.step_ms) / ms
        print(
            f"| {variant.model} | {'compile' if variant.compiled else 'eager'} | {ms:.1f} | "
            f"{variant.tokens_per_step / ms * 1e3:,.0f} | {ratio:.2f}x | "
            f"{statistics.median(variant.first_ms):.0f} | {variant.final_loss[-1]:.4f} |"
        )


if __name__ == "__main__":
    main()
