"""Failure drill for ``plait train``: kill workers at random moments of a run, in each mode
of recovering, and measure what it costs; then what an asynchronous checkpoint saves the
training loop compared with a synchronous one.

Command line (from the repository root)::

    .venv/bin/python -m benchmarks.failure_drill --steps 200 --kills 3

**The drill.** A 200-step run of a tiny GPT on 2 CPU workers (gloo, fully_shard over
both), checkpointed every ``--ckpt-every`` steps, is killed ``--kills`` times, at moments
drawn from ``--seed``: a random worker SIGKILLs itself in the middle of a random step
(after its forward, before its backward), or, one kill in three, while it writes a random
checkpoint (its data files written, not its manifest). The moments are the test-only
fault variables of :mod:`plait.train.faults`, so every mode meets the same kills. Modes:

* ``restart``: ``--max-restarts K``, synchronous checkpoints;
* ``restart + async``: the same with ``--async-checkpoint``;
* ``restart + snapshots``: ``restart`` with ``--snapshot-every`` (default 1): a snapshot in
  this machine's memory after every step besides the checkpoints (:mod:`plait.train.snapshots`),
  so a restart continues from the step before the kill;
* ``manual --resume``: no restarts: each kill fails the run, and the drill starts it again
  at once with ``--resume`` (what a person, or a job scheduler, does by hand);
* ``replica groups``: ``--replica-groups 2`` of 2 workers each (torchft, the ``ft``
  extra): every kill strikes group 1 (its rank of the same index, in the step; a kill
  drawn in a checkpoint strikes in that step instead), whose life ``i`` meets kill ``i``;
  group 0 trains on, redoing only the step each kill interrupted, and the launcher
  restarts group 1, which heals from group 0 (group 0 waits two steps after each kill for
  the next life to rejoin, so that the steps each group misses are the same in every run).
  Its losses are not the uninterrupted run's (the steps without group 1 average fewer
  samples), so "equal" says instead whether every step's loss and number of groups of
  both groups equal those of torch's ``fully_shard`` under torchft with the same failures
  (``tests/replica_reference.py``: the same model, data and optimizer, the same kills and
  holds), and the two groups end with bitwise the same weights; no gradient clipping in
  this mode (the reference has none). "steps redone" counts group 0's uncommitted steps,
  and the time lost is against an uninterrupted replica-groups run.

For each: the kills that struck, the steps redone (completed past the checkpoint a
restart continued from), the wall-clock time lost against the same mode's uninterrupted
run, and whether the final weights and every step's loss equal the uninterrupted
synchronous run's, bit for bit.

**Checkpoint cost.** Interleaved repeats of one run (a larger model, so that its state
takes a noticeable time to write) with synchronous and with asynchronous checkpoints
every ``--cost-every`` steps, and with snapshots instead (``--snapshot-every``, into this
machine's memory, synchronous and asynchronous). What a save takes off training,
measured within each run so that the shared machine's slow phases cancel: the time
training waited for it (a synchronous save's whole write; an asynchronous one's staging
copy, and any wait for the previous write), plus, for an asynchronous one, how much
longer than the run's undisturbed steps (median) the steps took while its write went on
in the background (the workers and that thread share the cores). Medians over every save
of the repeats, the final checkpoint excluded.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plait.train.checkpointing import latest_checkpoint, list_checkpoints, load_weights
from plait.train.config import TrainConfig
from plait.train.loop import model_config
from plait.train.metrics import read_metrics
from plait.train.model import GPT

WORKERS = 2
DEADLINE = 900  # seconds one plait train may take


@dataclass(frozen=True)
class Kill:
    rank: int
    step: int
    in_checkpoint: bool  # while writing the checkpoint of ``step``, else during the step

    def describe(self) -> str:
        where = "writing checkpoint" if self.in_checkpoint else "in step"
        return f"rank {self.rank} {where} {self.step}"


def plan_kills(rng: random.Random, kills: int, steps: int, ckpt_every: int) -> list[Kill]:
    """``kills`` moments at steps at least three apart, so each strikes in its own attempt
    (the one after the previous kill resumes before it; a restarted replica group rejoins
    two steps after the kill, see ``replica_drill``)."""
    planned: list[Kill] = []
    # up to steps - 2: a restarted replica group rejoins two steps after its kill
    for step in sorted(rng.sample(range(2, steps - 1), kills)):
        rank = rng.randrange(WORKERS)
        if rng.random() < 1 / 3 and ckpt_every:
            checkpoint = -(-step // ckpt_every) * ckpt_every  # the next checkpoint
            previous = planned[-1].step if planned else 0
            if previous + 2 < checkpoint < steps - 1:
                planned.append(Kill(rank, checkpoint, True))
                continue
        if not planned or step > planned[-1].step + 2:
            planned.append(Kill(rank, step, False))
    return planned


def fault_env(kills: list[Kill], attempts: bool) -> dict[str, str]:
    """The fault variables for ``kills``: the i-th in attempt i (``attempts``), or all in
    attempt 0 (one launch each: the manual mode)."""

    def listed(in_checkpoint: bool) -> str:
        return ",".join(
            f"{k.rank}:{k.step}:{i if attempts else 0}"
            for i, k in enumerate(kills)
            if k.in_checkpoint == in_checkpoint
        )

    return {
        "PLAIT_TEST_KILL_RANK_AT_STEP": listed(False),
        "PLAIT_TEST_KILL_RANK_IN_CHECKPOINT": listed(True),
    }


@dataclass
class Run:
    """One mode's run, all its launches together."""

    run_dir: Path
    wall_s: float = 0.0
    struck: int = 0
    launches: int = 0
    redone: int = 0
    stderr: list[str] = field(default_factory=list)


