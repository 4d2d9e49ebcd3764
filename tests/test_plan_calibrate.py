"""``plait plan --calibrate RUN_DIR``: the device fitted to a finished run predicts that run's
step time and memory exactly, scales every later prediction by the same factor (rates
divided, fixed costs multiplied) and adds the same memory offset, fits a CPU run on this
machine measured at the run's worker count and predicts another count on the machine
measured at that count, and refuses what it cannot fit by name. The arithmetic is checked
with the measurement replaced by the ``cpu`` preset (deterministic); test_plan_calibrate_runs.py
trains real runs and checks the prediction of a 4-worker run from a 2-worker one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from plait.layout import Layout
from plait.plan import Workload, device, evaluate, gpt, measure
from plait.plan.calibrate import RunRecord, calibrate, for_workers, read_run, scaled
from plait.plan.cli import main
from plait.plan.spec import DeviceSpec
from plait.plan.train_plan import plan_of_config, planned_layout
from plait.train.config import TrainConfig
from plait.train.replicas import metrics_run_dir

RUN = TrainConfig(
    n_layer=2,
    n_head=2,
    d_model=32,
    seq_len=32,
    batch_size=8,
    nproc=2,
    dp_shard=2,
    device="cpu",
    vocab_size=256,
    microbatches=1,
    stages_per_rank=1,
)  # fmt: skip  (resolved, as a run directory's config.json holds it)
FLAGS = ["--n-layer", "2", "--n-head", "2", "--d-model", "32", "--seq-len", "32"]
FLAGS += ["--global-batch", "8", "--device", "cpu", "--json", "--top", "1"]


@pytest.fixture(autouse=True)
def preset_cpu(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Measuring this CPU replaced by the ``cpu`` preset (test_plan_calibrate_runs.py
    measures); the worker counts of each measurement asked for."""
    asked: list[list[int]] = []

    def preset(counts: list[int], *args: object) -> dict[int, DeviceSpec]:
        asked.append(counts)
        return dict.fromkeys(counts, device("cpu"))

    monkeypatch.setattr(measure, "measure_counts", preset)
    return asked


