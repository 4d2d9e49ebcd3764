"""``benchmarks.gpu_check``, the one command a session with a GPU runs, works before any GPU
does: its CPU smoke run gives every row of the table, with numbers, and its list of
CUDA-only tests names tests that exist.

The smoke run is the whole command at its tiniest (tiny-llama, 32 tokens x 2 sequences,
one timed step, the ``aot_eager`` backend: dynamo's capture without inductor's C++ build)
in one subprocess, every part in that process (``--in-process``): one torch import. Its
timings are noise on a shared CPU and are not checked, only that they exist.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import CUDA_TESTS, missing_test_ids
from benchmarks.gpu_kernels import (
    SIZES,
    Planner,
    attention_flops,
    planner_device,
    probes,
    ring_blocks,
)
from plait.plan.compute_time import EFFICIENCY
from plait.plan.devices import device
from plait.plan.models import preset
from plait.plan.roofline import block_kernels, gemm_seconds, profile
from plait.plan.stacks import cp_pass_bytes, stack

REPO = Path(__file__).resolve().parents[1]

#: (model, implementation, mode) of every row the CPU smoke run must give.
ROWS = {
    ("tiny-llama", "plait fully_shard", "eager"),
    ("tiny-llama", "torch fully_shard", "eager"),
    ("tiny-llama", "plait train", "eager"),
    ("tiny-llama", "plait fully_shard", "compile"),
    ("tiny-llama", "torch fully_shard", "compile"),
    ("tiny-llama", "plait train", "compile"),
    ("GPT MoE 4x top-2 (d 64, 2 layers)", "plait train", "eager"),
    ("GPT MoE 4x top-2 (d 64, 2 layers)", "plait fully_shard", "eager"),
    ("GPT MoE 4x top-2 (d 64, 2 layers)", "torch fully_shard", "eager"),
}


def test_listed_cuda_tests_exist() -> None:
    assert len(CUDA_TESTS) >= 5
    assert missing_test_ids() == []


def test_every_test_that_skips_without_cuda_is_listed() -> None:
    # A test skipped without CUDA runs nowhere but in gpu_check: one left off its list
    # would never run at all.
    listed = {node.partition("::")[2].split("[")[0] for node in CUDA_TESTS}
    skip = re.compile(
        r"@pytest\.mark\.skipif\(not torch\.cuda\.is_available\(\).*?\ndef (\w+)\(", re.S
    )
    found = {
        name
        for path in (Path(__file__).parent).glob("test_*.py")
        for name in skip.findall(path.read_text())
    }
    assert found and found <= listed, sorted(found - listed)


def _table(report: str) -> dict[tuple[str, str, str], list[str]]:
    """The report's table rows by (model, implementation, mode): their cells."""
    rows = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 10 and cells[0] not in ("model", "---"):
            rows[(cells[0], cells[1], cells[2])] = cells
    return rows


