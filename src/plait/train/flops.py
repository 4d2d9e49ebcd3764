"""Model FLOPs utilisation (MFU): the model's FLOPs per token, and the devices' peak.

**FLOPs per token** (:func:`flops_per_token`) follow PaLM's appendix B (Chowdhery et al.,
2022), the convention most MFU figures use::

    flops_per_token = 6 * N + 12 * L * H * Q * T

* ``N``: the parameters one token's forward multiplies with: every parameter of the built
  model except embedding tables (``nn.Embedding``: a lookup, no multiply), counting an
  output head tied to the embedding (it is a matmul); of a mixture-of-experts layer's
  routed experts only the ``top_k`` of ``E`` a token goes to (``top_k / E`` of their
  stacked weights), its router and shared experts in full. Norm gains and biases count
  too (PaLM counts every parameter; they are a rounding error). 6 = 2 FLOPs per
  multiply-add x (1 forward + 2 backward).
* ``12 * L * H * Q * T``: attention's two matmuls (``Q K^T`` and ``A V``) per layer, per
  token, against all ``T = seq_len`` positions: 2 matmuls x 2 FLOPs x 3 (forward and
  backward) = 12, times the query width ``H * Q`` (heads x head width: the query
  projection's output features, read per block, so grouped-query attention and explicit
  head widths count right). As in PaLM the causal mask is not halved out, and
  activation-checkpointing recompute is not counted (*model* FLOPs, not hardware FLOPs).

Counted from the model's own modules (:class:`~plait.experts.MoE`-style layers found by
their ``router.top_k`` and ``experts.num_experts``), so any model family built of the same
pieces counts without a table of its own.

**Peak** (:func:`device_peak`): the dense (no structured sparsity) peak of one process's
device in the run's precision, summed over the processes (:func:`total_peak`):

* CUDA: :data:`CUDA_PEAKS`, NVIDIA's datasheet figures by device name. ``--mp bf16`` uses
  the bf16 tensor-core peak; ``--mp fp32`` uses the TF32 tensor-core peak when torch lets
  float32 matmuls use TF32 (``torch.backends.cuda.matmul.allow_tf32``, or
  ``torch.set_float32_matmul_precision`` other than ``"highest"``), else the plain FP32
  (CUDA-core) peak: torch's default, and so what an fp32 run of ``plait train`` gets. A
  device not in the table is measured as on CPU (the summary says so: pass
  ``--peak-flops`` for its datasheet figure).
* CPU: measured once at startup: the best rate of a short square-matmul benchmark in the
  run's dtype with this process's threads. Every process measures at the same time, so
  processes sharing the machine's cores share them during the benchmark too, and the sum
  over processes is the machine's rate, not one process's times their number.
* ``--peak-flops``: one device's (process's) peak FLOP/s, replacing both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from plait import spmd
from plait.mesh import collective_device

__all__ = [
    "CUDA_PEAKS",
    "Peak",
    "cuda_peak",
    "device_peak",
    "flops_per_token",
    "matmul_rate",
    "measured_rate",
    "mfu",
    "total_peak",
]

#: Dense peak FLOP/s per GPU, by precision, from NVIDIA's datasheets (the sparse figures
#: halved). Matched against ``torch.cuda.get_device_name()`` in this order: the first
#: name contained in it wins (so "H100 PCIe" before "H100"; GH200 holds an H100/H200).
CUDA_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),
    ("H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100 NVL", {"bf16": 835e12, "tf32": 418e12, "fp32": 60e12}),
    ("H100", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),  # SXM (HBM3)
    ("A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
)

#: The benchmark: square matmuls of this size, for at least this long. A GPU needs large
#: ones to near its peak; 4096 keeps the three matrices within 200 MB (fp32), which is
#: all the benchmark adds to the run's peak memory.
_BENCH_SIZE = {"cpu": 512, "cuda": 4096}
_BENCH_SECONDS = 0.15
_BENCH_MIN_REPS = 3
#: The rates this process measured, by (device, dtype, threads): a process measures each
#: once, and later runs in it (a notebook's, a test worker's) reuse the figure rather than
#: spend another 0.15 s, or more with other processes sharing the cores.
_MEASURED: dict[tuple[str, torch.dtype, int], float] = {}


@dataclass(frozen=True)
class Peak:
    """The peak FLOP/s MFU divides by: ``flops`` over all processes, and where it came
    from (``source``, for the summary)."""

    flops: float
    source: str


def _routed_fraction(module: nn.Module) -> float | None:
    """For a mixture-of-experts layer (a module with ``router.top_k`` and
    ``experts.num_experts``): the fraction of its routed experts one token uses."""
    router, experts = getattr(module, "router", None), getattr(module, "experts", None)
    top_k = getattr(router, "top_k", None)
    num = getattr(experts, "num_experts", None)
    if isinstance(top_k, int) and isinstance(num, int) and num > 0:
        return top_k / num
    return None


def _active_parameters(model: nn.Module) -> float:
    """``N`` of the module docstring: parameters a token multiplies with."""
    fractions: dict[int, float] = {}  # id(routed experts module) -> fraction used
    for module in model.modules():
        fraction = _routed_fraction(module)
        if fraction is not None:
            fractions[id(module.experts)] = fraction
    total = 0.0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue  # a table lookup (a tied head counts through the head's Linear)
        own = sum(p.numel() for p in module.parameters(recurse=False))
        total += own * fractions.get(id(module), 1.0)
    return total


def _attention_width(model: nn.Module) -> int:
    """``L * H * Q`` of the module docstring: the query width summed over the attention
    layers (modules with a ``head_dim`` and a linear ``q`` projection)."""
    width = 0
    for module in model.modules():
        q = getattr(module, "q", None)
        if isinstance(q, nn.Linear) and hasattr(module, "head_dim"):
            width += q.out_features
    return width


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs (forward and backward) per token of ``model`` on sequences of
    ``seq_len`` tokens: ``6 N + 12 L H Q T`` (see the module docstring). ``model`` is the
    whole model (any device, ``meta`` included: only shapes are read)."""
    return 6 * _active_parameters(model) + 12 * _attention_width(model) * seq_len


