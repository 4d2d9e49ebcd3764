"""The planner's kernel figures against the GPU at hand: ``gpu_check``'s ``kernels`` part.

``plait plan`` prices a step from a roofline (:mod:`plait.plan.roofline`): GEMMs at a
fraction of the dense peak that depends on their shape, flash attention at cited
FlashAttention-2 fractions, memory-bound work at a fraction of the HBM bandwidth, every
kernel time divided by the fitted sustained fraction
(:data:`plait.plan.compute_time.EFFICIENCY`). None of those has been measured here: plait
is developed on CPUs. This part times each kind of kernel on the lent GPU, at the shapes
the published runs have, beside the seconds the planner gives the same kernel on the
matching preset (:func:`planner_device`):

* ``gemm``: bf16 matmuls of a Llama 3 8B block at 8,192 tokens (q / o, k / v, gate / up,
  down) and two cubes;
* ``attention``: SDPA's flash kernel (what plait and torchtitan run), causal, forward and
  backward apart, one sequence of 8k and 32k tokens, 32 heads of 128;
* ``ring``: the attention one rank of torch's load-balanced ring runs under context
  parallelism ``cp`` with ``tokens`` tokens per rank (the sequence ``cp x tokens``): the
  diagonal block causal, then ``cp - 1`` blocks of half the keys or half the queries, not
  causal (forward and backward; the exchange and the fp32 merges are not in it). Per rank
  the work grows linearly with ``cp``, and so does the planner's time: a ratio that climbs
  with ``cp`` is a kernel that slows down at long sequences, one candidate for torchtitan's
  published 128k-256k rows being slower than the planner predicts (issue 38);
* ``ring merges``: torch's own merge of those blocks' outputs (``_SDPAMerger``, eager, as
  ``context_parallel`` runs it without ``torch.compile``), beside the bytes the planner
  charges it (:func:`plait.plan.stacks.cp_pass_bytes`); its rate is those bytes over the
  time measured, to set beside the copy's;
* ``stream``: a copy of 1 GiB (the bandwidth of the memory-bound passes).

Each figure is the median of ``repeats`` timed calls after one warm-up call. The table's
last column is measured over planned seconds: above 1, the device is slower than the
planner thinks for that kernel. On a CPU (the smoke test) the shapes are tiny and there is
no preset to compare with: the planner's columns are empty.

Run alone: ``python -m benchmarks.gpu_kernels`` (the table on stdout).
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Shapes by device: (tokens of the GEMMs, model width, MLP width, k / v width),
#: attention (sequences, heads, head dimension), ring (tokens per rank, cp degrees),
#: stream bytes.
SIZES: dict[str, dict[str, Any]] = {
    "cuda": {
        "gemm": (8192, 4096, 14336, 1024),
        "cubes": (2048, 8192),
        "attention": ((8192, 32768), 32, 128),
        "ring": (32768, (1, 2, 4, 8)),
        "stream": 2**30,
    },
    "cpu": {
        "gemm": (64, 64, 128, 32),
        "cubes": (32,),
        "attention": ((64,), 2, 16),
        "ring": (32, (1, 2, 4)),
        "stream": 2**20,
    },
}
REPEATS = 5


@dataclass(frozen=True)
class Probe:
    """One kernel to time: ``run`` makes it happen once; ``flops`` (counted as the
    planner counts them: a causal kernel half) or ``nbytes`` give the achieved rate;
    ``planned`` the planner's seconds (None: no preset)."""

    kind: str
    shape: str
    run: Callable[[], object]
    flops: float = 0.0
    nbytes: float = 0.0
    planned: float | None = None


def planner_device(name: str) -> str | None:
    """The ``plait plan`` preset for a CUDA device named ``name`` (None: none)."""
    lowered = name.lower()
    for marker, preset in (("h200", "h200"), ("h100", "h100"), ("b200", "b200")):
        if marker in lowered:
            return preset
    if "a100" in lowered:
        return "a100-40gb" if "40gb" in lowered.replace(" ", "") else "a100"
    return None


class Planner:
    """The planner's seconds for one kernel on the preset ``name`` (its stack ``plait``:
    FlashAttention-2), the sustained fraction applied as the planner applies it."""

    def __init__(self, name: str) -> None:
        from plait.plan import compute_time, devices, roofline

        self.spec = devices.device(name)
        prof = roofline.profile(self.spec)
        if prof is None:
            raise ValueError(f"preset {name!r} has no roofline profile")
        self.prof = prof
        self.peak = devices.compute_peak(self.spec, "bf16")
        self.sustained = compute_time.EFFICIENCY
        self.fractions = roofline.attention_fractions("fa2", self.spec.name, prof)

    def gemm(self, m: int, n: int, k: int) -> float:
        from plait.plan.roofline import gemm_seconds

        return gemm_seconds(m, n, k, self.peak, self.prof, 2) / self.sustained

    def attention(self, flops: float, backward: bool) -> float:
        """``flops``: the forward's, counted as the planner counts them (causal: half)."""
        from plait.plan.roofline import flash_seconds

        return (
            flash_seconds(flops, self.fractions, self.peak)[1 if backward else 0] / self.sustained
        )

    def stream(self, nbytes: float) -> float:
        from plait.plan.roofline import elementwise_seconds

        return elementwise_seconds(nbytes, self.prof) / self.sustained


