"""Side-by-side benchmark runner: plait's modes beside torch's, interleaved, with repeats.

One invocation launches ``nproc`` CPU ranks (gloo, one thread each). Every rank builds all
requested modes up front (same model, same data, same AdamW step), then runs ``repeats``
rounds; each round visits every mode once, in an order rotated from round to round so no
mode always runs first or last, and times ``steps`` training steps of it. A step's time is
the slowest rank's. Modes marked ``single_process`` (the ``single`` baseline: one process,
the local batch) run on rank 0 while the other ranks wait.

Peak live tensor memory is measured separately, per mode, on fresh models run for two
untimed steps under ``plait.plan.live.LiveTensors`` (it slows ops down, so it never
overlaps timing).

The report gives, per mode: median step time, min-max, tokens/s, ratio to ``single``, ratio
to the torch counterpart, peak live MiB on the busiest rank, and the MiB all-gathered
(received) and reduce-scattered (sent) per step by the busiest rank during the timed steps
(``comm_bytes``); as JSON and Markdown. Modes that run all-to-alls (expert parallelism)
also get the bytes each rank sends to its peers per step (:func:`count_all_to_all_bytes`),
busiest rank and mean over ranks, beside the mode's ``all_to_all_formula`` when it has
one; these columns appear only when some mode sends any.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.comm_bytes import count_comm_bytes
from plait.plan.live import LiveTensors
from plait.train.model import GPTConfig

Step = Callable[[], None]


@dataclass(frozen=True)
class BenchConfig:
    nproc: int = 2
    repeats: int = 5
    steps: int = 4
    warmup: int = 2
    batch: int = 8  # sequences per rank (the local batch)
    gpt: GPTConfig = field(default_factory=GPTConfig)
    microbatches: int = 8  # pipeline modes only


@dataclass(frozen=True)
class Mode:
    """A named way to train the benchmark model; ``build`` returns one training step."""

    name: str
    build: Callable[[BenchConfig], Step]
    single_process: bool = False
    torch_counterpart: str | None = None
    pipeline: bool = False  # all ranks share one batch (tokens/s counts it once)
    # False for compiled modes: torch.compile refuses to run under the memory tracker (a
    # dispatch mode), so their peak memory is not measured.
    measure_memory: bool = True
    # The all-to-all bytes one rank is expected to send to its peers per step (a model of
    # the traffic, e.g. balanced routing), shown beside the measured bytes.
    all_to_all_formula: Callable[[BenchConfig], float] | None = None


@contextlib.contextmanager
def count_all_to_all_bytes() -> Iterator[dict[str, int]]:
    """Yield ``{"all_to_all": bytes}``: what this rank's ``all_to_all_single`` calls send to
    the other ranks of their group (the share a rank keeps for itself is not counted),
    from the split sizes when given, else the equal split. Wraps the c10d function the
    way ``benchmarks.comm_bytes`` wraps all-gather and reduce-scatter: callers that look it
    up on ``torch.distributed`` at call time (plait's expert dispatch) are all seen."""
    totals = {"all_to_all": 0}
    original = dist.all_to_all_single

    def call(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        # c10d's order: output, input, output_split_sizes, input_split_sizes, group, async_op
        if isinstance(input, torch.Tensor) and input.numel():
            group = kwargs["group"] if "group" in kwargs else _arg(args, 2)
            splits = kwargs["input_split_sizes"] if "input_split_sizes" in kwargs else _arg(args, 1)
            me, size = dist.get_rank(group), dist.get_world_size(group)
            rows = list(splits) if splits else [input.shape[0] // size] * size
            row_bytes = input[0].numel() * input.element_size()
            totals["all_to_all"] += (sum(rows) - rows[me]) * row_bytes
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = call
    try:
        yield totals
    finally:
        dist.all_to_all_single = original


def _arg(args: tuple[Any, ...], index: int) -> Any:
    return args[index] if len(args) > index else None


def launch(cfg: BenchConfig, modes: list[Mode]) -> dict[str, Any]:
    """Run ``modes`` on ``cfg.nproc`` fresh ranks; return rank 0's report."""
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as tmp:
        out = os.path.join(tmp, "report.json")
        store = os.path.join(tmp, "store")
        mp.spawn(_rank_main, args=(cfg, modes, store, out), nprocs=cfg.nproc, join=True)
        with open(out) as f:
            report: dict[str, Any] = json.load(f)
    return report


def _rank_main(rank: int, cfg: BenchConfig, modes: list[Mode], store: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=cfg.nproc,
        timeout=timedelta(minutes=10),
    )
    try:
        times, cpu, comm = _time_modes(cfg, modes)
        peaks = {m.name: _peak_bytes(cfg, m) for m in modes if m.measure_memory}
        if rank == 0:
            report = _report(cfg, modes, times, cpu, peaks, comm)
            with open(out, "w") as f:
                json.dump(report, f)
        # Every rank done with its collectives before any tears gloo down: a rank that
        # destroyed the group while its peer still used it made the peer abort
        # ("terminate called without an active exception") about one run in two.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _runs_here(mode: Mode) -> bool:
    return not mode.single_process or dist.get_rank() == 0


def _time_modes(
    cfg: BenchConfig, modes: list[Mode]
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, dict[str, float]]]:
    """Wall time and this thread's CPU time of every step, each the max over ranks, and the
    bytes all-gathered and reduce-scattered per step (``count_comm_bytes``, max over ranks)
    and sent by all-to-all (``count_all_to_all_bytes``, max and mean over ranks).

    CPU time (``time.thread_time`` of the training thread) counts the library's own work
    and not time spent waiting for peers or for a core, so it stays meaningful on a busy
    machine where wall times are dominated by scheduling.
    """
    steps = {m.name: m.build(cfg) for m in modes if _runs_here(m)}
    for m in modes:
        dist.barrier()
        if _runs_here(m):
            for _ in range(cfg.warmup):
                steps[m.name]()
    times: dict[str, list[float]] = {m.name: [] for m in modes}
    cpu: dict[str, list[float]] = {m.name: [] for m in modes}
    comm = torch.zeros(len(modes), 3, dtype=torch.float64)
    for round_ in range(cfg.repeats):
        shift = round_ % len(modes)
        for m in modes[shift:] + modes[:shift]:
            dist.barrier()
            local = torch.zeros(2, cfg.steps, dtype=torch.float64)
            if _runs_here(m):
                with count_comm_bytes() as moved, count_all_to_all_bytes() as sent:
                    for i in range(cfg.steps):
                        start, start_cpu = time.perf_counter(), time.thread_time()
                        steps[m.name]()
                        local[0, i] = time.perf_counter() - start
                        local[1, i] = time.thread_time() - start_cpu
                comm[modes.index(m)] += torch.tensor(
                    [moved["all_gather"], moved["reduce_scatter"], sent["all_to_all"]],
                    dtype=torch.float64,
                )
            dist.all_reduce(local, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
            times[m.name] += local[0].tolist()
            cpu[m.name] += local[1].tolist()
    sent_total = comm[:, 2].clone()
    dist.all_reduce(sent_total)
    dist.all_reduce(comm, op=dist.ReduceOp.MAX)
    comm /= cfg.repeats * cfg.steps
    sent_total /= cfg.repeats * cfg.steps
    per_step = {
        m.name: {
            "all_gather": float(row[0]),
            "reduce_scatter": float(row[1]),
            "all_to_all": float(row[2]),
            "all_to_all_mean": float(total) / (1 if m.single_process else dist.get_world_size()),
        }
        for m, row, total in zip(modes, comm, sent_total, strict=True)
    }
    return times, cpu, per_step


def _peak_bytes(cfg: BenchConfig, mode: Mode) -> int:
    peak = torch.zeros(1, dtype=torch.int64)
    dist.barrier()
    if _runs_here(mode):
        with LiveTensors() as tracker:
            step = mode.build(cfg)
            step()
            step()
        peak[0] = tracker.peak
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def _report(
    cfg: BenchConfig,
    modes: list[Mode],
    times: dict[str, list[float]],
    cpu: dict[str, list[float]],
    peaks: dict[str, int],
    comm: dict[str, dict[str, float]],
) -> dict[str, Any]:
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    cpu_medians = {name: statistics.median(ts) for name, ts in cpu.items()}
    tokens_per_step = cfg.batch * cfg.gpt.seq_len
    rows = []
    for m in modes:
        med = medians[m.name]
        ranks = 1 if m.single_process or m.pipeline else cfg.nproc
        row = {
            "mode": m.name,
            "median_s": med,
            "min_s": min(times[m.name]),
            "max_s": max(times[m.name]),
            "tokens_per_s": tokens_per_step * ranks / med,
            "vs_single": med / medians["single"] if "single" in medians else None,
            "torch_counterpart": m.torch_counterpart,
            "vs_torch": (
                med / medians[m.torch_counterpart] if m.torch_counterpart in medians else None
            ),
            "cpu_median_s": cpu_medians[m.name],
            "cpu_vs_torch": (
                cpu_medians[m.name] / cpu_medians[m.torch_counterpart]
                if m.torch_counterpart in cpu_medians
                else None
            ),
            "peak_mib_per_rank": peaks[m.name] / 2**20 if m.name in peaks else None,
            "all_gather_mib_per_step": comm[m.name]["all_gather"] / 2**20,
            "reduce_scatter_mib_per_step": comm[m.name]["reduce_scatter"] / 2**20,
            # all-to-all bytes sent to peers per step: busiest rank, mean rank, the formula's
            "all_to_all_bytes_per_step": comm[m.name]["all_to_all"],
            "all_to_all_mean_bytes_per_step": comm[m.name]["all_to_all_mean"],
            "all_to_all_formula_bytes": (
                m.all_to_all_formula(cfg) if m.all_to_all_formula is not None else None
            ),
            "step_times_s": times[m.name],
            "step_cpu_s": cpu[m.name],
        }
        if m.torch_counterpart in peaks and m.name in peaks:
            row["mem_vs_torch"] = peaks[m.name] / max(peaks[m.torch_counterpart], 1)
        rows.append(row)
    config = asdict(cfg)
    return {"config": config, "modes": rows, "markdown": markdown_table(rows)}


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _all_to_all_cells(r: dict[str, Any]) -> str:
    """The all-to-all columns of row ``r``: MiB sent to peers per step by the busiest rank
    and by the mean rank, the formula's MiB and mean / formula."""
    formula = r.get("all_to_all_formula_bytes")
    mean = r.get("all_to_all_mean_bytes_per_step", 0.0)
    ratio = _ratio(mean / formula) if formula else "—"
    shown = "—" if formula is None else f"{formula / 2**20:.3f}"
    return (
        f" {r.get('all_to_all_bytes_per_step', 0.0) / 2**20:.3f} | {mean / 2**20:.3f} | "
        f"{shown} | {ratio} |"
    )


def _all_to_all_agreement(rows: list[dict[str, Any]]) -> list[str]:
    """One line per mode whose torch counterpart ran: are their all-to-all bytes equal?"""
    by_name = {r["mode"]: r for r in rows}
    lines = []
    for r in rows:
        other = by_name.get(r["torch_counterpart"] or "")
        if other is None or not (
            r["all_to_all_bytes_per_step"] or other["all_to_all_bytes_per_step"]
        ):
            continue
        keys = ("all_to_all_bytes_per_step", "all_to_all_mean_bytes_per_step")
        same = all(r[k] == other[k] for k in keys)
        lines.append(
            f"all-to-all bytes of {r['mode']} and {other['mode']}: "
            + ("identical" if same else f"DIFFER ({r[keys[1]]:.0f} vs {other[keys[1]]:.0f})")
        )
    return lines


def markdown_table(rows: list[dict[str, Any]]) -> str:
    a2a = any(r.get("all_to_all_bytes_per_step") for r in rows)
    lines = [
        "| mode | median step (ms) | min-max (ms) | tokens/s | vs single | vs torch | "
        "CPU ms/step | CPU vs torch | peak MiB/rank | mem vs torch | AG MiB/step | RS MiB/step |"
        + (
            " A2A MiB/step (max rank) | A2A MiB/step (mean rank) | A2A formula MiB | "
            "mean / formula |"
            if a2a
            else ""
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        + (" ---: | ---: | ---: | ---: |" if a2a else ""),
    ]
    for r in rows:
        versus = _ratio(r["vs_torch"])
        if r["torch_counterpart"] and r["vs_torch"] is not None:
            versus += f" ({r['torch_counterpart']})"
        lines.append(
            f"| {r['mode']} | {r['median_s'] * 1e3:.1f} | "
            f"{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
            f"{_ratio(r['vs_single'])} | {versus} | {r['cpu_median_s'] * 1e3:.1f} | "
            f"{_ratio(r['cpu_vs_torch'])} | {_mib(r['peak_mib_per_rank'])} | "
            f"{_ratio(r.get('mem_vs_torch'))} | {r['all_gather_mib_per_step']:.3f} | "
            f"{r['reduce_scatter_mib_per_step']:.3f} |" + (_all_to_all_cells(r) if a2a else "")
        )
    if a2a:
        lines += ["", *_all_to_all_agreement(rows)]
    return "\n".join(lines)
