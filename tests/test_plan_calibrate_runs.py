"""``plait plan --calibrate`` on real runs: a 4-worker CPU run of another layout predicted
from a 2-worker run on the same machine, as a user does it.

The calibration run is plait's GPT (4 blocks, width 128, sequence 128, global batch 32,
fp32) under ``--dp-shard 2`` on 2 workers; the target the same model under ``--dp-replicate
2 --dp-shard 2`` (HSDP: another layout, twice the workers). Both run through the ``plait``
command; the fit measures this machine at 2 and 4 workers (:mod:`plait.plan.calibrate`).

What is asserted is what does not depend on how busy the machine is: the fit reproduces
the calibration run's step time and memory, and the target's peak memory (each process's
resident set: the interpreter and libraries, fitted as the offset, plus the tensors the
model counts) is predicted within 10%: identical runs' peaks moved by under 2% here, and
the prediction was within 5% over repeats. The step time of the 4-worker run is wall time
on a shared machine: identical runs moved by up to 50% while other tests ran beside them,
so it is not asserted here (the brief: performance is measured, not asserted in tests).
``benchmarks/plan_calibrate.py`` measures it on an idle machine, interleaved and repeated,
against the issue's 15% (its table is in benchmarks/README.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from plait.plan import device
from plait.plan.calibrate import calibrate, read_run
from plait.plan.measure import measure_counts
from plait.plan.spec import DeviceSpec
from plait.plan.train_plan import model_of_config, plan_of_config
from plait.train.config import TrainConfig
from plait.train.cores import usable_cores

MODEL = ["--n-layer", "4", "--n-head", "4", "--d-model", "128", "--seq-len", "128"]


def _train(run_dir: Path, layout: list[str], workers: int) -> Path:
    """Train ``layout`` on ``workers`` CPU workers for 4 steps through the command."""
    command = [sys.executable, "-m", "plait", "train", *MODEL, *layout, "--device", "cpu"]
    command += ["--nproc", str(workers), "--batch-size", "32", "--steps", "4"]
    command += ["--eval-every", "0", "--eval-batches", "1", "--run-dir", str(run_dir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def _measure_once(cfg: TrainConfig, counts: list[int]) -> dict[int, DeviceSpec]:
    """This CPU measured at ``counts`` workers, one round (the default takes two)."""
    return measure_counts(counts, model_of_config(cfg), cfg.seq_len, cfg.batch_size, rounds=1)


def test_a_2_worker_run_predicts_a_4_worker_run_of_another_layout(tmp_path: Path) -> None:
    two = read_run(_train(tmp_path / "two", ["--dp-shard", "2"], 2))
    four = read_run(_train(tmp_path / "four", ["--dp-replicate", "2", "--dp-shard", "2"], 4))
    cores = usable_cores()
    fit = calibrate(device("cpu"), [two], cores, predict=(4,), measure=_measure_once)
    assert sorted(fit.forms) == [2, 4] and all(f.measured for f in fit.forms.values())
    assert fit.forms[4].oversubscription >= fit.forms[2].oversubscription
    # The fit reproduces its own run: step time and memory.
    own = plan_of_config(two.config, fit.device(2, cores))
    assert own.timing.step_time == pytest.approx(two.step_time, rel=1e-6)
    assert own.memory.total == pytest.approx(two.peak_memory, rel=1e-6)
    # The 4-worker run of another layout: memory within 10%; the step time is reported.
    predicted = plan_of_config(four.config, fit.device(4, cores))
    assert four.config.nproc == 4 and four.peak_memory > 0
    report = (
        f"{fit.lines[0]}; 4 workers measured {four.step_time:.4g} s, {four.peak_memory:.4g} B; "
        f"predicted {predicted.timing.step_time:.4g} s, {predicted.memory.total:.4g} B"
    )
    print(report)
    assert predicted.timing.step_time > 0, report
    assert abs(predicted.memory.total / four.peak_memory - 1) <= 0.10, report
