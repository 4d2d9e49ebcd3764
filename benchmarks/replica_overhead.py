"""What fault tolerance costs a step: ``plait train --replica-groups 2`` beside the one job it
trains like, ``--dp-replicate 2`` (HSDP, the groups as its replicas), on the same model,
batch and layout inside each group.

Command line (from the repository root)::

    .venv/bin/python -m benchmarks.replica_overhead --repeats 3

Both runs train the same steps on the same workers in all (``2 x --dp-shard``), the replica
groups under torchft (the ``ft`` extra): a quorum at the lighthouse before every step, each
gradient shard averaged over torchft's managed process group instead of HSDP's own, and
``should_commit`` before the optimizer steps. The two are interleaved over ``--repeats``,
in alternating order (a slow phase of the shared machine hits both alike); each run's step
time is the median of its steps after the first ``--warmup`` (group 0's for the replica
groups), and the table gives the medians over the repeats, their ratio and the difference
per step: torchft's fixed cost per step on this machine. Both runs end with bitwise the
same weights (checked: the groups average as HSDP's replicas do).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.failure_drill import final_weights
from plait.train.config import TrainConfig
from plait.train.metrics import read_metrics

DEADLINE = 900  # seconds one plait train may take


def _train(run_dir: Path, flags: list[str]) -> None:
    command = [sys.executable, "-m", "plait", "train", *flags, "--run-dir", str(run_dir)]
    done = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=DEADLINE,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"plait train failed ({done.returncode}):\n{done.stderr[-4000:]}")


def _step_time(run_dir: Path, warmup: int) -> float:
    """The median step time of ``run_dir``'s steps after the first ``warmup``."""
    times = [r["step_time"] for r in read_metrics(run_dir) if "loss" in r and r["step"] > warmup]
    return statistics.median(times)


def measure(args: argparse.Namespace, work: Path) -> dict[str, list[float]]:
    """Step times (seconds) of each variant, one per repeat; SystemExit if the two runs of a
    repeat end with different weights."""
    model = TrainConfig(
        seq_len=args.seq_len, n_layer=args.layers, n_head=4, d_model=args.d_model,
        vocab_size=256,
    )  # fmt: skip
    flags = [
        "--device", "cpu", "--seq-len", str(args.seq_len), "--n-layer", str(args.layers),
        "--n-head", "4", "--d-model", str(args.d_model), "--batch-size", str(args.batch),
        "--steps", str(args.steps), "--eval-every", "0", "--eval-batches", "1",
        "--dp-shard", str(args.dp_shard), "--fault-timeout", "60",
    ]  # fmt: skip
    replica_flags = ["--replica-groups", "2", "--nproc", str(args.dp_shard)]
    variants = {
        "HSDP (--dp-replicate 2)": ["--dp-replicate", "2", "--nproc", str(2 * args.dp_shard)],
        "replica groups (--replica-groups 2)": replica_flags,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        dirs = {}
        order = list(enumerate(variants.items()))  # alternated: drift hits both alike
        for i, (name, extra) in order[:: 1 if repeat % 2 == 0 else -1]:
            run_dir = dirs[name] = work / f"{repeat}-{i}"
            _train(run_dir, [*flags, *extra])
            metrics = run_dir / "group0" if "--replica-groups" in extra else run_dir
            times[name].append(_step_time(metrics, args.warmup))
        first, second = (dirs[name] for name in variants)
        hsdp, groups = final_weights(first, model), final_weights(second / "group0", model)
        if any(not torch.equal(hsdp[k], groups[k]) for k in hsdp):
            raise SystemExit(f"repeat {repeat}: the replica groups' weights differ from HSDP's")
        last = ", ".join(f"{name} {t[-1] * 1e3:.1f} ms" for name, t in times.items())
        print(f"repeat {repeat}: {last}", file=sys.stderr)
        for run_dir in dirs.values():
            shutil.rmtree(run_dir)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out")
    parser.add_argument("--dp-shard", type=int, default=2, help="workers per group")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="plait-replica-overhead-"))
    try:
        times = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    hsdp, groups = medians.values()
    print(
        f"\n{2 * args.dp_shard} CPU workers in all, d_model {args.d_model}, {args.layers} "
        f"layers, {args.batch} sequences of {args.seq_len} per step, {args.steps} steps "
        f"(the first {args.warmup} left out), {args.repeats} interleaved repeats, medians; "
        "final weights bitwise equal in every repeat\n"
    )
    print("| run | step time | min-max over repeats |")
    print("| --- | ---: | ---: |")
    for name, t in times.items():
        print(f"| {name} | {medians[name] * 1e3:.1f} ms | {min(t) * 1e3:.1f}-{max(t) * 1e3:.1f} |")
    print(
        f"\nreplica groups / HSDP: {groups / hsdp:.2f}x ({(groups - hsdp) * 1e3:+.1f} ms per step)"
    )


if __name__ == "__main__":
    main()
