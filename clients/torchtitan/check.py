"""Run torchtitan's trainer on torch and on plait, configuration by configuration.

Each configuration runs ``torchtitan.train`` twice under torchrun on CPU processes with
gloo (see driver.py), once with torch's composable APIs and once with plait's names put
in their place, and the table compares what torchtitan logged: the loss and the gradient
norm of every step on every rank (exact floats). Usage (normally through ``./run``)::

    check.py                  # every configuration
    check.py --only fsdp pp2-1f1b
    check.py --list
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import dataset

HERE = Path(__file__).resolve().parent
WORK = HERE / ".work"
PYTHON = Path(sys.executable)
PP = "--parallelism.pipeline_parallel_degree"
SHARD = "--parallelism.data_parallel_shard_degree"
TP = "--parallelism.tensor_parallel_degree"
EP = "--parallelism.expert_parallel_degree"
CP = "--parallelism.context_parallel_degree"


@dataclass(frozen=True)
class Config:
    """One row of the table."""

    name: str
    label: str
    ranks: int
    config: str = "base"  # function of titan_configs.py
    flags: tuple[str, ...] = ()
    # When torch's own run fails here, plait is compared with torch's run of this row.
    fallback: str | None = None
    # Run twice in one dump folder: flags_first, then flags (DCP save, then resume).
    resume_from: tuple[str, ...] | None = None
    expected_to_fail: str = ""
    # Why plait's numbers differ from torch's, where torch's run is the one that is off.
    differs_because: str = ""


def _pp(schedule: str) -> tuple[str, ...]:
    return (PP, "2", "--parallelism.pipeline_parallel_schedule", schedule)


CONFIGS: tuple[Config, ...] = (
    Config("fsdp", "FSDP 2 (reshard_after_forward default)", 2, flags=(SHARD, "2")),
    Config("fsdp-full-ac", "FSDP 2 + full AC", 2, "full_ac", (SHARD, "2")),
    Config("fsdp-selective-ac", "FSDP 2 + selective AC", 2, "selective_ac", (SHARD, "2")),
    Config(
        "reshard-always",
        "FSDP 2, reshard_after_forward always",
        2,
        flags=(SHARD, "2", "--parallelism.fsdp_reshard_after_forward", "always"),
    ),
    Config(
        "reshard-never",
        "FSDP 2, reshard_after_forward never",
        2,
        flags=(SHARD, "2", "--parallelism.fsdp_reshard_after_forward", "never"),
    ),
    Config(
        "hsdp-2x2",
        "HSDP 2x2",
        4,
        flags=("--parallelism.data_parallel_replicate_degree", "2", SHARD, "2"),
    ),
    Config("dp-shard-4", "FSDP 4 (dp_shard 4)", 4, flags=(SHARD, "4")),
    Config(
        "cpu-offload",
        "FSDP 2 + CPU offload",
        2,
        flags=(SHARD, "2", "--training.enable_cpu_offload"),
        fallback="fsdp",
    ),
    Config("pp2-gpipe", "PP 2, GPipe", 2, flags=_pp("GPipe")),
    Config("pp2-1f1b", "PP 2, 1F1B", 2, flags=_pp("1F1B")),
    Config("pp2-interleaved", "PP 2, Interleaved1F1B", 2, flags=_pp("Interleaved1F1B")),
    Config("pp2-fsdp2", "PP 2 x dp_shard 2 (1F1B)", 4, flags=(*_pp("1F1B"), SHARD, "2")),
    Config(
        "dcp-resume",
        "FSDP 2, DCP save at step 2 + resume to 3",
        2,
        flags=(SHARD, "2", "--checkpoint.enable", "--training.steps", "3"),
        resume_from=(SHARD, "2", "--checkpoint.enable", "--training.steps", "2"),
    ),
    Config(
        "chunked-loss", "FSDP 2, torchtitan's default chunked loss", 2, "chunked_loss", (SHARD, "2")
    ),
    Config(
        "compile",
        "FSDP 2 + per-block torch.compile (fullgraph)",
        2,
        flags=(SHARD, "2", "--compile.enable"),
        fallback="fsdp",
    ),
    Config(
        "spmd-types",
        "FSDP 2, spmd_types backend (torchtitan's default: dp_mesh_dims)",
        2,
        "spmd_types",
        (SHARD, "2"),
        fallback="fsdp",
    ),
    Config("moe-fsdp2", "MoE (DeepSeek-V3 debug), FSDP 2, ep 1", 2, "moe", (SHARD, "2")),
    Config("moe-ep2-fsdp2", "MoE, expert parallel 2 x dp_shard 2", 2, "moe", (SHARD, "2", EP, "2")),
    Config(
        "moe-ep2-fsdp4", "MoE, expert parallel 2 at dp_shard 4", 4, "moe", (SHARD, "4", EP, "2")
    ),
    Config(
        "moe-tp2-ep2",
        "MoE, TP 2 with ep 2 over the tp ranks",
        2,
        "moe",
        (SHARD, "1", TP, "2", EP, "2"),
    ),
    Config(
        "moe-ep2-tp2-fsdp2",
        "MoE, ep 2 x TP 2 x dp_shard 2",
        4,
        "moe",
        (SHARD, "2", TP, "2", EP, "2"),
    ),
    Config(
        "moe-pp2-ep2",
        "MoE, PP 2 (1F1B) x ep 2 x dp_shard 2",
        4,
        "moe",
        (*_pp("1F1B"), SHARD, "2", EP, "2"),
        differs_because=(
            "torch 2.13's PipelineStage infers its metadata on the first step by running each "
            "stage's forward once more on real tensors, so the MoE token counters behind the "
            "aux-loss-free bias update count one extra microbatch per rank (step 1's counts: "
            "1,920 routed tokens per layer instead of 1,536); plait sends metadata with the "
            "first activations and runs no extra forward. Without the bias balancing "
            "(`moe-pp2-ep2-nobias`) the two are bitwise equal"
        ),
    ),
    Config(
        "moe-pp2-ep2-nobias",
        "MoE without bias balancing, PP 2 (1F1B) x ep 2 x dp_shard 2",
        4,
        "moe_no_bias_balance",
        (*_pp("1F1B"), SHARD, "2", EP, "2"),
    ),
    Config(
        "moe-ep2-dcp-resume",
        "MoE, ep 2 x dp_shard 2, DCP save at step 2 + resume to 3",
        2,
        "moe",
        (SHARD, "2", EP, "2", "--checkpoint.enable", "--training.steps", "3"),
        resume_from=(SHARD, "2", EP, "2", "--checkpoint.enable", "--training.steps", "2"),
    ),
    Config(
        "qwen3-moe-ep2",
        "Qwen3 MoE (debug), ep 2 x dp_shard 2",
        2,
        "qwen3_moe",
        (SHARD, "2", EP, "2"),
    ),
    Config("tp2-fsdp2", "TP 2 x dp_shard 2", 4, flags=(TP, "2", SHARD, "2")),
    Config("pp2-tp2", "PP 2 x TP 2 (1F1B)", 4, flags=(*_pp("1F1B"), TP, "2")),
    Config("cp2", "CP 2 (FlexAttention, headtail load balancer)", 2, "cp", (CP, "2", SHARD, "1")),
    Config(
        "cp2-ptrr",
        "CP 2, ptrr load balancer",
        2,
        "cp",
        (CP, "2", SHARD, "1", "--parallelism.context_parallel_load_balancer", "ptrr"),
    ),
    Config("cp2-fsdp2", "CP 2 x dp_shard 2", 4, "cp", (CP, "2", SHARD, "2")),
    Config("cp2-tp2", "CP 2 x TP 2", 4, "cp", (CP, "2", TP, "2", SHARD, "1")),
    Config("cp2-pp2", "CP 2 x PP 2 (1F1B)", 4, "cp", (CP, "2", *_pp("1F1B"), SHARD, "1")),
    Config(
        "tp2-spmd-types",
        "TP 2 x dp_shard 2, spmd_types backend (dp_mesh_dims)",
        4,
        "spmd_types",
        (TP, "2", SHARD, "2"),
        fallback="tp2-fsdp2",
        expected_to_fail=(
            "torchtitan's weight init on spmd_types' full-mesh TP DTensors fails on plait's "
            "shards (a 384 vs 768 size mismatch in DTensor propagation); torch 2.13 refuses "
            "this configuration too"
        ),
    ),
)


@dataclass
class Run:
    """One implementation's run of one configuration."""

    ok: bool
    seconds: float
    error: str = ""
    metrics: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    log: Path | None = None