def train(run: Run, flags: list[str], env: dict[str, str], *, expect_failure: bool = False) -> int:
    """One launch of ``plait train`` into ``run``; its exit status."""
    command = [sys.executable, "-m", "plait", "train", "--nproc", str(WORKERS), *flags]
    command += ["--run-dir", str(run.run_dir)]
    began = time.perf_counter()
    done = subprocess.run(
        command, env={**os.environ, **env}, capture_output=True, text=True, timeout=DEADLINE
    )
    run.wall_s += time.perf_counter() - began
    run.launches += 1
    run.struck += done.stderr.count("plait: test fault:")
    run.stderr.append(done.stderr)
    if done.returncode and not expect_failure:
        raise SystemExit(f"plait train failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.returncode


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


def final_weights(run_dir: Path, model: TrainConfig) -> dict[str, torch.Tensor]:
    path = latest_checkpoint(run_dir)
    assert path is not None, f"{run_dir} has no checkpoint"
    gpt = GPT(model_config(model))
    load_weights(path, gpt)
    return gpt.state_dict()


def same_run(run_dir: Path, reference: Path, model: TrainConfig) -> bool:
    if losses(run_dir) != losses(reference):
        return False
    mine, theirs = final_weights(run_dir, model), final_weights(reference, model)
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def drill_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--device", "cpu", "--seq-len", str(args.seq_len), "--n-layer", "2", "--n-head", "2",
        "--d-model", str(args.d_model), "--batch-size", "4", "--steps", str(args.steps),
        "--ckpt-every", str(args.ckpt_every), "--eval-every", "0", "--eval-batches", "1",
        "--fault-timeout", "10",
    ]  # fmt: skip


def restart_drill(root: Path, flags: list[str], kills: list[Kill]) -> Run:
    run = Run(root)
    train(run, [*flags, "--max-restarts", str(len(kills))], fault_env(kills, attempts=True))
    rows = [r for r in read_metrics(root) if r.get("event") == "restart"]
    run.redone = sum(int(r["redone_steps"]) for r in rows)
    return run


