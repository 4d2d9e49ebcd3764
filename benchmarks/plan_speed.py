"""How long ``plait plan``'s searches and dry runs take, each from a cold start.

Command line (from the repository root)::

    .venv/bin/python -m benchmarks.plan_speed [--repeats 3] [--quick] [--only SUBSTRING]

Timings are not asserted in the test suite (issue 37: CI runs on machines up to 3x slower
and loaded); the searches and dry runs whose speed tests used to assert are timed here:

* the cold 10,240-GPU search of Llama 3 405B (issue 28), at a global batch of one sequence
  per device (``plait plan --gpus 10240``'s) and of 2,048 sequences
  (``tests/test_plan_scale.py``);
* the cold 1,024-GPU search of Llama 3 8B (``tests/test_plan.py``,
  ``tests/test_plan_scale.py``), with the number of layouts it finds;
* ``plait plan --preset llama3-8b --gpus 1024 --gpus-per-node 8 --seq-len 8192 --json``
  through :func:`plait.plan.cli.main`;
* ``plait plan --preset llama3.1-70b --gpus 64 --tp 4 --pp 4 --cp 2 --json --top 1``
  through :func:`plait.cli.main` (the call alone) and as a command of its own: CPU seconds
  of the whole process, imports included (issue 38's target: under 1 s of CPU);
* the dry runs of ``tests/test_plan_dryrun_llama.py`` (small Llama and Qwen3 configs on 4
  ranks, a wide Llama on 96) and ``tests/test_plan_memory.py`` (a 6.5B GPT on 64 and 1,024
  ranks), their configurations copied here by value.

Each repeat of each case is a fresh process (no cache); cases are interleaved, one round per
repeat. ``CPU s`` is :func:`time.process_time` of the call alone (not the imports), except
for the ``plait plan`` command, where it is the child process's CPU, imports included
(``resource.getrusage(RUSAGE_CHILDREN)`` before and after). ``process wall s`` is the wall
time of the whole process, from start to exit. The table gives the median and range of CPU
seconds over the repeats: a figure to watch, not a test. ``--quick``: one repeat, without
the 1,024-rank dry runs.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Issue 38: ``plait plan ... --top 1`` of one fixed layout under 1 s of CPU.
TARGET_CPU_S = 1.0

#: ``tests/test_plan_dryrun_llama.py``'s small Llama: grouped-query attention (8 heads, 2 KV
#: heads), a 32,000-token vocabulary, untied head.
LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "max_position_embeddings": 4096,
    "num_attention_heads": 8,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
#: Its Qwen3: heads wider than hidden_size / heads, q and k norms, a tied head.
QWEN3: dict[str, Any] = {
    **LLAMA,
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "head_dim": 64,
    "tie_word_embeddings": True,
    "vocab_size": 4096,
}
#: Its wide Llama, whose matrices do not divide by 96 ranks.
WIDE: dict[str, Any] = {**LLAMA, "hidden_size": 512, "intermediate_size": 1376, "vocab_size": 512}
#: (family, layout) on 4 ranks, seq 512 x batch 8.
LLAMA_DRY_RUNS: list[tuple[str, dict[str, Any]]] = [
    ("llama", {"dp_shard": 4}),
    ("llama", {"dp_shard": 4, "mp": "bf16"}),
    ("llama", {"dp_shard": 4, "ac": "full"}),
    ("llama", {"dp_replicate": 4, "dp_shard": 1}),
    ("llama", {"dp_shard": 2, "tp": 2, "mp": "bf16"}),
    ("qwen3", {"dp_shard": 4, "mp": "bf16"}),
]

#: ``tests/test_plan_memory.py``'s 6.5B-parameter GPT and its dry runs (world, layout).
BIG: dict[str, Any] = {"n_layer": 32, "n_head": 32, "d_model": 4096, "seq_len": 4096}
HSDP_8X8: dict[str, Any] = {
    "dp_replicate": 8,
    "microbatches": 2,
    "mp": "bf16",
    "ac": "selective",
}
GPT_DRY_RUNS: list[tuple[int, dict[str, Any]]] = [
    (64, {"batch_size": 64}),
    (64, {"batch_size": 128, **HSDP_8X8}),
    (1024, {"batch_size": 1024, "mp": "bf16", "ac": "full"}),
    (1024, {"batch_size": 1024, "tp": 8, "mp": "bf16"}),
]

CLI_8B_1024 = ["--preset", "llama3-8b", "--gpus", "1024", "--gpus-per-node", "8"]
CLI_8B_1024 += ["--seq-len", "8192", "--json"]
PLAN_70B_64 = ["plan", "--preset", "llama3.1-70b", "--gpus", "64", "--tp", "4", "--pp", "4"]
PLAN_70B_64 += ["--cp", "2", "--json", "--top", "1"]


# --- what a child process runs: returns (CPU seconds of the call, a note) -----------------


def _search(name: str, batch: int, gpus: int) -> Callable[[], tuple[float, str]]:
    def run() -> tuple[float, str]:
        from plait.plan import Workload, device, plan, preset

        model, work, h100 = preset(name), Workload(8192, batch), device("h100")
        start = time.process_time()
        found = plan(model, work, h100, gpus)
        seconds = time.process_time() - start
        return seconds, f"{len(found):,} layouts"

    return run


def _timed_main(main: Callable[[list[str]], int], argv: list[str]) -> tuple[float, str]:
    """CPU seconds of ``main(argv)`` (its JSON printed to a buffer), and how many layouts."""
    import contextlib
    import io

    out = io.StringIO()
    start = time.process_time()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    seconds = time.process_time() - start
    if status != 0:
        raise SystemExit(f"plait plan exited {status}")
    return seconds, f"{len(json.loads(out.getvalue())):,} layout(s) in the JSON"


def _cli_main() -> tuple[float, str]:
    from plait.plan.cli import main

    return _timed_main(main, CLI_8B_1024)


def _plan_70b_main() -> tuple[float, str]:
    from plait.cli import main

    return _timed_main(main, PLAN_70B_64)


def _dry_run(
    cfg_values: dict[str, Any], world: int, hf: dict[str, Any] | None
) -> tuple[float, str]:
    import tempfile

    from plait.plan.dryrun import dry_run
    from plait.train.config import TrainConfig

    with tempfile.TemporaryDirectory() as tmp:
        if hf is not None:
            path = Path(tmp) / "config.json"
            path.write_text(json.dumps(hf))
            cfg_values = {**cfg_values, "model_config": str(path)}
        cfg = TrainConfig(**cfg_values)
        start = time.process_time()
        measured = dry_run(cfg, world)
        seconds = time.process_time() - start
    return seconds, f"peak {measured.peak / 2**30:.2f} GiB"


def _llama_dry_run(family: str, layout: dict[str, Any]) -> Callable[[], tuple[float, str]]:
    hf = LLAMA if family == "llama" else QWEN3
    values = {"seq_len": 512, "batch_size": 8, **layout}
    return lambda: _dry_run(values, 4, hf)


def _wide_dry_run() -> tuple[float, str]:
    values = {"seq_len": 128, "batch_size": 96, "dp_shard": 96, "mp": "bf16"}
    return _dry_run(values, 96, WIDE)


def _gpt_dry_run(world: int, layout: dict[str, Any]) -> Callable[[], tuple[float, str]]:
    return lambda: _dry_run({**BIG, **layout}, world, None)


def _layout_id(layout: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items())


@dataclass(frozen=True)
class Case:
    """One row: a label, what the child runs (None: the ``plait plan`` command itself),
    and whether ``--quick`` skips it."""

    label: str
    run: Callable[[], tuple[float, str]] | None
    slow: bool = False


CASES: dict[str, Case] = {
    "search-405b-10240": Case(
        "cold search, llama3-405b, 10,240 GPUs, seq 8192, batch 10,240",
        _search("llama3-405b", 10240, 10240),
    ),
    "search-405b-10240-b2048": Case(
        "cold search, llama3-405b, 10,240 GPUs, seq 8192, batch 2,048",
        _search("llama3-405b", 2048, 10240),
    ),
    "search-8b-1024": Case(
        "cold search, llama3-8b, 1,024 GPUs, seq 8192, batch 1,024",
        _search("llama3-8b", 1024, 1024),
    ),
    "cli-8b-1024": Case("`plait.plan.cli.main`: " + " ".join(CLI_8B_1024), _cli_main),
    "cli-70b-64": Case("`plait.cli.main`: " + " ".join(PLAN_70B_64), _plan_70b_main),
    "plait-plan-70b-64": Case("`plait " + " ".join(PLAN_70B_64) + "` (whole process)", None),
}
for _i, (_family, _layout) in enumerate(LLAMA_DRY_RUNS):
    CASES[f"dryrun-{_family}-{_i}"] = Case(
        f"dry run, {_family} (tests' config), 4 ranks, {_layout_id(_layout)}",
        _llama_dry_run(_family, _layout),
    )
CASES["dryrun-wide-96"] = Case("dry run, wide llama, 96 ranks, dp_shard=96 mp=bf16", _wide_dry_run)
for _i, (_world, _layout) in enumerate(GPT_DRY_RUNS):
    CASES[f"dryrun-gpt7b-{_world}-{_i}"] = Case(
        f"dry run, 6.5B GPT, {_world:,} ranks, {_layout_id(_layout)}",
        _gpt_dry_run(_world, _layout),
        slow=_world >= 1024,
    )


def _plait_command() -> list[str]:
    """``plait``: the installed command beside this interpreter, else ``-m plait.cli``."""
    script = Path(sys.executable).with_name("plait")
    return [str(script)] if script.exists() else [sys.executable, "-m", "plait.cli"]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Timing:
    cpu: float  # of the call (the whole process for the plait plan command)
    process_cpu: float
    wall: float
    note: str


def _time(name: str) -> Timing:
    """One fresh process running case ``name``."""
    case = CASES[name]
    child = [sys.executable, str(Path(__file__).resolve()), "--child", name]
    argv = _plait_command() + PLAN_70B_64 if case.run is None else child
    cpu_before = _children_cpu()
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - start
    process_cpu = _children_cpu() - cpu_before
    if out.returncode != 0:
        raise SystemExit(f"{name} exited {out.returncode}:\n{out.stderr[-3000:]}")
    if case.run is None:
        return Timing(process_cpu, process_cpu, wall, f"{len(json.loads(out.stdout))} layout")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return Timing(result["cpu"], process_cpu, wall, result["note"])


def _child(name: str) -> None:
    run = CASES[name].run
    assert run is not None, f"{name} is timed from the parent"
    seconds, note = run()
    print(json.dumps({"cpu": seconds, "note": note}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 repeat, no 1,024-rank dry runs")
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    parser.add_argument("--child", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return
    repeats = 1 if args.quick else args.repeats
    names = [n for n, c in CASES.items() if args.only in n and not (args.quick and c.slow)]
    timings: dict[str, list[Timing]] = {n: [] for n in names}
    for _ in range(repeats):
        for name in names:
            timings[name].append(_time(name))
            print(f"{name}: {timings[name][-1]}", file=sys.stderr, flush=True)
    print("| case | median CPU s | range | process CPU s | process wall s | repeats | result |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in names:
        got = timings[name]
        cpu = [t.cpu for t in got]
        print(
            f"| {CASES[name].label} | {statistics.median(cpu):.2f} | {min(cpu):.2f}-{max(cpu):.2f}"
            f" | {statistics.median(t.process_cpu for t in got):.2f}"
            f" | {statistics.median(t.wall for t in got):.2f} | {len(got)} | {got[-1].note} |"
        )
    if "plait-plan-70b-64" in timings:
        median = statistics.median(t.cpu for t in timings["plait-plan-70b-64"])
        verdict = "met" if median < TARGET_CPU_S else "not met"
        print(
            f"\nIssue 38's target, `plait {' '.join(PLAN_70B_64)}` under {TARGET_CPU_S:.0f} s of "
            f"CPU (whole process, imports included): median {median:.2f} s, {verdict}."
        )


if __name__ == "__main__":
    main()
