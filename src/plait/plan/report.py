"""How a plan is shown: a table of the best layouts, the command lines that launch the
best one, and a JSON form for programs (sizes in bytes, times in seconds). For a mixture
of experts the header gives total and active parameters and the table the bytes each rank
sends per step in expert parallelism's all-to-alls; with context parallelism the table
gives the bytes each rank sends per step in attention's key/value exchange. Where the
best layout is of a kind the planner has missed published runs of by more than usual, a
line says how far (:mod:`plait.plan.accuracy`)."""

from __future__ import annotations

import math
import shlex
from typing import Any

from plait.layout import CP, EP, flag, stage_blocks
from plait.plan.accuracy import accuracy_notes
from plait.plan.comm import Collective
from plait.plan.models import flops_per_token, param_counts
from plait.plan.search import Candidate, describe
from plait.plan.spec import (
    LAYOUT_DIMS,
    DeviceSpec,
    Layout,
    MemoryBreakdown,
    ModelSpec,
    Software,
    Workload,
)

__all__ = [
    "all_to_all_per_step",
    "cp_per_step",
    "format_plan",
    "memory_parts",
    "size",
    "speed_flags",
    "stage_split",
    "to_json",
    "torchrun_command",
    "train_command",
]

_GIB = 2.0**30


def memory_parts(mem: MemoryBreakdown) -> dict[str, float]:
    """A rank's memory by part, in bytes (without ``extra``), in a fixed order."""
    parts = ("params", "grads", "optimizer", "unsharded", "activations", "buffers")
    return {name: getattr(mem, name) for name in parts}