def attention_flops(queries: int, keys: int, width: int, causal: bool) -> float:
    """Forward FLOPs of attention (scores and weighted values, ``width`` = heads x head
    dimension) as the planner counts them: a causal kernel computes half."""
    return 4.0 * queries * keys * width * (0.5 if causal else 1.0)


def ring_blocks(cp: int, tokens: int) -> list[tuple[int, int, bool]]:
    """(queries, keys, causal) of the attention calls one rank of torch's load-balanced
    ring makes for ``tokens`` local tokens: the diagonal, then per later step either half
    the keys (a step from a rank before it) or half the queries (from one after; the
    middle rank's mix)."""
    blocks = [(tokens, tokens, True)]
    for step in range(1, cp):
        blocks.append(
            (tokens, tokens // 2, False) if step <= cp // 2 else (tokens // 2, tokens, False)
        )
    return blocks


def probes(device: str, planner: Planner | None) -> list[Probe]:
    """Every probe at ``device``'s sizes (:data:`SIZES`)."""
    import torch

    sizes = SIZES["cuda" if device == "cuda" else "cpu"]
    dtype = torch.bfloat16
    out: list[Probe] = []
    tokens, width, hidden, kv = sizes["gemm"]
    shapes = [(tokens, width, width), (tokens, kv, width), (tokens, hidden, width)]
    shapes += [(tokens, width, hidden)] + [(c, c, c) for c in sizes["cubes"]]
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        planned = None if planner is None else planner.gemm(m, n, k)
        shape = f"{m} x {n} x {k}"
        out.append(Probe("gemm", shape, lambda a=a, b=b: a @ b, 2.0 * m * n * k, 0.0, planned))
    seqs, heads, dim = sizes["attention"]
    for seq in seqs:
        out += _attention(device, heads, dim, [(seq, seq, True)], f"causal {seq:,}", planner)
    ring_tokens, degrees = sizes["ring"]
    for cp in degrees:
        shape = f"cp {cp}: {ring_tokens:,} of {cp * ring_tokens:,} tokens"
        out += _attention(device, heads, dim, ring_blocks(cp, ring_tokens), shape, planner, "ring")
        if cp > 1:
            out.append(_merges(device, heads, dim, cp, ring_tokens, shape, planner))
    nbytes = sizes["stream"]
    src = torch.empty(nbytes // 2, device=device, dtype=dtype).normal_()
    dst = torch.empty_like(src)
    planned = None if planner is None else planner.stream(2.0 * nbytes)
    shape = f"copy {nbytes / 2**20:,.0f} MiB"
    out.append(Probe("stream", shape, lambda: dst.copy_(src), 0.0, 2.0 * nbytes, planned))
    return out


def _attention(
    device: str,
    heads: int,
    dim: int,
    blocks: list[tuple[int, int, bool]],
    shape: str,
    planner: Planner | None,
    kind: str = "attention",
) -> list[Probe]:
    """Forward and backward probes of the attention calls ``blocks`` (one sequence,
    ``heads`` heads of ``dim``), flash on CUDA."""
    import torch
    import torch.nn.functional as F

    tensors = []
    for queries, keys, causal in blocks:
        q = torch.randn(1, heads, queries, dim, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, heads, keys, dim, device=device, dtype=torch.bfloat16) for _ in "kv")
        tensors.append((q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), causal))
    flops = sum(attention_flops(q, k, heads * dim, c) for q, k, c in blocks)

    def forward() -> list[torch.Tensor]:
        with _flash(device):
            return [F.scaled_dot_product_attention(q, k, v, is_causal=c) for q, k, v, c in tensors]

    saved: dict[str, list[torch.Tensor]] = {}

    def backward() -> object:
        if "outs" not in saved:  # one forward, its graph kept for every timed backward
            saved["outs"] = forward()
            saved["grads"] = [torch.randn_like(o) for o in saved["outs"]]
        with _flash(device):
            for (q, k, v, _), o, g in zip(tensors, saved["outs"], saved["grads"], strict=True):
                torch.autograd.grad(o, (q, k, v), g, retain_graph=True)
        return None

    def planned(bwd: bool) -> float | None:
        return None if planner is None else planner.attention(flops, bwd)

    return [
        Probe(f"{kind} fwd", shape, forward, flops, planned=planned(False)),
        Probe(f"{kind} bwd", shape, backward, 2.5 * flops, planned=planned(True)),
    ]


