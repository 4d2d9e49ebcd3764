"""Replica groups of 4 ranks with tensor parallelism or a pipeline inside: a kill and a heal,
checked against the HSDP job whose replicas are the groups (8 workers a run: too many for
the test suite on 2 cores, which runs the same check on groups of 2 ranks,
``tests/test_train_replica_layouts.py``).

Command line (from the repository root)::

    .venv/bin/python -m benchmarks.replica_layouts

For each layout, ``plait train --replica-groups 2`` of a tiny GPT (6 steps, a checkpoint
every 2): group 1's rank 1 SIGKILLs itself in step 3, the launcher restarts the group, which
resumes its step-2 checkpoint, heals from group 0 and rejoins at step 5. Then the same
layout with ``--dp-replicate 2`` instead of the groups trains 2 steps as one job. A layout
passes when, after step 2, both groups hold bitwise the HSDP job's weights and gradient
norms, and at step 6 both groups hold bitwise the same weights. Exit status 1 if any fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.failure_drill import final_weights
from plait.train.checkpointing import load_weights
from plait.train.config import TrainConfig
from plait.train.loop import model_config
from plait.train.metrics import read_metrics
from plait.train.model import GPT

DEADLINE = 900  # seconds one plait train may take
#: name -> the layout inside each group (4 ranks); gradients clipped: the norm of the
#: quorum's averaged gradients.
LAYOUTS = {
    "dp_shard 2 x tp 2": "--dp-shard 2 --tp 2",
    "cp 2 x tp 2, float8": "--dp-shard 1 --cp 2 --tp 2 --float8",
    "pp 2 x dp_shard 2": "--dp-shard 2 --pp 2",
    "pp 2 x dp_shard 2, experts over ep 2": "--dp-shard 2 --pp 2 --experts 4 --top-k 2 --ep 2 "
    "--aux-loss-type global --bias-update-speed 0.01",
}
FLAGS = (
    "--device cpu --seq-len 32 --n-layer 2 --n-head 2 --d-model 32 --batch-size 8 --warmup 1 "
    "--eval-every 0 --eval-batches 1 --grad-clip 1 --min-lr-ratio 1 --fault-timeout 60"
)


def _train(run_dir: Path, flags: str, **env: str) -> float:
    """``plait train flags`` into ``run_dir``; its wall seconds."""
    command = [sys.executable, "-m", "plait", "train", *flags.split(), "--run-dir", str(run_dir)]
    began = time.perf_counter()
    done = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True,
        text=True, timeout=DEADLINE,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"plait train {flags} failed:\n{done.stderr[-4000:]}")
    return time.perf_counter() - began


def _norms(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in read_metrics(run_dir) if "grad_norm" in r}


def _step_weights(run_dir: Path, step: int, model: TrainConfig) -> dict[str, torch.Tensor]:
    gpt = GPT(model_config(model))
    load_weights(run_dir / "checkpoints" / f"step_{step:06d}", gpt)
    return gpt.state_dict()


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check(name: str, inner: str, work: Path) -> dict[str, object]:
    """Run ``inner``'s kill-and-heal and its HSDP job; what was found."""
    experts = "--experts" in inner
    model = TrainConfig(seq_len=32, n_layer=2, n_head=2, d_model=32, vocab_size=256)
    model = model.replace(experts=4, top_k=2) if experts else model
    groups, hsdp = work / "groups", work / "hsdp"
    wall = _train(
        groups,
        f"{FLAGS} {inner} --steps 6 --ckpt-every 2 --keep 3 --replica-groups 2 --nproc 4 "
        "--max-restarts 1",
        PLAIT_TEST_KILL_RANK_AT_STEP="5:3",  # group 1's rank 1, in step 3
        PLAIT_TEST_REPLICAS_REJOIN_AT_STEP="5",
    )
    _train(hsdp, f"{FLAGS} {inner} --steps 2 --ckpt-every 0 --dp-replicate 2 --nproc 8")
    reference, norms = final_weights(hsdp, model), _norms(hsdp)
    at_2 = all(_equal(_step_weights(groups / f"group{g}", 2, model), reference) for g in (0, 1))
    same_norms = all(
        [_norms(groups / f"group{g}")[s] for s in (1, 2)] == [norms[1], norms[2]] for g in (0, 1)
    )
    healed = _equal(*(final_weights(groups / f"group{g}", model) for g in (0, 1)))
    return {"layout": name, "hsdp": at_2 and same_norms, "healed": healed, "wall": wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args(argv)
    rows = []
    for name in args.layouts:
        work = Path(tempfile.mkdtemp(prefix="plait-replica-layouts-"))
        try:
            rows.append(check(name, LAYOUTS[name], work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(rows[-1], file=sys.stderr)
    print(
        "\n| layout in each group | steps 1-2 equal HSDP | healed group equals the live one | run |"
    )
    print("| --- | --- | --- | ---: |")
    for r in rows:
        word = {True: "yes, bitwise", False: "**no**"}
        print(f"| {r['layout']} | {word[bool(r['hsdp'])]} | {word[bool(r['healed'])]} "
              f"| {r['wall']:.0f} s |")  # fmt: skip
    if not all(r["hsdp"] and r["healed"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