def mfu(tokens_per_s: float, per_token: float, peak: float) -> float:
    """Model FLOPs utilisation: model FLOP/s achieved over the peak (0..1)."""
    return tokens_per_s * per_token / peak if peak > 0 else 0.0


def _tf32_allowed() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32) or (
        torch.get_float32_matmul_precision() != "highest"
    )


def cuda_peak(name: str, precision: str) -> tuple[float, str] | None:
    """The table's peak of device ``name`` in ``precision`` (``"bf16"`` or ``"fp32"``,
    the latter meaning TF32 when torch allows it), and that figure's kind; None for a
    device the table does not know."""
    kind = precision if precision == "bf16" else ("tf32" if _tf32_allowed() else "fp32")
    for key, peaks in CUDA_PEAKS:
        if key in name:
            return peaks[kind], kind
    return None


def matmul_rate(device: str, dtype: torch.dtype) -> float:
    """The best FLOP/s of square ``dtype`` matmuls on ``device`` over a short run (about
    0.15 s), with this process's threads. Uses its own random generator: the run's random
    streams are untouched."""
    n = _BENCH_SIZE["cuda" if device == "cuda" else "cpu"]
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.rand(n, n, generator=generator, device=device).to(dtype) for _ in range(2))
    out = torch.mm(a, b)  # warm-up: kernels picked, caches filled
    if device == "cuda":
        torch.cuda.synchronize()
    best, reps = 0.0, 0
    began = time.perf_counter()
    while reps < _BENCH_MIN_REPS or time.perf_counter() - began < _BENCH_SECONDS:
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        if device == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 / max(time.perf_counter() - start, 1e-9))
        reps += 1
    return best


def measured_rate(device: str, dtype: torch.dtype) -> float:
    """:func:`matmul_rate`, measured once per process for each device, dtype and thread
    count (``_MEASURED``)."""
    where = f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device
    key = (where, dtype, torch.get_num_threads())
    if key not in _MEASURED:
        _MEASURED[key] = matmul_rate(device, dtype)
    return _MEASURED[key]


def device_peak(device: str, precision: str, override: float = 0.0) -> tuple[float, str]:
    """This process's peak FLOP/s and how it was found: ``override`` (``--peak-flops``)
    when positive, else the CUDA table, else a benchmark (see the module docstring)."""
    if override > 0:
        return override, "--peak-flops"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if device == "cuda":
        name = torch.cuda.get_device_name()
        found = cuda_peak(name, precision)
        if found is not None:
            return found[0], f"{name}, dense {found[1]}"
        rate = measured_rate(device, dtype)
        return rate, f"{name} is not in the table: measured {precision} matmuls"
    threads = torch.get_num_threads()
    source = f"measured {precision} matmuls, {threads} thread(s), processes sharing the cores"
    return measured_rate(device, dtype), source


def total_peak(device: str, precision: str, override: float = 0.0) -> Peak:
    """The peak of every process's device, summed (collective over the world when one is
    initialised: every rank calls it at the same point; on CPU they benchmark together, so
    processes on one machine share its cores while they measure). ``source`` says how rank
    0's was found."""
    mine, source = device_peak(device, precision, override)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return Peak(mine, source)
    world = dist.group.WORLD
    size = dist.get_world_size()
    local = torch.tensor([mine], dtype=torch.float64, device=collective_device(world))
    every = [torch.zeros_like(local) for _ in range(size)]
    spmd.record("all_gather", local, world, "the devices' peak FLOP/s")
    spmd.wait(dist.all_gather(every, local, group=world, async_op=True), "all_gather of peaks")
    return Peak(sum(float(t.item()) for t in every), f"sum of {size} processes, rank 0's: {source}")