def _merges(
    device: str, heads: int, dim: int, cp: int, tokens: int, shape: str, planner: Planner | None
) -> Probe:
    """torch's own merge of one rank's ring blocks (``_SDPAMerger``, eager: fp32 outputs
    weighted by their log-sum-exp, a half-query block merged into its half), beside the
    bytes the planner charges it (:func:`plait.plan.stacks.cp_pass_bytes`, torch's eager
    forward, the key/value copies apart)."""
    import torch

    blocks = ring_blocks(cp, tokens)
    parts = [
        (
            torch.randn(1, heads, q, dim, device=device, dtype=torch.bfloat16),
            torch.randn(1, heads, q, device=device, dtype=torch.float32),
        )
        for q, _, _ in blocks
    ]

    def run() -> object:
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _SDPAMerger,
        )

        merger = _SDPAMerger(convert_to_f32=True, seq_dim=2)
        for (out, lse), (q, _, _) in zip(parts, blocks, strict=True):
            merger.step(out, lse, partial=q < tokens)
        return merger.results()

    from plait.plan.stacks import STACKS, cp_pass_bytes

    per_output, _ = cp_pass_bytes(STACKS["torchtitan"], "allgather", cp, 0.0, compiled=False)
    nbytes = float(tokens * heads * dim) * per_output
    planned = None if planner is None else planner.stream(nbytes)
    return Probe("ring merges", shape, run, 0.0, nbytes, planned)


def _flash(device: str) -> Any:
    """SDPA held to the flash kernel on CUDA (the planner's FlashAttention-2 figures)."""
    import contextlib

    if device != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def seconds(run: Callable[[], object], device: str, repeats: int = REPEATS) -> float:
    """Median seconds of ``repeats`` calls of ``run`` after one warm-up call."""
    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    run()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(device: str, row: Callable[..., dict[str, Any]], notes: list[str]) -> None:
    """Time every probe on ``device``; ``row(**values)`` records one (gpu_check's
    :meth:`PartResult.row`)."""
    import torch

    preset = planner_device(torch.cuda.get_device_name()) if device == "cuda" else None
    planner = Planner(preset) if preset else None
    if planner is not None:
        notes.append(
            f"planner: preset {preset} ({planner.peak / 1e12:,.0f} TFLOP/s bf16, "
            f"{planner.prof.bandwidth / 1e12:.2f} TB/s), flash fractions "
            f"{planner.fractions[0]:.2f} / {planner.fractions[1]:.2f}, sustained fraction "
            f"{planner.sustained:.3f}; measured over planned > 1: slower than planned"
        )
    elif device == "cuda":
        notes.append(f"no plait plan preset for {torch.cuda.get_device_name()}")
    if device == "cuda":
        notes.append(f"clocks and power (nvidia-smi): {_power_and_clocks()}")
    for probe in probes(device, planner):
        values: dict[str, Any] = {"group": "kernels", "kind": probe.kind, "shape": probe.shape}
        try:
            took = seconds(probe.run, device)
        except Exception as err:  # one kernel failing (memory, backend) leaves the others
            traceback.print_exc()
            row(**values, error=f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
            continue
        rate, unit = (probe.flops, "FLOP/s") if probe.flops else (probe.nbytes, "B/s")
        rate /= took
        scale, prefix = (1e12, "T") if rate >= 1e12 else (1e9, "G")
        ratio = None if probe.planned is None else took / probe.planned
        row(
            **values,
            ms=took * 1e3,
            rate=f"{rate / scale:,.1f} {prefix}{unit}",
            planned=probe.planned,
            ratio=ratio,
        )


def _power_and_clocks() -> str:
    """The GPU's power limit and clocks as nvidia-smi reports them (a power cap below the
    board's TDP lowers the sustained clock, which the planner's presets do not know), or
    why not."""
    import subprocess

    fields = "power.limit,power.max_limit,clocks.sm,clocks.max.sm"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"not read ({type(err).__name__})"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or len(lines) < 2:
        return f"not read (exit code {done.returncode})"
    return "; ".join(
        f"{k.strip()} {v.strip()}"
        for k, v in zip(lines[0].split(","), lines[1].split(","), strict=False)
    )


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The kernels table of the report."""

    def cell(value: float | None, fmt: str) -> str:
        return "—" if value is None else format(value, fmt)

    lines = [
        "| kernel | shape | measured ms | achieved | planned ms | measured / planned |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['kind']} | {r['shape']} | FAILED: {r['error']} | | | |")
            continue
        planned = r.get("planned")
        lines.append(
            f"| {r['kind']} | {r['shape']} | {cell(r.get('ms'), ',.2f')} | {r.get('rate', '—')} | "
            f"{cell(None if planned is None else planned * 1e3, ',.2f')} | "
            f"{cell(r.get('ratio'), '.2f')} |"
        )
    return lines


def main() -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    measure(device, lambda **v: rows.append(v) or v, notes)
    print("\n".join(markdown(rows) + [""] + notes))


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src"))
    main()
