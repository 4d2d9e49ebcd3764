"""The layout fields the caller fixed (``plait plan``'s layout flags, :func:`plait.plan.plan`'s
keywords), and the refusal of fixed fields no layout can have, before any search: sizes
that do not divide the devices, a ``tp`` the model does not divide, an ``ep`` the experts
or the devices do not allow, a schedule or pipeline the blocks do not take. Each refusal
is a :class:`~plait.plan.plan_error.PlanError` whose message names the flag to change.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from plait.layout import (
    CP,
    DP_SHARD,
    EP,
    LAYOUT_FIELDS,
    PP,
    TP,
    Layout,
    ModelShape,
    Reason,
    World,
    check_cp,
    check_ep,
    check_microbatches,
    check_schedule,
    check_sizes,
    check_stages,
    check_stages_per_rank,
    check_world,
    cp_shard,
    default_stages_per_rank,
    find_schedule,
    tp_splits,
)
from plait.pipeline.schedules import SCHEDULES
from plait.plan.plan_error import PlanError
from plait.plan.spec import ModelSpec

__all__ = ["AC_SEARCHED", "Pinned", "check_pinned", "pin"]

#: The checkpointing modes the planner models, and so searches (a fixed ``ac`` must be one).
AC_SEARCHED = ("none", "selective", "full")


@dataclass(frozen=True)
class Pinned:
    """The layout fields the caller fixed: their values in ``layout`` (the others keep
    :class:`Layout`'s defaults), their names in ``names``."""

    layout: Layout
    names: frozenset[str]

    def given(self, name: str) -> bool:
        return name in self.names

    @property
    def sizes(self) -> dict[str, int | None]:
        """The fixed mesh sizes, None for those to search."""
        return {d: size if self.given(d) else None for d, size in self.layout.sizes.items()}


def pin(fixed: Mapping[str, int | str | bool | None]) -> Pinned:
    """The fields of ``fixed`` given (not None); TypeError for names no layout has."""
    unknown = sorted(set(fixed) - set(LAYOUT_FIELDS))
    if unknown:
        raise TypeError(
            f"plan() got unexpected keyword argument(s) {', '.join(unknown)}: the layout "
            f"fields are {', '.join(LAYOUT_FIELDS)}"
        )
    given: dict[str, Any] = {name: value for name, value in fixed.items() if value is not None}
    return Pinned(Layout(**given), frozenset(given))


def check_pinned(model: ModelSpec, shape: ModelShape, world: World, pinned: Pinned) -> None:
    """PlanError for fixed fields no layout can have."""
    counts = {
        name: getattr(pinned.layout, name) for name in ("stages_per_rank", "microbatches", EP)
    }
    sizes = {**pinned.sizes, **{k: v for k, v in counts.items() if pinned.given(k)}}
    _refuse(check_sizes({"gpus": world.size, **sizes}) or check_world(pinned.sizes, world))
    if pinned.given(CP):
        # The method's own rule only when it is fixed (else another method may do), with
        # the tp it splits the heads with when that is fixed too.
        method = pinned.layout.cp_method if pinned.given("cp_method") else "ring"
        tp = pinned.layout.tp if pinned.given(TP) else 1
        _refuse(check_cp(shape, pinned.layout.cp, method, tp))
    if pinned.given(TP):
        tp = pinned.layout.tp
        local = cp_shard(shape, pinned.layout.cp)  # tp splits a cp rank's share
        for split in tp_splits(local, pinned.layout.sequence_parallel and tp > 1):
            if split.size % tp:
                raise PlanError(
                    f"--tp {tp} does not divide {split.what} of {model.name}: use a --tp "
                    f"that divides {split.size}"
                )
    if pinned.given("ac") and pinned.layout.ac not in AC_SEARCHED:
        raise PlanError(f"--ac {pinned.layout.ac}: the planner models {', '.join(AC_SEARCHED)}")
    if pinned.given("schedule"):
        _refuse(check_schedule(SCHEDULES, pinned.layout.schedule))
    if pinned.given(PP) or pinned.layout.end_blocks < 0:
        _refuse(_pipeline_reasons(shape, pinned))
    if pinned.layout.max_active_stages < 0:
        raise PlanError(
            f"--max-active-stages {pinned.layout.max_active_stages}: the most stages a "
            "pipeline rank holds gathered at once; give 1 or more, or 0 for no bound"
        )
    if pinned.given(EP):
        _refuse(_ep_reasons(shape, world, pinned))


def _ep_reasons(shape: ModelShape, world: World, pinned: Pinned) -> list[Reason]:
    """What rules out a fixed ``ep``: the experts it must split, and the ``dp_shard`` it
    takes its ranks from (fixed, or at most what the devices leave)."""
    ep = pinned.layout.ep
    if pinned.given(DP_SHARD):
        return check_ep(shape, ep, pinned.layout.dp_shard * pinned.layout.cp)
    others = math.prod(size or 1 for d, size in pinned.sizes.items() if d != DP_SHARD)
    room = world.size // others if world.size % others == 0 else world.size
    reasons = check_ep(shape, ep, room)
    if shape.experts and shape.experts % ep == 0 and room % ep:
        # Not check_ep's message: dp_shard is searched, there is no --dp-shard to change.
        message = (
            f"--ep {ep} takes its ranks from dp_shard, but the {world.size} devices leave "
            f"dp_shard {room} (or a divisor of it), not a multiple of {ep}: use an --ep "
            f"that divides {room}"
        )
        reasons = [Reason(EP, message)]
    return reasons


def _pipeline_reasons(shape: ModelShape, pinned: Pinned) -> list[Reason]:
    """What rules out a fixed pipeline size with the other fixed fields: the blocks, and
    with a fixed schedule (else the others are searched) its stages and microbatches."""
    spec = find_schedule(SCHEDULES, pinned.layout.schedule)
    assert spec is not None  # known: checked, or the default
    if pinned.given("stages_per_rank"):
        v = pinned.layout.stages_per_rank
    elif pinned.given("schedule"):
        v = default_stages_per_rank(spec, pinned.layout.pp)
    else:
        v = 1  # the fewest stages a pipeline of this many ranks has
    staged = dataclasses.replace(pinned.layout, stages_per_rank=v)
    reasons = check_stages(shape, staged)
    if pinned.given("schedule") or staged.pp == 1:
        reasons += check_stages_per_rank(staged, spec, SCHEDULES)
        if pinned.given("microbatches"):
            reasons += check_microbatches(staged, spec)
    return reasons


def _refuse(reasons: list[Reason]) -> None:
    if reasons:
        raise PlanError(reasons[0].message)
