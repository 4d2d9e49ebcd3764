"""The cost model's one fitted constant, the sustained fraction
(:data:`plait.plan.compute_time.EFFICIENCY`), recomputed from the published runs it is fitted
to.

The roofline (:mod:`plait.plan.roofline`) prices every kernel from cited figures (the
devices' peaks and bandwidths, cuBLAS's maximum achievable matmul rate, flash
attention's); none of those is fitted but llm-foundry's Triton attention's rate, which no
figure gives (:data:`plait.plan.stacks.TRITON_SLOWDOWN`, fitted on llm-foundry's own tables
by ``benchmarks/foundry_attention.py`` with this module's scales refitted at each trial).
What they leave out (clocks under the power cap, launch gaps, collectives sharing the SMs,
operations the roofline does not list) is one factor dividing every kernel time, fitted
here on the four runs that ``benchmarks/published_runs.py`` marks ``"calibration"`` (one
per code base and device generation), copied below with their sources so that the planner
does not import the benchmarks (``tests/test_plan_cost.py`` checks both agree):

* torchtitan Llama 3.1 8B, 8 x H100 (Grand Teton's 96 GB HBM2e at 500 W: the
  ``h100-hbm2e`` preset), FSDP 8, selective checkpointing, local batch 2 x 8,192: 5,762
  tokens/s per GPU (pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``,
  table 1);
* Megatron-LM 145B GPT, 1,536 A100s, TP 8 x PP 8 x DP 24, global batch 2,304 x 2,048,
  full recomputation: 148 TFLOP/s per GPU in Narayanan et al.'s count (arXiv 2104.04473,
  table 1), 123.8 tokens/s per GPU;
* Megatron-Core 32B GPT, 384 H100s, TP 8 x DP 48, global batch 192 x 4,096, TP
  communication overlapped: 459.6 TFLOP/s per GPU in Megatron-Core's count (NVIDIA/Megatron-LM
  README, ``images/model_table.png``, r0.8.0), 2,296.6 tokens/s per GPU;
* llm-foundry MPT-13B, 8 x A100 80 GB, FSDP 8, micro-batch 2 x 3 accumulations x 2,048:
  2,262 tokens/s per GPU (mosaicml/llm-foundry ``scripts/train/benchmarking/README.md``).

and, for the H100 generation (:data:`DEVICE_RUNS`), the same code base's MPT-7B on 8 x H100,
FSDP 8, micro-batch 6 x 2,048: 10,643 tokens/s per GPU (the same README, table "H100 80GB
BF16"): the one code base published on both generations in one table, one node each.

:func:`calibrate` finds the shared sustained fraction at which the geometric mean of
predicted / published throughput over the four stack runs is 1 (each at its stack's and
generation's scale 1); :func:`calibrate_stacks` then each software stack's scale of it
(:data:`plait.plan.compute_time.STACK_SCALE`), from that stack's one run at its generation's
scale; :func:`calibrate_devices` each later generation's scale
(:data:`plait.plan.compute_time.DEVICE_SCALE`) from its run of a stack fitted on the A100.
:func:`calibrate_host` fits a stack's host seconds per block
(:data:`plait.plan.compute_time.STACK_HOST`) on its one run (:data:`HOST_RUNS`):
Megatron-DeepSpeed's, BLOOM-176B's production run, 384 A100s, TP 4 x PP 12 x DP 8, ZeRO-1,
micro-batch 2 x 2,048, global batch 2,048, full checkpointing: 19.561 samples/s
(bigscience-workshop/bigscience ``train/tr11-176B-ml/README.md``, the log line of iteration
85,376), its scale being Megatron-LM 2021's (the same kernels). Each run carries its
software as the benchmarks state it. Every other published row is a prediction.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from plait.layout import LAYOUT_FIELDS
from plait.plan import compute_time
from plait.plan.compute_time import GENERATIONS, device_scale, stack_scale
from plait.plan.devices import device, family, node_network, override
from plait.plan.models import gpt, preset
from plait.plan.schedule import layout_shape
from plait.plan.spec import Layout, ModelSpec, PlanLayout, Software, Workload
from plait.plan.timing import EFFICIENCY, predict_time

__all__ = [
    "CALIBRATION_RUN",
    "CALIBRATION_RUNS",
    "DEVICE_RUNS",
    "HOST_RUNS",
    "PublishedRun",
    "calibrate",
    "calibrate_devices",
    "calibrate_host",
    "calibrate_stacks",
    "predicted",
]

_GIB = 2.0**30


@dataclass(frozen=True)
class PublishedRun:
    """A measured run: model, device preset (and its memory, and the inter-node network per
    node its source states, in Gb/s: 0 for the preset's), layout, work, how its tensor
    parallelism communicated, and its throughput."""

    name: str
    model: ModelSpec
    device: str
    layout: Layout
    work: Workload
    tokens_per_s_per_device: float
    memory_gib: float = 80.0
    software: Software = field(default_factory=Software)
    zero: int = 0  # ZeRO stage (a PlanLayout), as benchmarks/plan_published.py runs it
    recipe: str = "plait"
    node_network_gbps: float = 0.0


CALIBRATION_RUN = PublishedRun(
    name="torchtitan T1 8B FSDP 8",
    model=preset("llama3-8b"),
    device="h100-hbm2e",
    layout=Layout(dp_shard=8, ac="selective"),
    work=Workload(seq_len=8192, global_batch=16, precision="bf16"),
    tokens_per_s_per_device=5762.0,
    memory_gib=96.0,
    software=Software("torchtitan"),
    node_network_gbps=8 * 400,  # 400 Gb/s RDMA per GPU (the source)
)

CALIBRATION_RUNS: tuple[PublishedRun, ...] = (
    CALIBRATION_RUN,
    PublishedRun(
        name="Megatron-LM A100 145B",
        model=gpt(80, 96, 12288, 2048, vocab=51200, tied=True),
        device="a100",
        layout=Layout(
            dp_replicate=24, tp=8, pp=8, microbatches=96, ac="full", sequence_parallel=False
        ),
        work=Workload(2048, 2304),
        tokens_per_s_per_device=148e12
        / (96.0 * 80 * 12288**2 * (1 + 2048 / 73728 + 51200 / 15728640)),
        software=Software("megatron-2021"),
        recipe="megatron",
    ),
    PublishedRun(
        name="Megatron-Core H100 32B",
        model=gpt(48, 56, 7168, 4096, vocab=131072, tied=False),
        device="h100",
        layout=Layout(dp_replicate=48, tp=8, microbatches=4, ac="none"),
        work=Workload(4096, 192),
        tokens_per_s_per_device=2296.63772122481,
        software=Software(
            "megatron-core", "async", param_gather_overlap=True, grad_reduce_fp32=False
        ),
        zero=1,
        recipe="megatron",
    ),
    PublishedRun(
        name="llm-foundry A100 80GB MPT-13B",
        model=gpt(40, 40, 5120, 2048, vocab=50368, tied=True),
        device="a100",
        layout=Layout(dp_shard=8, microbatches=3, ac="none"),
        work=Workload(2048, 48),
        tokens_per_s_per_device=2262.0,
        software=Software("llm-foundry"),
        node_network_gbps=1600,  # the table's "1600 Gbps node-node interconnect"
    ),
)
"""The runs ``benchmarks/published_runs.py`` marks ``"calibration"`` that fit the stacks, one
per stack (module docstring)."""

DEVICE_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        name="llm-foundry H100 80GB MPT-7B",
        model=gpt(32, 32, 4096, 2048, vocab=50368, tied=True),
        device="h100",
        layout=Layout(dp_shard=8, ac="none"),
        work=Workload(2048, 48),
        tokens_per_s_per_device=10643.0,
        software=Software("llm-foundry"),
    ),
)
"""The calibration runs that fit a later generation's scale (module docstring)."""

HOST_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        name="BigScience A100 BLOOM-176B production, TP 4 PP 12 DP 8, MBS 2, GBS 2,048",
        model=dataclasses.replace(
            gpt(70, 112, 14336, 2048, vocab=250880, tied=True),
            name="bloom-like-70x14336",
            positions=0,
        ),
        device="a100",
        layout=Layout(
            dp_replicate=8, tp=4, pp=12, microbatches=128, ac="full", sequence_parallel=False
        ),
        work=Workload(2048, 2048),
        tokens_per_s_per_device=19.561 * 2048 / 384,
        software=Software("megatron-deepspeed", grad_reduce_fp32=True),
        zero=1,
        recipe="megatron",
        node_network_gbps=400,  # Jean Zay: 4 x 100 Gb/s Omni-Path per node
    ),
)
"""The calibration runs that fit a stack's host seconds per block (module docstring)."""


