"""The cost model's one fitted constant, recomputed from the one published run it is
fitted to (:data:`plait.plan.timing.EFFICIENCY`).

The run: torchtitan's Llama 3.1 8B on 8 H100s (one node), FSDP 8, selective activation
checkpointing, bf16 with fp32 reductions, local batch 2 of 8,192 tokens, without
``torch.compile`` or Float8: 5,762 tokens/s per GPU (``shared/reference/published_runs.md``,
table 1, from pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``).
:func:`calibrate` finds the efficiency at which the planner predicts exactly that. Every
other published row is a prediction, not a fit.

torchtitan's selective checkpointing keeps attention's output where plait's recomputes
it, so the fitted efficiency absorbs that difference too (about 7% more FLOPs in plait's
accounting of this run).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.devices import device
from plait.plan.models import preset
from plait.plan.search import evaluate
from plait.plan.spec import Layout, Workload

__all__ = ["CALIBRATION_RUN", "PublishedRun", "calibrate"]


@dataclass(frozen=True)
class PublishedRun:
    """A measured run: model preset, device preset, layout, work, and its throughput."""

    model: str
    device: str
    layout: Layout
    work: Workload
    tokens_per_s_per_device: float


CALIBRATION_RUN = PublishedRun(
    model="llama3-8b",
    device="h100",
    layout=Layout(dp_shard=8, ac="selective"),
    work=Workload(seq_len=8192, global_batch=16, precision="bf16"),
    tokens_per_s_per_device=5762.0,
)


def calibrate(run: PublishedRun = CALIBRATION_RUN) -> float:
    """The efficiency at which ``run``'s prediction matches its measurement (bisection;
    predicted throughput grows with efficiency)."""
    model, dev = preset(run.model), device(run.device)
    low, high = 0.01, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        got = evaluate(model, run.layout, run.work, dev, efficiency=mid)
        if got.timing.tokens_per_s_per_device < run.tokens_per_s_per_device:
            low = mid
        else:
            high = mid
    return (low + high) / 2