def manual_drill(root: Path, flags: list[str], kills: list[Kill]) -> Run:
    """Each kill fails the run; start it again with --resume, as a person would."""
    run = Run(root)
    for i in range(len(kills) + 1):
        resume = ["--resume"] if i else []
        env = fault_env(kills[i : i + 1], attempts=False)
        if not train(run, [*flags, *resume], env, expect_failure=i < len(kills)):
            break
        # The failed session's steps past the checkpoint the next one resumes from.
        done = max((step for step, _ in losses(root)), default=0)
        checkpoints = list_checkpoints(root)
        resumed = int(checkpoints[-1].name.split("_")[1]) if checkpoints else 0
        run.redone += max(0, done - resumed)
    return run


REPLICA_FLAGS = ["--replica-groups", "2", "--dp-shard", str(WORKERS), "--grad-clip", "0"]
REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "replica_reference.py"


def replica_drill(root: Path, flags: list[str], kills: list[Kill]) -> Run:
    """Group 1 meets every kill, kill ``i`` in its life ``i``; group 0 trains on."""
    run = Run(root)
    kill_at = ",".join(f"{WORKERS + k.rank}:{k.step}:{i}" for i, k in enumerate(kills))
    env = {"PLAIT_TEST_KILL_RANK_AT_STEP": kill_at}
    # Group 0 waits two steps after each kill for group 1's next life to rejoin: a restart
    # takes seconds (imports, model, checkpoint) while a step takes milliseconds, so else the
    # restarted group would heal past its next planned kills, and after the last one it
    # could find group 0 finished and go on alone from its own checkpoint.
    env["PLAIT_TEST_REPLICAS_REJOIN_AT_STEP"] = ",".join(str(k.step + 2) for k in kills)
    train(run, [*flags, *REPLICA_FLAGS, "--max-restarts", str(len(kills))], env)
    run.redone = run.stderr[-1].count("not committed")
    return run


def groups_equal(run_dir: Path, model: TrainConfig, kills: list[Kill]) -> bool:
    """Whether every step's loss and groups of both replica groups equal torch's
    ``fully_shard`` under torchft with the same kills, and both groups end with bitwise the
    same weights."""
    spec = importlib.util.spec_from_file_location("replica_reference", REFERENCE)
    assert spec is not None and spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    scratch = run_dir / "torch-reference"
    scratch.mkdir()
    config = run_dir / "replicas" / "config.json"
    torch_runs = reference.run_groups(config, scratch, [(k.rank, k.step) for k in kills], DEADLINE)
    for group, life in torch_runs:
        records = read_metrics(run_dir / f"group{group}")
        theirs = torch_runs[group, life]
        # group 1's earlier lives: the reference's died unwritten; plait's kept the steps up
        # to the checkpoint a life resumed from. Its last life's steps are compared.
        first = min(theirs) if life else 1
        plait_run = {
            r["step"]: (r["loss"], r["groups_in_step"])
            for r in records
            if "loss" in r and r["step"] >= first
        }
        if plait_run != theirs:
            differ = sorted(
                k for k in plait_run.keys() | theirs.keys() if plait_run.get(k) != theirs.get(k)
            )
            mine = [plait_run.get(k) for k in differ[:2]]
            print(
                f"  group {group}: steps {differ[:5]} differ from torch's ({mine} vs "
                f"{[theirs.get(k) for k in differ[:2]]})",
                file=sys.stderr,
            )
            return False
    first, second = (final_weights(run_dir / f"group{g}", model) for g in (0, 1))
    return all(torch.equal(first[k], second[k]) for k in first)