def predicted(
    run: PublishedRun,
    efficiency: float,
    scale: float | None = None,
    generation: float | None = None,
) -> float:
    """Predicted tokens/s per device of ``run`` at sustained fraction ``efficiency`` (its
    stack's ``scale`` and its device generation's scale on top: by default the calibrated
    ones, 1 while fitting them)."""
    dev = override(device(run.device), memory=run.memory_gib * _GIB)
    dev = node_network(dev, run.node_network_gbps)  # the network its source states
    layout = run.layout
    if run.zero or run.recipe != "plait":
        fields = {name: getattr(layout, name) for name in LAYOUT_FIELDS}
        layout = PlanLayout(**fields, zero=run.zero, recipe=run.recipe)
    shape = layout_shape(run.model, layout)
    if scale is not None:
        efficiency *= scale / stack_scale(run.software.kernels)
    if generation is not None:
        efficiency *= generation / device_scale(dev)
    got = predict_time(run.model, layout, run.work, dev, shape, efficiency, software=run.software)
    return got.tokens_per_s_per_device


def calibrate(runs: tuple[PublishedRun, ...] = CALIBRATION_RUNS) -> float:
    """The sustained fraction at which the predictions of ``runs`` (each stack at scale 1)
    match their measurements in geometric mean (bisection: throughput grows with it)."""
    low, high = 0.05, 3.0
    for _ in range(50):
        mid = (low + high) / 2
        error = sum(math.log(predicted(r, mid, 1.0, 1.0) / r.tokens_per_s_per_device) for r in runs)
        if error < 0:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def calibrate_stacks(
    runs: tuple[PublishedRun, ...] = CALIBRATION_RUNS, efficiency: float = EFFICIENCY
) -> dict[str, float]:
    """Each stack's scale of the sustained fraction (:data:`STACK_SCALE`): the factor at
    which its one calibration run's prediction matches, at the shared ``efficiency`` and
    its device generation's scale (bisection per stack)."""
    out = {}
    for run in runs:
        low, high = 0.1, 5.0
        for _ in range(50):
            mid = (low + high) / 2
            if predicted(run, efficiency, mid) < run.tokens_per_s_per_device:
                low = mid
            else:
                high = mid
        out[run.software.kernels] = round((low + high) / 2, 4)
    return out