def _run_dir(
    tmp_path: Path,
    cfg: TrainConfig,
    times: list[float],
    name: str = "run",
    memory: list[int] | None = None,
) -> Path:
    """A run directory as plait train leaves it: config.json and metrics.jsonl (with each
    rank's peak ``memory`` at the end, if given)."""
    run = tmp_path / name
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    rows: list[dict[str, object]] = [{"step": 0, "val_loss": 5.0}]
    rows += [{"step": i + 1, "loss": 5.0, "step_time": t} for i, t in enumerate(times)]
    if memory:
        rows.append({"step": len(times), "peak_memory": memory, "memory_kind": "rss"})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _step(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[float, str]:
    """The best layout's predicted step time, and what the command said on stderr."""
    assert main(argv) == 0
    out, err = capsys.readouterr()
    return float(json.loads(out)[0]["step_time_s"]), err


def test_the_fit_predicts_the_calibration_run_and_scales_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    predicted = plan_of_config(RUN, device("cpu")).timing.step_time
    measured = 3 * predicted
    # The first step (warm-up) is left out; the median of the others is the measurement.
    run = _run_dir(tmp_path, RUN, [50 * predicted, measured, 0.9 * measured, 1.1 * measured])
    same = ["--gpus", "2", "--dp-shard", "2"]
    step, err = _step(capsys, [*FLAGS, *same, "--calibrate", str(run)])
    assert step == pytest.approx(measured)
    assert f"calibrated from {run} (2 x cpu, 3 step(s)): measured" in err
    assert "(3x), after the fit" in err and "(+0.0% measured against it)" in err
    # Another layout of the same worker count: the uncalibrated prediction, three times.
    other = ["--gpus", "2", "--dp-replicate", "2", "--dp-shard", "1"]
    plain, _ = _step(capsys, [*FLAGS, *other])
    calibrated, _ = _step(capsys, [*FLAGS, *other, "--calibrate", str(run)])
    assert calibrated == pytest.approx(3 * plain)


def test_the_report_names_each_run_and_what_the_fit_leaves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    predicted = plan_of_config(RUN, device("cpu")).timing.step_time
    slow = _run_dir(tmp_path, RUN, [1.0, 4 * predicted], "slow")
    fast = _run_dir(tmp_path, RUN, [1.0, 1 * predicted], "fast")
    flags = [*FLAGS, "--gpus", "2", "--dp-shard", "2", "--calibrate", str(slow)]
    # Two runs: the geometric mean of 4x and 1x, 2x; each run's remaining error reported.
    got, err = _step(capsys, [*flags, "--calibrate", str(fast)])
    assert got == pytest.approx(2 * predicted)
    assert f"calibrated from {slow} (2 x cpu, 1 step(s))" in err
    assert "(4x), after the fit" in err and "(+100.0% measured against it)" in err
    assert f"calibrated from {fast}" in err and "(-50.0% measured against it)" in err


def test_every_rate_and_fixed_cost_scales() -> None:
    base = dataclasses.replace(device("h100"), latency=2e-5, unit_overhead=1e-4, update_rate=1e12)
    slow = scaled(base, 2.5)
    assert (slow.flops, slow.flops_fp32, slow.intra_node_bw, slow.inter_node_bw) == (
        base.flops / 2.5, base.flops_fp32 / 2.5, base.intra_node_bw / 2.5,
        base.inter_node_bw / 2.5,
    )  # fmt: skip
    assert slow.update_rate == base.update_rate / 2.5
    assert (slow.latency, slow.unit_overhead) == (base.latency * 2.5, base.unit_overhead * 2.5)
    # On the cpu preset every part of a prediction scales with them.
    model, work = gpt(4, 4, 256, 512), Workload(512, 16, "fp32")
    for layout in (Layout(dp_shard=4), Layout(dp_shard=2, tp=2), Layout(dp_shard=2, pp=2)):
        plain = evaluate(model, layout, work, device("cpu")).timing.step_time
        slower = evaluate(model, layout, work, scaled(device("cpu"), 2.5)).timing.step_time
        assert slower == pytest.approx(2.5 * plain), layout


@pytest.mark.parametrize(("pp", "passes"), [(1, 4), (2, 1)])
def test_fully_shard_host_work_is_per_microbatch_but_once_per_step_in_a_pipeline(
    pp: int, passes: int
) -> None:
    # A unit's host work (hooks, parameter swaps, buffer copies) comes with each gather and
    # reduction: per microbatch without a pipeline, once per step under one (plait's
    # schedules gather and reduce a stage once). On CPU runs (benchmarks/plan_calibrate.py)
    # charging it per microbatch put pp 2 x dp_shard 2 at +58% of its measured step time.
    model, work = gpt(4, 4, 256, 512), Workload(512, 16, "fp32")
    layout = Layout(dp_shard=2, pp=pp, microbatches=4)
    times = [
        evaluate(model, layout, work, dataclasses.replace(device("cpu"), unit_overhead=u))
        for u in (0.0, 1.0)
    ]
    units = (4 // pp) + 1  # the busiest stage's blocks and the root unit
    assert times[1].timing.host - times[0].timing.host == pytest.approx(passes * units)


def test_a_gpu_run_is_matched_though_its_memory_bound_kernels_do_not_scale() -> None:
    gpu = TrainConfig(
        n_layer=8, n_head=16, d_model=2048, seq_len=4096, batch_size=64, nproc=8, dp_shard=8,
        device="cuda", vocab_size=32000, mp="bf16", microbatches=1, stages_per_rank=1,
    )  # fmt: skip
    h100 = device("h100")
    predicted = plan_of_config(gpu, h100).timing.step_time
    measured = 1.7 * predicted
    fit = calibrate(h100, [RunRecord("gpu-run", gpu, measured, 10)], cores=2)
    assert plan_of_config(gpu, fit.device(8, cores=2)).timing.step_time == pytest.approx(
        measured, rel=1e-6
    )
    assert fit.factor > 1.7  # the part that does not scale leaves more to the rest


def test_a_cpu_run_is_fitted_measured_and_another_count_predicted_measured_at_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], preset_cpu: list[list[int]]
) -> None:
    predicted = plan_of_config(RUN, device("cpu")).timing.step_time
    run = _run_dir(tmp_path, RUN, [1.0, 2 * predicted])
    four = ["--gpus", "4", "--dp-shard", "4", "--calibrate", str(run)]
    plain, _ = _step(capsys, [*FLAGS, "--gpus", "4", "--dp-shard", "4"])
    got, _ = _step(capsys, [*FLAGS, *four])
    # Measured at the run's 2 workers and the prediction's 4 together; the factor applied.
    assert preset_cpu == [[2, 4]]
    assert got == pytest.approx(2 * plain)
    # Runs of different worker counts: each fitted on the machine measured at its own.
    other = _run_dir(tmp_path, dataclasses.replace(RUN, nproc=4, dp_shard=4), [1.0, 2.0], "4")
    fit = calibrate(device("cpu"), [read_run(run), read_run(other)], cores=2, predict=(8,))
    assert preset_cpu[1:] == [[2, 4, 8]]
    assert sorted(fit.forms) == [2, 4, 8] and len(fit.lines) == 2
    # A count not measured: the nearest measured one moved by the workers' share of cores.
    moved = fit.device(16, cores=2)
    assert moved.flops == pytest.approx(fit.device(8, cores=2).flops / 2)
    assert moved.latency == pytest.approx(fit.device(8, cores=2).latency * 2)


