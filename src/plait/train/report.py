"""What a run leaves for a person to read: the summary table and the loss-curve PNG."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from plait.layout import Layout
from plait.train.config import TrainConfig
from plait.train.flops import Peak, mfu
from plait.train.progress import format_mfu
from plait.train.restart import restart_summary

__all__ = ["expert_rows", "imbalance", "plot_loss_curve", "summary_table"]

LOSS_CURVE = "loss.png"


def _layout(layout: Layout) -> str:
    """The mesh, every dimension shown (outermost first), e.g. ``pp=2 x dp_replicate=1 x
    dp_shard=1 x tp=2, sequence parallel``."""
    mesh = " x ".join(
        f"{name}={size}" for name, size in layout.sizes.items() if name != "cp" or size > 1
    )
    if layout.ep > 1:
        mesh += f", experts over ep={layout.ep} x efsdp={layout.dp_shard // layout.ep}"
    if layout.tp > 1:
        mesh += ", sequence parallel" if layout.sequence_parallel else ", no sequence parallelism"
    return mesh


def imbalance(load: Any) -> float:
    """The worst block's load imbalance: max over blocks of (most tokens an expert got) /
    (mean per expert); 1.0 is perfect balance. ``load``: tokens per expert per block, a
    ``(blocks, experts)`` tensor or nested lists."""
    rows = load.tolist() if hasattr(load, "tolist") else load
    return max((max(r) / (sum(r) / len(r)) if sum(r) else 1.0) for r in rows)


#: Up to this many experts a summary row lists every count; beyond, min / max only.
_LISTED_EXPERTS = 16


def expert_rows(load: list[list[int]]) -> list[tuple[str, str]]:
    """Summary rows of a step's expert load: per block, tokens per expert and max / mean."""
    rows = []
    for i, counts in enumerate(load):
        shown = (
            " ".join(str(c) for c in counts)
            if len(counts) <= _LISTED_EXPERTS
            else f"min {min(counts)}, max {max(counts)}"
        )
        rows.append((f"expert load, block {i}", f"{shown} (max/mean {imbalance([counts]):.2f})"))
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def summary_table(
    cfg: TrainConfig,
    records: list[dict[str, Any]],
    session_steps: list[dict[str, Any]],
    peak_memory: list[int],
    run_dir: str | Path,
    *,
    mfu_of: tuple[float, Peak] | None = None,
    staged_bytes: list[int] | None = None,
) -> str:
    """The end-of-run table. ``cfg``: the whole configuration (the table reports the steps
    and batch, the sequence length, the processes, device and layout); ``records``: the
    whole run's metrics (a resumed run's too); ``session_steps``: the training records of
    this session, timed here; ``mfu_of``: the model's training FLOPs per token and the
    peak (:mod:`plait.train.flops`), for the MFU of the steady tokens/s; ``staged_bytes``:
    each rank's staging copy of an asynchronous checkpoint."""
    times = [r["step_time"] for r in session_steps]
    steady = times[1:] or times  # the first step also pays for warm-up (allocations, plans)
    tokens = cfg.batch_size * cfg.seq_len * len(steady)
    val = [r for r in records if "val_loss" in r]
    memory_kind = "peak allocated" if cfg.device == "cuda" else "peak RSS"
    rows = [
        ("steps", f"{records[-1]['step'] if records else 0} of {cfg.steps}"),
        ("layout", f"{cfg.nproc} x {cfg.device} ({_layout(cfg.layout)})"),
        ("tokens/s", f"{tokens / sum(steady):,.0f}" if times else "-"),
    ]
    if mfu_of is not None:
        per_token, peak = mfu_of
        rate = mfu(tokens / sum(steady), per_token, peak.flops) if times else None
        rows += [
            ("MFU", f"{format_mfu(rate)} ({per_token:.3g} FLOPs per token)"),
            ("peak FLOP/s", f"{peak.flops:.3g} ({peak.source})"),
        ]
    rows += [
        ("median step time", f"{statistics.median(times) * 1000:,.1f} ms" if times else "-"),
    ]
    if val:
        first, last = val[0], val[-1]
        rows.append(
            (
                "validation loss",
                f"{first['val_loss']:.4f} (step {first['step']}) -> "
                f"{last['val_loss']:.4f} (step {last['step']})",
            )
        )
    rows += _checkpoint_rows(records, staged_bytes or [])
    restarts = restart_summary(records)
    if restarts:
        rows.append(("restarts", restarts))
    loads = [r for r in session_steps if "expert_load" in r]
    if loads:  # tokens per expert in the last step
        rows += expert_rows(loads[-1]["expert_load"])
    rows += [(f"{memory_kind}, rank {r}", _mib(b)) for r, b in enumerate(peak_memory)]
    rows.append(("run directory", str(run_dir)))
    width = max(len(name) for name, _ in rows)
    rule = "-" * (width + 2 + max(len(value) for _, value in rows))
    lines = [rule] + [f"{name:<{width}}  {value}" for name, value in rows] + [rule]
    return "\n".join(lines)


def _checkpoint_rows(records: list[dict[str, Any]], staged: list[int]) -> list[tuple[str, str]]:
    """What the run's checkpoints and snapshots cost training: how many, how long training
    waited for each (median), and for asynchronous ones the background writes and the
    staging copy (one for both)."""
    rows = []
    for event in ("checkpoint", "snapshot"):
        saves = [r for r in records if r.get("event") == event]
        if not saves:
            continue
        blocked = statistics.median(r["blocked_s"] for r in saves) * 1000
        how = "async" if saves[-1]["async"] else "sync"
        waited = f"{len(saves)} {how}, training waited {blocked:,.1f} ms each (median)"
        rows.append((f"{event}s", waited))
        writes = [r["write_s"] for r in records if r.get("event") == f"{event}_written"]
        if writes:
            write = f"{statistics.median(writes) * 1000:,.1f} ms each (median), in the background"
            rows.append((f"{event} writes", write))
    if rows and staged:
        most = max(staged) / 2**20
        rows.append(("checkpoint staging", f"{most:,.2f} MiB of host memory per rank (most)"))
    return rows


def plot_loss_curve(records: list[dict[str, Any]], run_dir: str | Path) -> str:
    """Draw training and validation loss against step into ``<run_dir>/loss.png``;
    returns a line saying where it went, or why it was not drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        from matplotlib import pyplot as plt
    except ImportError:
        return "loss curve not drawn: matplotlib is not installed (pip install 'plait[train]')"
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train")
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(run_dir) / LOSS_CURVE
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"loss curve: {path}"