def calibrate_host(
    runs: tuple[PublishedRun, ...] = HOST_RUNS, efficiency: float = EFFICIENCY
) -> dict[str, float]:
    """Each such stack's host seconds per block forward
    (:data:`plait.plan.compute_time.STACK_HOST`): the value at which its one run's
    prediction matches, at the fitted scales (bisection per stack; the table is read when
    called, so each trial sets its entry, restored after)."""
    out = {}
    for run in runs:
        name = run.software.kernels
        kept = compute_time.STACK_HOST.get(name)
        low, high = 0.0, 0.1
        try:
            for _ in range(50):
                compute_time.STACK_HOST[name] = mid = (low + high) / 2
                if predicted(run, efficiency) > run.tokens_per_s_per_device:
                    low = mid
                else:
                    high = mid
        finally:
            if kept is None:
                del compute_time.STACK_HOST[name]
            else:
                compute_time.STACK_HOST[name] = kept
        out[name] = round((low + high) / 2, 5)
    return out


def calibrate_devices(
    runs: tuple[PublishedRun, ...] = DEVICE_RUNS, efficiency: float = EFFICIENCY
) -> dict[str, float]:
    """Each later generation's scale of the sustained fraction
    (:data:`plait.plan.compute_time.DEVICE_SCALE`): the factor at which its run's prediction
    matches, at the shared ``efficiency`` and the run's stack scale (bisection)."""
    out = {}
    for run in runs:
        low, high = 0.1, 5.0
        for _ in range(50):
            mid = (low + high) / 2
            if predicted(run, efficiency, generation=mid) < run.tokens_per_s_per_device:
                low = mid
            else:
                high = mid
        out[GENERATIONS[family(run.device)]] = round((low + high) / 2, 4)
    return out