def size(nbytes: float) -> str:
    """``nbytes`` in GiB, or MiB / KiB when smaller: ``61.6 GiB``, ``-3.2 MiB``."""
    sign = "-" if nbytes < 0 else ""
    for unit, scale in (("GiB", _GIB), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if abs(nbytes) >= scale:
            return f"{sign}{abs(nbytes) / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def all_to_all_per_step(collectives: tuple[Collective, ...]) -> float:
    """Bytes one rank sends per step in expert parallelism's all-to-alls of routed rows."""
    return sum(k.bytes for k in collectives if k.dim == EP and k.op == "all_to_all")


def cp_per_step(collectives: tuple[Collective, ...]) -> float:
    """Bytes one rank sends per step in context parallelism's attention exchange."""
    return sum(k.bytes for k in collectives if k.dim == CP)


def _model_flags(model: ModelSpec) -> list[str]:
    if model.source:  # plait train builds this very model from its preset or config.json
        return [f"--model-config {shlex.quote(model.source)}"]
    flags = [f"--n-layer {model.layers}", f"--n-head {model.heads}", f"--d-model {model.d_model}"]
    if model.experts:
        flags += [
            f"--experts {model.experts}",
            f"--top-k {model.top_k}",
            f"--shared-experts {model.shared_experts}",
            f"--expert-hidden {model.expert_hidden}",
        ]
    return flags


def speed_flags(software: Software | None) -> tuple[str, ...]:
    """``plait train``'s flags for ``software``'s compile and Float8: ``--compile``, and
    ``--float8`` for the tensorwise recipe (plait's; it gathers the weights in fp8 under
    ``fully_shard`` by itself). Rowwise has no ``plait train`` flag."""
    if software is None:
        return ()
    flags = ("--compile",) if software.compiled else ()
    return flags + (("--float8",) if software.float8 == "tensorwise" else ())


def _layout_flags(
    layout: Layout, model: ModelSpec, work: Workload, device: DeviceSpec, speed: tuple[str, ...]
) -> str:
    # --cp only when used: the commands of layouts without it read as before
    flags = [
        f"{flag(name)} {getattr(layout, name)}"
        for name in LAYOUT_DIMS
        if name != CP or layout.cp > 1
    ]
    if layout.cp > 1:
        flags.append(f"--cp-method {layout.cp_method}")
    if layout.ep > 1:
        flags.append(f"--ep {layout.ep}")
    if layout.pp > 1:
        flags += [f"--schedule {layout.schedule}", f"--stages-per-rank {layout.stages_per_rank}"]
        if layout.end_blocks:
            flags.append(f"--end-blocks {layout.end_blocks}")
        if layout.max_active_stages:
            flags.append(f"--max-active-stages {layout.max_active_stages}")
    flags += [
        f"--microbatches {layout.microbatches}",
        f"--ac {layout.ac}",
        f"--mp {work.precision}",
    ]
    if not layout.reshard_after_forward:
        flags.append("--no-reshard-after-forward")
    if layout.tp > 1 and not layout.sequence_parallel:
        flags.append("--no-sequence-parallel")
    flags += [f"--batch-size {work.global_batch}", f"--seq-len {work.seq_len}"]
    flags += [*speed, *_model_flags(model)]
    flags.append("--device cpu" if device.name.startswith("cpu") else "--device cuda")
    return " ".join(flags)


def train_command(
    layout: Layout,
    model: ModelSpec,
    work: Workload,
    device: DeviceSpec,
    speed: tuple[str, ...] = (),
) -> str:
    """``plait train`` running ``layout`` for ``work`` (model flags: plait's GPT of
    ``model``'s depth, heads and width; ``speed``: :func:`speed_flags`): with ``--nproc``
    local workers when one node holds them all, else the flags each torchrun worker takes
    (:func:`torchrun_command`)."""
    nproc = f"--nproc {layout.world} " if layout.world <= device.gpus_per_node else ""
    return f"plait train {nproc}" + _layout_flags(layout, model, work, device, speed)


def torchrun_command(
    layout: Layout,
    model: ModelSpec,
    work: Workload,
    device: DeviceSpec,
    speed: tuple[str, ...] = (),
) -> str:
    """The same run launched by torchrun on every node (``$HEAD``: the first node)."""
    per_node = min(device.gpus_per_node, layout.world)
    nodes = math.ceil(layout.world / per_node)
    rdzv = " --rdzv-backend c10d --rdzv-endpoint $HEAD:29500" if nodes > 1 else ""
    flags = _layout_flags(layout, model, work, device, speed)
    return f"torchrun --nnodes {nodes} --nproc-per-node {per_node}{rdzv} -m plait train {flags}"


def to_json(
    c: Candidate,
    model: ModelSpec,
    work: Workload,
    device: DeviceSpec,
    speed: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One candidate as plain JSON values (bytes, seconds, fractions; ``speed``: the
    commands' :func:`speed_flags`)."""
    mem = c.memory
    return {
        "layout": {**vars(c.layout), "world": c.layout.world},
        "summary": describe(c.layout),
        "fits": c.fits,
        "memory": {
            **memory_parts(mem),
            "extra": dict(mem.extra),
            "total": mem.total,
            "device": device.memory,
        },
        "communication": [
            {"dim": k.dim, "op": k.op, "bytes": k.bytes, "calls": k.calls, "seconds": k.seconds}
            for k in c.timing.collectives
        ],
        "bubble": c.timing.bubble,
        "step_time_s": c.timing.step_time,
        "compute_s": c.timing.compute,
        "exposed_comm_s": c.timing.exposed_comm,
        "tokens_per_s_per_device": c.timing.tokens_per_s_per_device,
        "mfu": c.timing.mfu,
        "all_to_all_bytes_per_step": all_to_all_per_step(c.timing.collectives),
        "cp_bytes_per_step": cp_per_step(c.timing.collectives),
        "command": train_command(c.layout, model, work, device, speed),
        "torchrun": torchrun_command(c.layout, model, work, device, speed),
        "accuracy": accuracy_notes(c.layout, model, work),
    }


def format_plan(
    candidates: list[Candidate],
    model: ModelSpec,
    work: Workload,
    device: DeviceSpec,
    gpus: int,
    speed: tuple[str, ...] = (),
) -> str:
    """The header, a table of ``candidates`` (best first) and the best one's commands
    (``speed``: their :func:`speed_flags`)."""
    counts = param_counts(model)
    params = _count(counts.total(model.layers))
    if model.experts:
        moe = f"{model.experts} experts, top-{model.top_k}"
        moe += f" + {model.shared_experts} shared" if model.shared_experts else ""
        moe += f", {model.dense_layers} dense layers" if model.dense_layers else ""
        params += f" ({_count(counts.active(model.layers))} active; {moe})"
    lines = [
        f"{model.name}: {params} parameters, {flops_per_token(model, work.seq_len):.3g} "
        f"FLOPs/token; {work.global_batch} x {work.seq_len} tokens per step, {work.precision}; "
        f"{gpus} x {device.name} ({device.memory / _GIB:.0f} GiB, {device.gpus_per_node} per node)",
        "",
    ]
    head: tuple[str, ...] = (
        "#",
        "layout",
        "peak memory",
        "step s",
        "tokens/s/dev",
        "MFU",
        "bubble",
        "exposed s",
    )
    rows: list[tuple[str, ...]] = [
        (
            str(i),
            describe(c.layout),
            size(c.memory.total),
            f"{c.timing.step_time:.3f}",
            f"{c.timing.tokens_per_s_per_device:,.0f}",
            f"{c.timing.mfu:.1%}",
            f"{c.timing.bubble:.1%}",
            f"{c.timing.exposed_comm:.3f}",
        )
        for i, c in enumerate(candidates, 1)
    ]
    if model.experts:  # expert parallelism's all-to-alls, per rank and step
        head += ("all-to-all/step",)
        rows = [
            (*row, size(all_to_all_per_step(c.timing.collectives)))
            for row, c in zip(rows, candidates, strict=True)
        ]
    if any(c.layout.cp > 1 for c in candidates):  # attention's exchange, per rank and step
        head += ("cp/step",)
        rows = [
            (*row, size(cp_per_step(c.timing.collectives)))
            for row, c in zip(rows, candidates, strict=True)
        ]
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
    for row in [head, *rows]:
        cells = [row[1].ljust(widths[1])] + [
            v.rjust(w) for v, w in zip(row[2:], widths[2:], strict=True)
        ]
        lines.append(row[0].rjust(widths[0]) + "  " + "  ".join(cells))
    best = candidates[0]
    mem = best.memory
    parts = {**memory_parts(mem), **mem.extra}
    lines += ["", "best, per rank: " + ", ".join(f"{k} {size(v)}" for k, v in parts.items())]
    if best.layout.pp > 1:
        lines.append("  " + stage_split(best.layout, model.layers))
    lines += [
        "  " + train_command(best.layout, model, work, device, speed),
        "  " + torchrun_command(best.layout, model, work, device, speed),
    ]
    lines += ["  " + note for note in accuracy_notes(best.layout, model, work)]
    if not model.source and (model.gated or model.kv_heads != model.heads or model.dense_layers):
        lines.append(
            f"  (plait train builds its GPT; {model.name}'s exact blocks need your own model "
            "with the same layout flags)"
        )
    return "\n".join(lines)


def stage_split(layout: Layout, layers: int) -> str:
    """The blocks of each pipeline stage in order, runs of equal stages folded:
    ``blocks per stage: 0, 1 x 126, 0 (the embedding on the first, the head on the last)``."""
    sizes = stage_blocks(layers, layout.n_stages, layout.end_blocks)
    runs: list[list[int]] = []  # [size, count]
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    text = ", ".join(f"{size} x {count}" if count > 1 else str(size) for size, count in runs)
    return f"blocks per stage: {text} (the embedding on the first, the head on the last)"
