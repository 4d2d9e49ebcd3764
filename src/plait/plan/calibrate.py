"""``plait plan --calibrate RUN_DIR``: the device's figures fitted to a finished ``plait
train`` run on the user's own machines, then used for every prediction that follows.

A run directory holds what the fit needs: ``config.json`` (the resolved configuration: the
model, the layout, the batch, the device kind, the workers) and ``metrics.jsonl`` (each
step's wall time, and at the end every rank's peak memory). The run's measured step time is
the median of its steps, the first left out (warm-up, compilation); its predicted one is
:func:`plait.plan.train_plan.plan_of_config` on the device's *form*.

**The form.** A GPU run is fitted on the preset it names (``--device``). A CPU run is
fitted on this machine measured (:func:`plait.plan.measure.measure_counts`, what
``--measure-cpu`` measures) at the run's worker count and shapes, and a prediction for
another count is made on the machine measured at that count: the ``cpu`` preset's figures
cannot say what gloo's collectives and ``fully_shard``'s host costs take, nor what
oversubscribing the cores costs, and one factor cannot make them up (from a 2-worker run
it missed 4-worker runs by 22% to 55%). The counts are measured in the same minute,
interleaved, so that what else runs on the machine weighs on them alike: the fit then
anchors the measured figures to the run's own time. A count not measured gets the nearest
measured one moved to it by :func:`for_workers` (every worker's share of the cores scales
what it does: compute, gloo's copies and host costs alike).

**Time: one factor.** Every rate of the form (FLOP/s, link bandwidths, the optimizer's
update rate) is divided by it and every fixed cost (a collective's latency,
``fully_shard``'s host seconds per unit) multiplied by it, the factor at which the run's
predicted step time is its measured one (``measured / predicted`` where the whole
prediction scales with it, as on a CPU; found by secant steps where part of it does not,
such as a GPU's memory-bound kernels). It carries what the form's figures miss in real
training (kernel shapes, the allocator, the data path); the calibrated device predicts the
calibration run exactly, and other layouts and sizes as the cost model scales from there.

**Memory: one offset.** The planner counts tensors; a process holds more (on a CPU its
resident set holds the interpreter and libraries, on a GPU the allocator's peak includes
workspaces). The run's peak memory (the largest rank's) less the predicted peak is added to
every later prediction as ``DeviceSpec.runtime_memory`` (negative where the model
over-counts). Runs without a memory record (before plait recorded it) fit time only.

With several runs the factor is the geometric mean of theirs and the offset the median of
theirs; each run's remaining error is reported, so the spread says how far they explain them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from plait.plan.spec import DeviceSpec
from plait.train.config import ConfigError, TrainConfig, from_mapping
from plait.train.presets import RUN_FILE

__all__ = ["Calibration", "RunRecord", "calibrate", "for_workers", "is_cpu", "read_run", "scaled"]

#: The files of a run directory (``plait.train.loop.CONFIG_FILE``,
#: ``plait.train.metrics.FILENAME``; named here so the planner imports no torch).
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
#: At most this many secant steps fit one run (:func:`_solve`); they converge in a few.
_SECANT_STEPS = 12

#: Measures this CPU at each worker count, at a run configuration's shapes (:func:`_measure`;
#: tests pass another).
Measure = Callable[[TrainConfig, list[int]], dict[int, DeviceSpec]]


@dataclass(frozen=True)
class RunRecord:
    """A finished run: its resolved configuration, its measured step time (seconds, the
    median of ``steps`` steps) and its peak memory (bytes, the largest rank's; 0: not
    recorded)."""

    run_dir: str
    config: TrainConfig
    step_time: float
    steps: int
    peak_memory: float = 0.0


@dataclass(frozen=True)
class Calibration:
    """The fit: the ``forms`` the runs were fitted on by worker count (the device for any
    count on a GPU; this CPU measured at each count), the fitted ``factor`` (measured /
    predicted step time, before the fit), the memory offset (bytes per process) and a line
    per run for the report."""

    forms: dict[int, DeviceSpec]
    factor: float
    runtime_memory: float
    lines: tuple[str, ...]

    def device(self, workers: int, cores: int) -> DeviceSpec:
        """The calibrated device for ``workers`` workers (on a CPU of ``cores`` cores): the
        form of that count (else the nearest count's moved to it), the factor and the memory
        offset applied."""
        nearest = min(self.forms, key=lambda n: (abs(n - workers), n))
        form = for_workers(self.forms[nearest], nearest, workers, cores)
        return dataclasses.replace(scaled(form, self.factor), runtime_memory=self.runtime_memory)


def is_cpu(device: DeviceSpec) -> bool:
    """Whether ``device`` is the ``cpu`` preset or this machine measured."""
    return device.name.split()[0] == "cpu"


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
    memory = [max(row["peak_memory"]) for row in rows if row.get("peak_memory")]
    peak = float(memory[-1]) if memory else 0.0  # the last session's
    return RunRecord(str(run_dir), cfg, statistics.median(steady), len(steady), peak)


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
    """CPU ``device`` measured or fitted with ``fitted`` workers, for ``workers`` on the same
    ``cores`` (module docstring): rates times the ratio of each worker's share of the cores,
    ``min(1, cores / workers) / min(1, cores / fitted)``, fixed costs over it, and the
    oversubscription of the new count. Unchanged for a GPU or the same count."""
    if not is_cpu(device) or fitted == workers:
        return device
    share = min(1.0, cores / workers) / min(1.0, cores / fitted)
    return dataclasses.replace(
        device,
        flops=device.flops * share,
        flops_fp32=device.flops_fp32 * share,
        intra_node_bw=device.intra_node_bw * share,
        inter_node_bw=device.inter_node_bw * share,
        update_rate=device.update_rate * share,
        latency=device.latency / share,
        unit_overhead=device.unit_overhead / share,
        oversubscription=max(1.0, workers / cores),
        gpus_per_node=max(device.gpus_per_node, workers),
    )


def _measure(cfg: TrainConfig, counts: list[int]) -> dict[int, DeviceSpec]:
    """This CPU measured at each of ``counts`` workers, at ``cfg``'s model and batch."""
    from plait.plan.measure import measure_counts  # torch: only when a CPU is measured
    from plait.plan.train_plan import model_of_config

    return measure_counts(counts, model_of_config(cfg), cfg.seq_len, cfg.batch_size)


def calibrate(
    device: DeviceSpec,
    runs: list[RunRecord],
    cores: int,
    predict: tuple[int, ...] = (),
    measure: Measure | None = None,
) -> Calibration:
    """``device`` fitted to ``runs`` (module docstring); on a CPU of ``cores`` cores, this
    machine measured by ``measure`` (default: :func:`plait.plan.measure.measure_counts` at
    the first run's shapes) at the runs' worker counts and those of ``predict`` (the counts
    to be predicted). ValueError for runs on another kind of device than ``device`` (a CPU
    run fits the ``cpu`` device, a GPU run a GPU preset), or a run the planner cannot
    predict."""
    from plait.plan.train_plan import plan_of_config  # the run's model: torch's side

    for run in runs:
        if (run.config.device == "cpu") != is_cpu(device):
            raise ValueError(
                f"--calibrate {run.run_dir}: the run trained on {run.config.device}, the "
                f"device calibrated is {device.name}: use --device "
                + ("cpu" if run.config.device == "cpu" else "the preset closest to its GPU")
            )
    counts = sorted({run.config.nproc for run in runs} | set(predict))
    if is_cpu(device):
        forms = (measure or _measure)(runs[0].config, counts)
    else:
        forms = dict.fromkeys(counts, device)
    fitted_on = [forms[run.config.nproc] for run in runs]
    plans = [plan_of_config(run.config, f) for run, f in zip(runs, fitted_on, strict=True)]
    factor = math.exp(
        statistics.fmean(math.log(_solve(r, f)) for r, f in zip(runs, fitted_on, strict=True))
    )
    pairs = zip(runs, plans, strict=True)
    offsets = [r.peak_memory - p.memory.total for r, p in pairs if r.peak_memory]
    fit = Calibration(forms, factor, statistics.median(offsets) if offsets else 0.0, ())
    lines = []
    for run, form, before in zip(runs, fitted_on, plans, strict=True):
        predicted = before.timing.step_time
        after = plan_of_config(run.config, fit.device(run.config.nproc, cores))
        left = round(run.step_time / after.timing.step_time - 1, 4) or 0.0  # no "-0.0%"
        line = (
            f"calibrated from {run.run_dir} ({run.config.nproc} x {run.config.device}, "
            f"{run.steps} step(s)): measured {run.step_time:.4g} s, predicted "
            f"{predicted:.4g} s on {form.name} ({run.step_time / predicted:.3g}x), after "
            f"the fit {after.timing.step_time:.4g} s ({left:+.1%} measured against it)"
        )
        if run.peak_memory:
            memory_left = round(run.peak_memory / after.memory.total - 1, 4) or 0.0
            line += (
                f"; peak memory {_mib(run.peak_memory)} measured, {_mib(before.memory.total)} "
                f"of tensors predicted, after the fit {_mib(after.memory.total)} "
                f"({memory_left:+.1%} measured against it)"
            )
        lines.append(line)
    return dataclasses.replace(fit, lines=tuple(lines))


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _solve(run: RunRecord, device: DeviceSpec) -> float:
    """The factor at which ``run``'s predicted step time on ``scaled(device, factor)`` is
    its measured one. Not every part of a prediction scales with it (a GPU's memory-bound
    kernels run at its HBM bandwidth, a table's), so the factor is found by secant steps from
    the proportional guess; on a CPU the first guess is exact."""
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
