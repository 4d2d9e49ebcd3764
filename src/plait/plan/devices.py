"""Device presets: memory, dense peak FLOP/s and link bandwidths per device.

GPU figures are the vendors' published ones (dense, no sparsity; bandwidth per GPU and per
direction). Memory is the usable HBM in GiB as ``nvidia-smi`` reports it, not the marketing
figure. Inter-node bandwidth assumes one 400 Gb/s NIC per GPU (rail-optimised RDMA), the
common H100 / H200 / B200 build; A100 systems mostly have 200 Gb/s.

``cpu`` models one gloo worker process on a host CPU. Its figures are measure-free
defaults, not a benchmark: 100 GFLOP/s per process (about one AVX2 / AVX-512 core's fp32
FMA peak), 16 GiB per process, and 2 GB/s for gloo over loopback TCP, the same inside and
across "nodes". Override them (``--flops``, ``--memory``, ``--intra-bw``, ``--inter-bw``)
with figures measured on your machine.

HBM bandwidth (:data:`MEMORY_BANDWIDTH`, the roofline's memory-bound kernels,
:mod:`plait.plan.roofline`), datasheets: H100 SXM 3.35 TB/s, H200 4.8 TB/s, A100 80 GB
2.0 TB/s (the 40 GB part: 1.55), B200 8 TB/s. The ``cpu`` preset has none (no roofline).

``h100-hbm2e``: the H100 of Meta's Grand Teton hosts, on which torchtitan's published
benchmarks ran (``benchmarks/llama3_h100_202412_torchtitan.md``, and ``docs/performance.md``
of 2024): "96GB HBM2e with 2.4 TB/sec peak memory bandwidth", "the default 500W power
limit", and a peak "between SXM and NVL" that the source does not know exactly: the
midpoint of the SXM's 989 and the NVL's 835 TFLOP/s dense bf16 is taken, 912 (fp8 and
fp32 the same way: 1,825 and 62). Pricing those runs as a 700 W, 3.35 TB/s H100 SXM put
the hardware's shortfall into torchtitan's fitted software scale, which then
under-predicted torchtitan on every other device.

Dense fp8 peaks (``flops_fp8``: Float8 GEMMs, :func:`fp8_peak`), datasheets without
sparsity, on the same convention as the bf16 figures (the datasheets print the sparse
figure, twice the dense one): H100 / H200 SXM 1,979 TFLOP/s (NVIDIA H100 Tensor Core GPU
datasheet, "FP8 Tensor Core 3,958 teraFLOPS with sparsity"; H200 datasheet, the same),
B200 4,500 TFLOP/s (NVIDIA DGX B200 / HGX B200 datasheet, "FP8 9 PFLOPS with sparsity"
per GPU, beside its 2.25 PFLOP/s dense bf16). The A100 has no fp8 tensor cores and the
``cpu`` preset none: float8 is refused there.

Streaming multiprocessors (:data:`STREAMING_MULTIPROCESSORS`), datasheets: H100 / H200
SXM 132, A100 108, B200 148.

**Chip families** (:data:`FAMILY`, :func:`family`): presets built on the same chip share
its figures beyond memory and peaks: streaming multiprocessors here, and the cost model's
per-chip tables (the roofline's kernel fractions, flash attention's, fp8 GEMMs', the
sustained-fraction generation), which are keyed by family. The H200 and ``h100-hbm2e`` are
H100s (GH100); the 40 GB A100 an A100. A new preset of a known chip needs its
:data:`DEVICES` entry, its :data:`MEMORY_BANDWIDTH` and its family.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from plait.plan.spec import DeviceSpec

__all__ = [
    "DEVICES",
    "FAMILY",
    "MEMORY_BANDWIDTH",
    "STREAMING_MULTIPROCESSORS",
    "compute_peak",
    "device",
    "family",
    "fp8_peak",
    "memory_bandwidth",
    "node_network",
    "override",
    "streaming_multiprocessors",
]

_GIB = 2.0**30


DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("h100", 80 * _GIB, 989e12, 450e9, 50e9, 8, flops_fp32=67e12, flops_fp8=1979e12),
        DeviceSpec("h200", 140 * _GIB, 989e12, 450e9, 50e9, 8, flops_fp32=67e12, flops_fp8=1979e12),
        DeviceSpec(
            "h100-hbm2e", 95 * _GIB, 912e12, 450e9, 50e9, 8, flops_fp32=62e12, flops_fp8=1825e12
        ),
        DeviceSpec("a100", 80 * _GIB, 312e12, 300e9, 25e9, 8, flops_fp32=19.5e12),
        DeviceSpec("a100-40gb", 40 * _GIB, 312e12, 300e9, 25e9, 8, flops_fp32=19.5e12),
        DeviceSpec(
            "b200", 180 * _GIB, 2250e12, 900e9, 50e9, 8, flops_fp32=75e12, flops_fp8=4500e12
        ),
        DeviceSpec("cpu", 16 * _GIB, 100e9, 2e9, 2e9, 8, flops_fp32=100e9),
    )
}
MEMORY_BANDWIDTH: dict[str, float] = {
    "h100": 3.35e12,
    "h200": 4.8e12,
    "h100-hbm2e": 2.4e12,
    "a100": 2.0e12,
    "a100-40gb": 1.55e12,
    "b200": 8.0e12,
}
"""HBM bytes/s per device preset (datasheets; module docstring)."""

FAMILY: dict[str, str] = {
    "h100": "h100",
    "h200": "h100",
    "h100-hbm2e": "h100",
    "a100": "a100",
    "a100-40gb": "a100",
    "b200": "b200",
}
"""The chip family of each GPU preset (module docstring, "Chip families")."""

STREAMING_MULTIPROCESSORS: dict[str, int] = {"h100": 132, "a100": 108, "b200": 148}
"""Streaming multiprocessors per chip family (datasheets; module docstring): how many
thread blocks run at once, which decides how much of the GPU a collective's blocks take
from compute beside it (:data:`plait.plan.timing.COLLECTIVE_CTAS`)."""

_ALIASES = {"h100-sxm": "h100", "a100-80gb": "a100", "gloo": "cpu"}


def device(name: str) -> DeviceSpec:
    """The preset ``name`` (case-insensitive, aliases such as ``h100-sxm``)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in DEVICES:
        known = ", ".join([*DEVICES, *_ALIASES])
        raise ValueError(f"unknown device {name!r}; known: {known}")
    return DEVICES[key]