def test_cpu_smoke_gives_every_row(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.md"
    args = "--device cpu --in-process --model tiny-llama --seq-len 32 --batch 2 --warmup 1 "
    args += "--steps 1 --repeats 1 --train-steps 2 --backend aot_eager --mp bf16"
    command = [sys.executable, "-m", "benchmarks.gpu_check", *args.split(), "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = out.read_text()
    assert report in done.stdout  # printed, and written for pasting
    assert "torch 2." in report and "CUDA-only tests: skipped (no CUDA device here" in report
    rows = _table(report)
    assert set(rows) == ROWS, report
    for key, cells in rows.items():
        tokens_per_s = float(cells[4].replace(",", ""))
        assert tokens_per_s > 0 and cells[5].endswith("%"), (key, cells)
        assert "FAILED" not in cells[9], (key, cells)
    # Same weights, same batches: plait's fully_shard and torch's train alike.
    for model, _, mode in ROWS:
        ours = rows.get((model, "plait fully_shard", mode))
        if ours is not None:
            assert ours[8] == rows[(model, "torch fully_shard", mode)][8], report
    assert re.search(r"Not run \(they need two or more GPUs\)", report)
    kernels = _kernel_rows(report)
    kinds = {kind for kind, _ in kernels}
    assert kinds == {
        "gemm",
        "attention fwd",
        "attention bwd",
        "ring fwd",
        "ring bwd",
        "ring merges",
        "stream",
    }
    for key, cells in kernels.items():  # measured, no preset to compare with on a CPU
        assert float(cells[2].replace(",", "")) > 0 and cells[4] == "—", (key, cells)


def _kernel_rows(report: str) -> dict[tuple[str, str], list[str]]:
    """The kernels table's rows by (kernel, shape): their cells."""
    rows = {}
    for line in report.split("Kernels against the planner's roofline:")[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 6 and cells[0] not in ("kernel", "---"):
            rows[(cells[0], cells[1])] = cells
    return rows


def test_planner_figures_are_what_the_planner_charges() -> None:
    # The kernels part compares the GPU with the seconds plait plan gives each kernel: they
    # must be the cost model's own, not a copy that drifts from it.
    spec = device("h100")
    prof = profile(spec)
    assert prof is not None
    planner = Planner("h100")
    model = preset("llama3-8b")
    seq, width = 8192, model.q_width
    k = block_kernels(
        model, 1, seq, seq, 1, 2, False, prof, spec.flops, stack("plait"), False, "h100"
    )
    flops = attention_flops(seq, seq, width, causal=True)
    assert planner.attention(flops, False) * EFFICIENCY == pytest.approx(k.attention_fwd)
    assert planner.attention(flops, True) * EFFICIENCY == pytest.approx(k.attention_bwd)
    # One rank of the load-balanced ring does the work the planner charges at cp (its
    # memory-bound merges apart): 1/cp of the causal sequence's, cp times a cp-th's.
    tokens = 4096
    for cp in (2, 4, 8):
        ring = sum(attention_flops(q, kv, width, c) for q, kv, c in ring_blocks(cp, tokens))
        at_cp = block_kernels(
            model,
            1,
            tokens,
            cp * tokens,
            cp,
            2,
            False,
            prof,
            spec.flops,
            stack("plait"),
            False,
            "h100",
        )
        assert planner.attention(ring, False) * EFFICIENCY == pytest.approx(at_cp.attention_fwd)
    # torch's eager merges of one rank's blocks: what block_kernels adds to attention for
    # torch's context_parallel outside torch.compile (the key/value copies apart).
    merges = [p for p in probes("cpu", planner) if p.kind == "ring merges"]
    assert merges
    titan = stack("torchtitan")
    for probe in merges:
        cp = int(probe.shape.split(":")[0].removeprefix("cp "))
        tokens, heads, dim = SIZES["cpu"]["ring"][0], *SIZES["cpu"]["attention"][1:]
        tiny = dataclasses.replace(model, d_model=heads * dim, heads=heads, kv_heads=heads)
        args = (tiny, 1, tokens, cp * tokens, cp, 2, False, prof, spec.flops, titan, False, "h100")
        merged = cp_pass_bytes(titan, "allgather", cp, 0.0, compiled=False)
        plain = block_kernels(*args).attention_fwd
        charged = block_kernels(*args, cp_bytes=merged).attention_fwd - plain
        assert probe.planned is not None and probe.planned * EFFICIENCY == pytest.approx(charged)
    assert planner.gemm(8192, 4096, 4096) * EFFICIENCY == pytest.approx(
        gemm_seconds(8192, 4096, 4096, spec.flops, prof, 2)
    )
    assert (
        planner_device("NVIDIA H200") == "h200"
        and planner_device("NVIDIA H100 80GB HBM3") == "h100"
    )
    assert (
        planner_device("NVIDIA A100-SXM4-40GB") == "a100-40gb"
        and planner_device("Tesla T4") is None
    )
