"""``plait plan --calibrate RUN_DIR``: the device's figures fitted to a finished ``plait
train`` run on the user's own machines, then used for every prediction that follows.

A run directory holds what the fit needs: ``config.json`` (the resolved configuration: the
model, the layout, the batch, the device kind, the workers) and ``metrics.jsonl`` (each
step's wall time). The run's measured step time is the median of its steps, the first left
out (warm-up, compilation); its predicted one is :func:`plait.plan.train_plan.plan_of_config`
on the device being calibrated.

The fit is one factor: every rate of the device (FLOP/s, link bandwidths, the optimizer's
update rate) is divided by it and every fixed cost (a collective's latency,
``fully_shard``'s host seconds per unit) multiplied by it, the factor at which the run's
predicted step time is its measured one (``measured / predicted`` where the whole
prediction scales with it, as on the ``cpu`` preset; found by secant steps where part of it
does not, such as a GPU's memory-bound kernels). The calibrated device predicts the
calibration run exactly, and other layouts and sizes as the cost model scales from there.
With several runs the factor is the geometric mean of theirs, and each run's remaining
error is reported: the spread says how far one factor explains them.

On a CPU (the ``cpu`` device kind) the workers share the machine's cores: a rate fitted on
a run of ``n`` workers is each worker's share of the cores at ``n``. Predicting ``m``
workers on the same machine (:func:`for_workers`) scales the compute rates by the shares'
ratio, ``min(1, cores / m) / min(1, cores / n)``; ``cores`` is this machine's (the
calibration assumes the run was on the machine that plans). GPUs each have their own
device: no such scaling.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from plait.plan.spec import DeviceSpec
from plait.train.config import ConfigError, TrainConfig, from_mapping
from plait.train.presets import RUN_FILE

__all__ = ["Calibration", "RunRecord", "calibrate", "for_workers", "read_run", "scaled"]

#: The files of a run directory (``plait.train.loop.CONFIG_FILE``,
#: ``plait.train.metrics.FILENAME``; named here so the planner imports no torch).
CONFIG_FILE = "config.json"
#: At most this many secant steps fit one run (:func:`_solve`); they converge in a few.
_SECANT_STEPS = 12
METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class RunRecord:
    """A finished run: its resolved configuration and its measured step time (seconds, the
    median of ``steps`` steps)."""

    run_dir: str
    config: TrainConfig
    step_time: float
    steps: int


@dataclass(frozen=True)
class Calibration:
    """The fitted device, the factor (measured / predicted step time, before the fit), the
    workers per machine it was fitted at (CPU), and a line per run for the report."""

    device: DeviceSpec
    factor: float
    workers: int
    lines: tuple[str, ...]


def read_run(run_dir: str | Path) -> RunRecord:
    """The run in ``run_dir``; ValueError naming the file and what is missing."""
    root = Path(run_dir)
    config_path, metrics_path = root / CONFIG_FILE, root / METRICS_FILE
    try:
        values = json.loads(config_path.read_text())
        rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line]
    except OSError as err:
        raise ValueError(
            f"--calibrate {run_dir}: no {Path(err.filename).name} (a plait train run directory "
            "holds config.json and metrics.jsonl)"
        ) from err
    except json.JSONDecodeError as err:
        raise ValueError(f"--calibrate {run_dir}: not JSON: {err}") from err
    try:
        cfg = from_mapping(values)
    except ConfigError as err:
        raise ValueError(f"--calibrate {run_dir}/{CONFIG_FILE}: {err}") from err
    if cfg.model_config and (root / RUN_FILE).exists():  # the run's own copy of its model
        cfg = cfg.replace(model_config=str(root / RUN_FILE))
    times = [float(row["step_time"]) for row in rows if "step_time" in row]
    steady = times[1:] or times
    if not steady:
        raise ValueError(f"--calibrate {run_dir}: {METRICS_FILE} holds no step_time")
    return RunRecord(str(run_dir), cfg, statistics.median(steady), len(steady))


def scaled(device: DeviceSpec, factor: float) -> DeviceSpec:
    """``device`` ``factor`` times slower: rates divided by it, fixed costs multiplied."""
    return dataclasses.replace(
        device,
        flops=device.flops / factor,
        flops_fp32=device.flops_fp32 / factor,
        intra_node_bw=device.intra_node_bw / factor,
        inter_node_bw=device.inter_node_bw / factor,
        update_rate=device.update_rate / factor,
        latency=device.latency * factor,
        unit_overhead=device.unit_overhead * factor,
    )


def for_workers(device: DeviceSpec, fitted: int, workers: int, cores: int) -> DeviceSpec:
    """``device`` fitted on ``fitted`` CPU workers, for ``workers`` on the same ``cores``
    (module docstring); unchanged for a GPU or the same count."""
    if device.name != "cpu" or fitted == workers:
        return device
    share = min(1.0, cores / workers) / min(1.0, cores / fitted)
    return dataclasses.replace(
        device,
        flops=device.flops * share,
        flops_fp32=device.flops_fp32 * share,
        update_rate=device.update_rate * share,
        unit_overhead=device.unit_overhead / share,
    )


def calibrate(device: DeviceSpec, runs: list[RunRecord]) -> Calibration:
    """``device`` fitted to ``runs`` (module docstring). ValueError for runs on another
    kind of device than ``device`` (a CPU run fits the ``cpu`` device, a GPU run a GPU
    preset), CPU runs of different worker counts (fit one count), or a run the planner
    cannot predict."""
    from plait.plan.train_plan import plan_of_config  # the run's model: torch's side

    for run in runs:
        if (run.config.device == "cpu") != (device.name == "cpu"):
            raise ValueError(
                f"--calibrate {run.run_dir}: the run trained on {run.config.device}, the "
                f"device calibrated is {device.name}: use --device "
                + ("cpu" if run.config.device == "cpu" else "the preset closest to its GPU")
            )
    workers = {run.config.nproc for run in runs}
    if device.name == "cpu" and len(workers) > 1:
        raise ValueError(
            f"--calibrate: runs of {sorted(workers)} CPU workers; calibrate from runs of one "
            "worker count (the rates are each worker's share of the cores)"
        )
    base = [plan_of_config(run.config, device).timing.step_time for run in runs]
    factor = math.exp(statistics.fmean(math.log(_solve(run, device)) for run in runs))
    fitted = scaled(device, factor)
    lines = []
    for run, predicted in zip(runs, base, strict=True):
        after = plan_of_config(run.config, fitted).timing.step_time
        left = round(run.step_time / after - 1, 4) or 0.0  # no "-0.0%" for a rounding
        lines.append(
            f"calibrated from {run.run_dir} ({run.config.nproc} x {run.config.device}, "
            f"{run.steps} step(s)): measured {run.step_time:.4g} s, predicted "
            f"{predicted:.4g} s on {device.name} ({run.step_time / predicted:.3g}x), after "
            f"the fit {after:.4g} s ({left:+.1%} measured against it)"
        )
    return Calibration(fitted, factor, runs[0].config.nproc, tuple(lines))


def _solve(run: RunRecord, device: DeviceSpec) -> float:
    """The factor at which ``run``'s predicted step time on ``scaled(device, factor)`` is
    its measured one. Not every part of a prediction scales with it (a GPU's memory-bound
    kernels run at its HBM bandwidth, a table's), so the factor is found by secant steps from
    the proportional guess; on the ``cpu`` preset the first guess is exact."""
    from plait.plan.train_plan import plan_of_config

    def predicted(factor: float) -> float:
        return plan_of_config(run.config, scaled(device, factor)).timing.step_time

    k0, t0 = 1.0, predicted(1.0)
    k1 = run.step_time / t0
    t1 = predicted(k1)
    for _ in range(_SECANT_STEPS):
        if abs(t1 - run.step_time) <= 1e-9 * run.step_time or t1 == t0:
            break
        k0, k1, t0 = k1, max(k1 + (run.step_time - t1) * (k1 - k0) / (t1 - t0), 1e-9), t1
        t1 = predicted(k1)
    return k1
