"""A candidate layout, priced: its peak rank's memory (:mod:`plait.plan.memory`), its
predicted time (:mod:`plait.plan.timing`) and whether it fits the device; the pricing
the search (:mod:`plait.plan.search`) does of each layout it enumerates, and the
one-line summary every report of a layout prints (:func:`describe`).

A layout is timed only when its memory fits: memory is the cheaper prediction, and most
of a large search does not fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from plait.layout import CP, Layout, ModelShape, World, check
from plait.pipeline.schedules import SCHEDULES
from plait.plan.memory import peak_memory
from plait.plan.schedule import layout_shape
from plait.plan.shards import fsdp_ranks
from plait.plan.spec import (
    DeviceSpec,
    MemoryBreakdown,
    ModelSpec,
    Software,
    Workload,
    zero_stage,
)
from plait.plan.spec import recipe as recipe_of
from plait.plan.timing import EFFICIENCY, Timing, predict_time

__all__ = ["Candidate", "Pricing", "describe", "evaluate", "fastest", "with_runtime"]


@dataclass(frozen=True)
class Candidate:
    """One evaluated layout: its peak rank's memory, predicted time, and whether it fits."""

    layout: Layout
    memory: MemoryBreakdown
    timing: Timing
    fits: bool


@dataclass(frozen=True)
class Pricing:
    """What pricing a layout needs besides the layout: the model, its work, the device,
    the memory budget and the cost model's settings (one for
    :func:`~plait.plan.search.plan`'s grid and its retries alike, so they price the same
    way)."""

    model: ModelSpec
    work: Workload
    device: DeviceSpec
    budget: float
    efficiency: float
    software: Software | None

    def price(self, layout: Layout) -> tuple[float, Candidate | None] | None:
        """``layout``'s peak memory per rank and, when it fits the budget, its candidate
        (timed only then); None for a pipeline shape plait's schedules refuse."""
        try:
            pipeline = layout_shape(self.model, layout)
        except ValueError:
            return None
        memory = peak_memory(self.model, layout, self.work, pipeline, software=self.software)
        memory = with_runtime(memory, self.device)
        if memory.total > self.budget:
            return memory.total, None
        timing = predict_time(
            self.model,
            layout,
            self.work,
            self.device,
            pipeline,
            self.efficiency,
            software=self.software,
        )
        return memory.total, Candidate(layout, memory, timing, True)

    def fitting(
        self, layouts: Iterator[Layout], shape: ModelShape, world: World
    ) -> list[Candidate]:
        """The candidates of ``layouts`` that the rules allow and that fit."""
        found = []
        for layout in layouts:
            if check(layout, shape, self.work.global_batch, world, SCHEDULES):
                continue
            priced = self.price(layout)
            if priced is not None and priced[1] is not None:
                found.append(priced[1])
        return found


def evaluate(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec,
    *,
    memory_fraction: float = 0.9,
    efficiency: float = EFFICIENCY,
    software: Software | None = None,
) -> Candidate:
    """Memory and time of one layout (no search). ValueError for a shape plait refuses.
    ``software``: the framework's kernels and overlaps (:class:`Software`; plait's)."""
    shape = layout_shape(model, layout)
    memory = with_runtime(peak_memory(model, layout, work, shape, software=software), device)
    timing = predict_time(model, layout, work, device, shape, efficiency, software=software)
    return Candidate(layout, memory, timing, memory.total <= memory_fraction * device.memory)


def with_runtime(memory: MemoryBreakdown, device: DeviceSpec) -> MemoryBreakdown:
    """``memory`` with the process's own bytes beyond its tensors
    (``device.runtime_memory``, fitted by ``--calibrate``) as the ``runtime`` part."""
    if not device.runtime_memory:
        return memory
    return dataclasses.replace(memory, extra={**memory.extra, "runtime": device.runtime_memory})


def fastest(c: Candidate) -> tuple[float, float]:
    """Sort key: fastest first, then least memory."""
    return (-c.timing.tokens_per_s_per_device, c.memory.total)


def describe(layout: Layout) -> str:
    """A one-line summary of ``layout``, e.g. ``dp_shard=128 tp=8 ac=selective``."""
    parts = [f"{name}={size}" for name, size in layout.sizes.items() if size > 1]
    if layout.cp > 1:  # cp=4 -> cp=4/ring
        parts[parts.index(f"{CP}={layout.cp}")] += f"/{layout.cp_method}"
    if layout.ep > 1:
        parts.append(f"ep={layout.ep}")
    if layout.pp > 1:
        parts.append(f"{layout.schedule}x{layout.stages_per_rank}")
        if layout.end_blocks:
            parts.append(f"ends={layout.end_blocks}")
        if layout.max_active_stages:
            parts.append(f"active={layout.max_active_stages}")
    if layout.microbatches > 1:
        parts.append(f"mb={layout.microbatches}")
    parts.append(f"ac={layout.ac}")
    if fsdp_ranks(layout) > 1 and not layout.reshard_after_forward:
        parts.append("no-reshard")
    if zero_stage(layout):
        parts.append(f"zero={zero_stage(layout)}")
    if recipe_of(layout) != "plait":
        parts.append(f"recipe={recipe_of(layout)}")
    return " ".join(parts) or "single device"
