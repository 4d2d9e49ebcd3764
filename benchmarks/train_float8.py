"""``plait train --float8`` beside plain bf16: tokens/s of the GPT under ``fully_shard``.

Command line (from the repository root)::

    .venv/bin/python -m benchmarks.train_float8 --repeats 3 --steps 10

Every run is a real ``plait train`` (launcher, workers, recipe) at ``--dp-shard 2`` on
local CPU processes (gloo). The variants differ only in ``--float8``; each ``--mp`` given
(bf16 by default: torchtitan trains float8 with bf16 compute) gets both. Runs of all
variants are interleaved repeat by repeat, so a slow phase of a shared machine hits them
alike. A run's speed is the median of its step times after ``--warmup``; a variant's is
the median over its runs.

On CPU torchao *emulates* float8 matmuls (each operand rounded to float8, then multiplied
in float32), on top of the casts' own cost: expect float8 to be slower here. The table is
there to say by how much, honestly; the speed-up float8 exists for needs a GPU's float8
tensor cores (compute capability 8.9+). The final losses show that both variants train.
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


@dataclass
class Variant:
    mp: str
    float8: bool
    step_ms: list[float] = field(default_factory=list)  # per run: median after warm-up
    final_loss: list[float] = field(default_factory=list)  # per run

    @property
    def name(self) -> str:
        return f"{self.mp}{' + float8' if self.float8 else ''}"


def _train(variant: Variant, args: argparse.Namespace) -> None:
    """One ``plait train`` run of ``variant``; records its step time and final loss."""
    run_dir = Path(tempfile.mkdtemp(prefix="plait-bench-float8-"))
    command = [
        sys.executable, "-m", "plait.cli", "train",
        "--d-model", str(args.d_model), "--n-layer", str(args.layers),
        "--n-head", str(args.heads), "--seq-len", str(args.seq_len),
        "--batch-size", str(args.batch_size), "--steps", str(args.steps),
        "--dp-shard", "2", "--device", "cpu", "--mp", variant.mp,
        "--eval-every", "0", "--eval-batches", "1", "--ckpt-every", "0",
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    if variant.float8:
        command.append("--float8")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{variant.name}: plait train failed:\n{done.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "loss" in r]
    variant.step_ms.append(statistics.median(r["step_time"] * 1e3 for r in steps[args.warmup :]))
    variant.final_loss.append(steps[-1]["loss"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, global")
    parser.add_argument("--mp", nargs="+", default=["bf16"], choices=["bf16", "fp32"])
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no step of --steps {args.steps} to time")
    variants = [Variant(mp, f8) for mp in args.mp for f8 in (False, True)]
    for repeat in range(args.repeats):
        # Rotated each repeat: no variant always runs first (a cold page cache) or last.
        shift = repeat % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            _train(variant, args)
            print(
                f"repeat {repeat + 1}: {variant.name}: {variant.step_ms[-1]:.1f} ms/step",
                file=sys.stderr,
                flush=True,
            )
    tokens = args.batch_size * args.seq_len
    print(
        f"plait train --dp-shard 2 on CPU (gloo, float8 emulated), GPT d_model {args.d_model} "
        f"x {args.layers} layers, seq {args.seq_len} x batch {args.batch_size}; median of "
        f"steps {args.warmup + 1}..{args.steps} per run, median of {args.repeats} "
        "interleaved runs\n"
    )
    print("| mode | median step ms | min-max ms | tokens/s | vs without float8 | final loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for variant in variants:
        ms = statistics.median(variant.step_ms)
        base = next(v for v in variants if v.mp == variant.mp and not v.float8)
        ratio = statistics.median(base.step_ms) / ms  # > 1: faster than without float8
        print(
            f"| {variant.name} | {ms:.1f} | {min(variant.step_ms):.1f}-"
            f"{max(variant.step_ms):.1f} | {tokens / ms * 1e3:,.0f} | {ratio:.2f}x | "
            f"{statistics.median(variant.final_loss):.4f} |"
        )


if __name__ == "__main__":
    main()