def drill(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    model = TrainConfig(seq_len=args.seq_len, n_layer=2, n_head=2, d_model=args.d_model)
    model = model.replace(vocab_size=256)
    flags = drill_flags(args)
    reference = Run(work / "uninterrupted")
    train(reference, flags, {})
    reference_async = Run(work / "uninterrupted-async")
    async_flags = [*flags, "--async-checkpoint"]
    train(reference_async, async_flags, {})
    reference_snapshots = Run(work / "uninterrupted-snapshots")
    snapshot_flags = [*flags, "--snapshot-every", str(args.snapshot_every)]
    train(reference_snapshots, snapshot_flags, {})
    modes = [  # name, flags, restarting (else manual --resume), uninterrupted run
        ("restart", flags, True, reference),
        ("restart + async", async_flags, True, reference_async),
        ("restart + snapshots", snapshot_flags, True, reference_snapshots),
        ("manual --resume", flags, False, reference),
    ]
    reference_replicas = Run(work / "uninterrupted-replicas")
    if args.replicas:
        train(reference_replicas, [*flags, *REPLICA_FLAGS], {})
        modes.append(("replica groups", flags, False, reference_replicas))
    rows = []
    for trial in range(args.trials):
        rng = random.Random(args.seed + trial)
        kills = plan_kills(rng, args.kills, args.steps, args.ckpt_every)
        print(f"trial {trial}: kills {'; '.join(k.describe() for k in kills)}", file=sys.stderr)
        for name, mode_flags, restarting, baseline in modes:
            run_dir = work / f"{trial}-{name.replace(' ', '').replace('+', '-')}"
            if baseline is reference_replicas:
                drilled = replica_drill(run_dir, mode_flags, kills)
            else:
                drilled = (restart_drill if restarting else manual_drill)(
                    run_dir, mode_flags, kills
                )
            rows.append(
                {
                    "mode": name,
                    "trial": trial,
                    "kills": f"{drilled.struck} of {len(kills)}",
                    "launches": drilled.launches,
                    "steps redone": drilled.redone,
                    "time lost": drilled.wall_s - baseline.wall_s,
                    "uninterrupted": baseline.wall_s,
                    "equal": groups_equal(run_dir, model, kills)
                    if baseline is reference_replicas
                    else same_run(run_dir, reference.run_dir, model),
                }
            )
            print(f"  {name}: {rows[-1]}", file=sys.stderr)
    return rows


def checkpoint_costs(
    records: list[dict[str, Any]], last: int, event: str = "checkpoint"
) -> list[float]:
    """What each checkpoint (``event``: or ``"snapshot"``) before step ``last`` took off
    training, in seconds (module docstring): the time training waited for it, plus, while
    an asynchronous one was written, how much longer the steps took than the run's
    undisturbed steps (median)."""
    steps = {r["step"]: r["step_time"] for r in records if "loss" in r}
    saves = [r for r in records if r.get("event") == event and r["step"] < last]
    written = {
        r["checkpoint"]: r["write_s"] for r in records if r.get("event") == f"{event}_written"
    }
    windows: dict[int, list[int]] = {}
    for save in saves:  # the steps trained while the write went on
        window, remaining, step = [], written.get(save["checkpoint"], 0.0), save["step"] + 1
        while save["async"] and remaining > 0 and step in steps:
            window.append(step)
            remaining -= steps[step]
            step += 1
        windows[save["step"]] = window
    busy = {step for window in windows.values() for step in window}
    undisturbed = statistics.median(t for s, t in steps.items() if s not in busy and s > 1)
    return [
        save["blocked_s"] + sum(steps[s] - undisturbed for s in windows[save["step"]])
        for save in saves
    ]


def checkpoint_cost(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    flags = [
        "--device", "cpu", "--seq-len", "128", "--n-layer", str(args.cost_layers),
        "--n-head", "4", "--d-model", str(args.cost_d_model), "--batch-size", "4",
        "--steps", str(args.cost_steps), "--ckpt-every", str(args.cost_every),
        "--eval-every", "0", "--eval-batches", "1",
    ]  # fmt: skip
    # Snapshots at the checkpoints' steps instead of them (into memory, not the run
    # directory's file system); the last step is a checkpoint in every variant, not counted.
    snapshots = ["--ckpt-every", "0", "--snapshot-every", str(args.cost_every)]
    variants = {  # name: (flags, event)
        "sync": ([], "checkpoint"),
        "async": (["--async-checkpoint"], "checkpoint"),
        "snapshot sync": (snapshots, "snapshot"),
        "snapshot async": ([*snapshots, "--async-checkpoint"], "snapshot"),
    }
    costs: dict[str, list[float]] = {name: [] for name in variants}
    waits: dict[str, list[float]] = {name: [] for name in variants}
    writes: dict[str, list[float]] = {name: [] for name in variants}
    staged: list[int] = []
    for repeat in range(args.repeats):
        for name, (extra, event) in variants.items():  # interleaved: a slow phase hits all
            run = Run(work / f"cost-{repeat}-{name.replace(' ', '-')}")
            train(run, [*flags, *extra], {})
            records = read_metrics(run.run_dir)
            costs[name] += checkpoint_costs(records, args.cost_steps, event)
            saves = [r for r in records if r.get("event") == event]
            waits[name] += [r["blocked_s"] for r in saves if r["step"] < args.cost_steps]
            staged += [r["staged_bytes"] for r in saves if r["async"]]
            writes[name] += [r["write_s"] for r in records if r.get("event") == f"{event}_written"]
            shutil.rmtree(run.run_dir)
    return {
        "checkpoints": len(costs["sync"]),
        "cost ms": {name: statistics.median(c) * 1000 for name, c in costs.items()},
        "wait ms": {name: statistics.median(w) * 1000 for name, w in waits.items()},
        "write ms": {name: statistics.median(w) * 1000 for name, w in writes.items() if w},
        "staged MiB": max(staged) / 2**20,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--trials", type=int, default=1, help="drills of --kills kills per mode")
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="draws the kills' moments")
    parser.add_argument("--snapshot-every", type=int, default=1, help="of the snapshot mode")
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="of the checkpoint-cost runs")
    parser.add_argument("--cost-steps", type=int, default=41)
    parser.add_argument("--cost-every", type=int, default=10)
    parser.add_argument("--cost-d-model", type=int, default=256)
    parser.add_argument("--cost-layers", type=int, default=4)
    parser.add_argument("--skip-cost", action="store_true", help="the drill only")
    parser.add_argument("--skip-drill", action="store_true", help="the checkpoint cost only")
    parser.add_argument(
        "--replicas",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also drill --replica-groups 2 (needs torchft, the ft extra)",
    )
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="plait-failure-drill-"))
    try:
        rows = [] if args.skip_drill else drill(args, work)
        cost = None if args.skip_cost else checkpoint_cost(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if rows:
        print_drill(rows, args)
    if cost is not None:
        print_cost(cost, args)


def print_drill(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.steps} steps, {WORKERS} CPU workers, checkpoints every {args.ckpt_every} "
        f"steps, {args.kills} kills per drill (seed {args.seed})\n"
    )
    print(
        "| mode | trial | kills struck | launches | steps redone | time lost "
        "| final weights and losses equal |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        lost = f"{r['time lost']:+.1f} s (of {r['uninterrupted']:.1f} s)"
        equal = "yes, bitwise" if r["equal"] else "**no**"
        print(
            f"| {r['mode']} | {r['trial']} | {r['kills']} | {r['launches']} | "
            f"{r['steps redone']} | {lost} | {equal} |"
        )


def print_cost(cost: dict[str, Any], args: argparse.Namespace) -> None:
    per, waits = cost["cost ms"], cost["wait ms"]
    print(
        f"\ncheckpoint cost ({args.cost_d_model} wide, {args.cost_layers} layers, a "
        f"checkpoint every {args.cost_every} steps, {cost['checkpoints']} checkpoints per "
        f"variant over {args.repeats} interleaved repeats, medians):\n"
    )
    print("| checkpoints | off training, per checkpoint | training waited | written in |")
    print("| --- | ---: | ---: | ---: |")
    for name in per:
        wait = f"{waits[name]:.0f} ms"
        written = "(the wait)"
        if name in cost["write ms"]:
            wait += f" (staging {cost['staged MiB']:.1f} MiB per rank)"
            written = f"{cost['write ms'][name]:.0f} ms, in the background"
        print(f"| {name} | {per[name]:.0f} ms | {wait} | {written} |")
    print(f"\nasync / sync: {per['async'] / per['sync']:.2f}")
    print(f"snapshot sync / sync: {per['snapshot sync'] / per['sync']:.2f}")


if __name__ == "__main__":
    main()