def override(spec: DeviceSpec, **values: Any) -> DeviceSpec:
    """``spec`` with the given fields replaced; ``None`` values are ignored. Every value
    must be positive (ValueError naming the field)."""
    changes = {k: v for k, v in values.items() if v is not None}
    for name, value in changes.items():
        if value <= 0:
            raise ValueError(f"device {name} must be positive, got {value}")
    return dataclasses.replace(spec, **changes)


def node_network(spec: DeviceSpec, gbps: float) -> DeviceSpec:
    """``spec`` on an inter-node network of ``gbps`` Gb/s per node, shared by the node's
    ``gpus_per_node`` devices (``inter_node_bw`` is per device); ``spec`` itself for 0."""
    if not gbps:
        return spec
    return override(spec, inter_node_bw=gbps * 1e9 / 8 / spec.gpus_per_node)


def compute_peak(spec: DeviceSpec, precision: str) -> float:
    """Dense peak FLOP/s for ``precision`` (``"bf16"`` or ``"fp32"``)."""
    if precision == "bf16":
        return spec.flops
    return spec.flops_fp32 or spec.flops / 2


def fp8_peak(spec: DeviceSpec) -> float:
    """Dense fp8 FLOP/s of ``spec`` for Float8 GEMMs (module docstring); ValueError naming
    the fix when the device has none (the A100, the ``cpu`` preset, a measured device)."""
    if spec.flops_fp8 <= 0:
        raise ValueError(
            f"float8 needs fp8 tensor cores: device {spec.name!r} has no fp8 peak (the "
            "h100, h200, h100-hbm2e and b200 presets have one); drop float8 (--float8 none, "
            "Software(float8='none')) or plan for one of those devices"
        )
    return spec.flops_fp8


def family(name: str) -> str:
    """The chip family of the preset ``name`` (:data:`FAMILY`; the name itself when it
    has none, e.g. ``cpu``)."""
    return FAMILY.get(name, name)


def streaming_multiprocessors(spec: DeviceSpec) -> int:
    """Streaming multiprocessors of ``spec``'s chip (0 when unknown: a measured device
    or the ``cpu`` preset, whose rates already include what collectives take)."""
    return 0 if spec.measured else STREAMING_MULTIPROCESSORS.get(family(spec.name), 0)


def memory_bandwidth(spec: DeviceSpec) -> float:
    """HBM bytes/s of ``spec``'s preset (0 when unknown: no roofline)."""
    return MEMORY_BANDWIDTH.get(spec.name, 0.0)