_ERROR = re.compile(
    r"^(?:\[rank\d+\]:)?\s*((?:[\w.]+\.)?\w*(?:Error|Exception|Unsupported|Interrupt)\b.*)$"
)


_LAUNCHER_ERRORS = ("ChildFailedError", "torch.distributed.elastic")


def _first_error(log: Path) -> str:
    """The exception line of the first rank that failed, from torchrun's output."""
    found = ""
    boxed = False
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("╭─"):  # torchtitan's command-line (tyro) errors come boxed
            boxed = True
        elif boxed and line.startswith("│"):
            return line.strip(" │")
        match = _ERROR.match(line)
        if match and not match.group(1).startswith(_LAUNCHER_ERRORS):
            found = match.group(1).strip()
            break
    return found or "failed (see log)"


def _torchrun(
    impl: str, cfg: Config, flags: tuple[str, ...], run_dir: Path, timeout: float, log: Path
) -> int:
    cmd = [
        str(PYTHON),
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={cfg.ranks}",
        str(HERE / "driver.py"),
        impl,
        str(run_dir / "metrics"),
        "--",
        "--module",
        "titan_configs",
        "--config",
        cfg.config,
        "--dump_folder",
        str(run_dir / "out"),
        *flags,
    ]
    env = dict(
        os.environ,
        PYTHONPATH=str(HERE),
        OMP_NUM_THREADS="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(WORK / "hf"),
        LOG_RANK="0",
    )
    with log.open("a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(
            cmd, cwd=run_dir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\nTimeoutError: no result within {timeout:.0f} s\n")
            return -1


def run(impl: str, cfg: Config, timeout: float) -> Run:
    run_dir = WORK / "runs" / cfg.name / impl
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log = run_dir / "log.txt"
    start = time.monotonic()
    code = 0
    if cfg.resume_from is not None:
        code = _torchrun(impl, cfg, cfg.resume_from, run_dir, timeout, log)
    if code == 0:
        code = _torchrun(impl, cfg, cfg.flags, run_dir, timeout, log)
    seconds = time.monotonic() - start
    metrics: dict[str, list[dict[str, float]]] = {}
    for path in sorted((run_dir / "metrics").glob("rank*.jsonl")):
        metrics[path.stem] = [json.loads(line) for line in path.read_text().splitlines()]
    if code != 0:
        return Run(False, seconds, _first_error(log), metrics, log)
    if impl == "plait" and not _redirected(run_dir / "metrics" / "redirects.json"):
        return Run(False, seconds, "torchtitan did not get plait's fully_shard", metrics, log)
    return Run(True, seconds, metrics=metrics, log=log)


def _redirected(resolved: Path) -> bool:
    """Whether the plait run's torchtitan really imported plait's ``fully_shard``."""
    if not resolved.exists():
        return False
    names = json.loads(resolved.read_text())
    return names.get("torch.distributed.fsdp.fully_shard") == "plait.fully_shard"


def max_differences(a: Run, b: Run) -> tuple[float, float] | str:
    """Max |loss| and |grad norm| differences over every rank and step, or why not."""
    if sorted(a.metrics) != sorted(b.metrics):
        return f"ranks differ: {sorted(a.metrics)} vs {sorted(b.metrics)}"
    loss = grad = 0.0
    for rank, rows in a.metrics.items():
        other = b.metrics[rank]
        if [r["step"] for r in rows] != [r["step"] for r in other]:
            return f"{rank}: steps differ"
        for x, y in zip(rows, other, strict=True):
            loss = max(loss, abs(x["loss"] - y["loss"]))
            grad = max(grad, abs(x["grad_norm"] - y["grad_norm"]))
    if not a.metrics:
        return "no metrics logged"
    return loss, grad


def _cell(value: float) -> str:
    return "0.0" if value == 0 else f"{value:.3g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="configurations to run")
    parser.add_argument("--list", action="store_true", help="list the configurations")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per torchrun")
    args = parser.parse_args()
    if args.list:
        for cfg in CONFIGS:
            print(f"{cfg.name:20} {cfg.ranks} ranks  {cfg.label}")
        return 0
    chosen = [c for c in CONFIGS if not args.only or c.name in args.only]
    unknown = set(args.only or ()) - {c.name for c in CONFIGS}
    if unknown:
        parser.error(f"unknown configuration(s): {', '.join(sorted(unknown))}")
    dataset.build(WORK / "data")

    rows: list[str] = []
    notes: list[str] = []
    torch_runs: dict[str, Run] = {}
    bad = 0
    total = time.monotonic()
    for cfg in chosen:
        runs = {}
        for impl in ("torch", "plait"):
            print(f"[{cfg.name}] {impl} ...", end=" ", flush=True)
            runs[impl] = run(impl, cfg, args.timeout)
            print(f"{'ok' if runs[impl].ok else 'FAILED'} ({runs[impl].seconds:.0f} s)", flush=True)
        torch_run, plait_run = runs["torch"], runs["plait"]
        torch_runs[cfg.name] = torch_run
        reference, against = torch_run, ""
        if not torch_run.ok and cfg.fallback:
            fallback = torch_runs.get(cfg.fallback)
            if fallback is None:
                fallback = run("torch", _named(cfg.fallback), args.timeout)
                torch_runs[cfg.fallback] = fallback
            reference, against = fallback, f" (vs torch `{cfg.fallback}`)"
        loss = grad = "-"
        exact = False
        if reference.ok and plait_run.ok:
            diff = max_differences(reference, plait_run)
            if isinstance(diff, str):
                loss = grad = diff
            else:
                loss, grad = _cell(diff[0]) + against, _cell(diff[1]) + against
                exact = diff == (0.0, 0.0)
        # Exact means bitwise: a difference of 1e-4 in fp32 is a different computation.
        row_ok = plait_run.ok and (exact or bool(cfg.differs_because))
        if not row_ok and not cfg.expected_to_fail:
            bad += 1
        if plait_run.ok and not exact and cfg.differs_because:
            notes.append(f"- {cfg.name}: differs from torch because {cfg.differs_because}")
        rows.append(f"| {cfg.label} | {_yes(torch_run)} | {_yes(plait_run)} | {loss} | {grad} |")
        for impl, r in runs.items():
            if not r.ok:
                notes.append(f"- {cfg.name}, {impl}: `{r.error}` ({r.log})")
        if cfg.expected_to_fail and not plait_run.ok:
            notes.append(f"- {cfg.name}: expected to fail on plait: {cfg.expected_to_fail}")

    lines = [
        "| configuration | torch ran | plait ran | max abs loss diff | max abs grad-norm diff |",
        "| --- | --- | --- | --- | --- |",
        *rows,
    ]
    if notes:
        lines += ["", "Failures and differences:", *notes]
    lines += [
        "",
        f"{len(chosen)} configurations in {time.monotonic() - total:.0f} s; "
        f"{bad} not matching torch (expected failures excluded).",
    ]
    report = "\n".join(lines)
    print("\n" + report)
    (WORK / "table.md").write_text(report + "\n")
    return 1 if bad else 0


def _named(name: str) -> Config:
    return next(c for c in CONFIGS if c.name == name)


def _yes(r: Run) -> str:
    return "yes" if r.ok else "no"


if __name__ == "__main__":
    sys.exit(main())