def test_cpu_rates_follow_the_workers_share_of_the_cores() -> None:
    cpu = device("cpu")
    four = for_workers(cpu, 2, 4, cores=2)
    assert (four.flops, four.intra_node_bw) == pytest.approx((cpu.flops / 2, cpu.intra_node_bw / 2))
    assert (four.latency, four.oversubscription) == pytest.approx((cpu.latency * 2, 2.0))
    assert for_workers(cpu, 4, 2, cores=2).flops == pytest.approx(cpu.flops * 2)
    assert for_workers(cpu, 1, 2, cores=2) == cpu  # one core each either way
    assert for_workers(device("h100"), 2, 64, cores=2) == device("h100")  # a device each


def test_memory_is_fitted_as_an_offset_per_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = plan_of_config(RUN, device("cpu")).memory.total
    run = _run_dir(tmp_path, RUN, [1.0, 0.5], memory=[int(tensors) + 2**28, int(tensors)])
    fit = calibrate(device("cpu"), [read_run(run)], cores=2)
    assert fit.runtime_memory == pytest.approx(2**28, abs=1)  # the largest rank's
    assert plan_of_config(RUN, fit.device(2, cores=2)).memory.total == pytest.approx(
        tensors + 2**28
    )
    assert "MiB of tensors predicted, after the fit 257 MiB (+0.0% measured" in fit.lines[0]
    # The offset reaches the plan's memory, as its own part, for every layout.
    flags = [*FLAGS, "--gpus", "4", "--dp-shard", "4"]
    assert main(flags) == 0
    plain = json.loads(capsys.readouterr().out)[0]["memory"]
    assert main([*flags, "--calibrate", str(run)]) == 0
    calibrated = json.loads(capsys.readouterr().out)[0]["memory"]
    assert calibrated["extra"]["runtime"] == pytest.approx(2**28, abs=1)
    assert calibrated["total"] == pytest.approx(plain["total"] + 2**28, abs=1)
    assert "runtime" not in plain["extra"]


def test_what_cannot_be_fitted_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [*FLAGS, "--gpus", "2"]
    assert main([*base, "--calibrate", str(tmp_path)]) == 2
    assert f"--calibrate {tmp_path}: no config.json" in capsys.readouterr().err
    run = _run_dir(tmp_path, RUN, [1.0, 2.0])
    h100 = [a if a != "cpu" else "h100" for a in base]
    assert main([*h100, "--calibrate", str(run)]) == 2
    assert "the run trained on cpu, the device calibrated is h100: use --device cpu" in (
        capsys.readouterr().err
    )
    empty = _run_dir(tmp_path, RUN, [], "empty")
    with pytest.raises(ValueError, match="holds no step_time"):
        read_run(empty)


def test_replica_groups_are_planned_as_the_hsdp_job_they_train_like() -> None:
    # Each group reads 1 / R of the global batch: R groups of --dp-shard 2 are priced as
    # dp_replicate R x dp_shard 2, and --plan compares with the groups' own metrics.
    groups = dataclasses.replace(RUN, replica_groups=2)
    assert planned_layout(groups) == dataclasses.replace(RUN.layout, dp_replicate=2)
    hsdp = dataclasses.replace(RUN, dp_replicate=2, nproc=4)
    cpu = device("cpu")
    assert plan_of_config(groups, cpu) == plan_of_config(hsdp, cpu)
    assert metrics_run_dir(groups) == Path(RUN.run_dir) / "group0"
    assert metrics_run_dir(RUN) == Path(RUN.run_dir)
