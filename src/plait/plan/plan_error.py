"""The planner's refusal: input it cannot plan for (sizes that do not divide the devices,
a ``--tp`` the model does not divide, a model that fits in no layout, ...)."""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """Input the planner cannot plan for; the message says what to change."""
