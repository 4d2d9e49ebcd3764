"""Cut a layered model into pipeline stage modules that keep every parameter's name.

A stage is a copy of the whole model in which the layers of the other stages are gone: a
layer inside a container (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) becomes
``nn.Identity`` (so the container's forward passes activations through), any other layer
becomes ``None``. The model's own ``forward`` then runs as the stage's forward, provided
it skips ``None`` parts, as :class:`~plait.train.model.GPT` does; an ``nn.Sequential``
needs nothing. Because names are unchanged, each stage's ``state_dict`` is a slice of the
whole model's and loads back into it.

Only the kept layers are copied (removed ones are substituted during ``deepcopy``), so
building a stage costs the stage's memory, not the model's.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

from torch import nn

__all__ = ["split_model", "stage_layers"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def stage_layers(model: nn.Module, n_stages: int, *, layers: str | None = None) -> list[list[str]]:
    """An even plan: the children of the container ``layers`` (default: of ``model``
    itself, e.g. an ``nn.Sequential``) in ``n_stages`` contiguous runs, earlier stages
    taking one more when they do not divide; the model's other children go to the first
    stage if registered before the container, else to the last.

    ``stage_layers(gpt, 2, layers="blocks")`` gives
    ``[["tok_emb", "pos_emb", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "head"]]``.
    """
    container = model if layers is None else model.get_submodule(layers)
    prefix = "" if layers is None else f"{layers}."
    names = [prefix + name for name, _ in container.named_children()]
    if not 1 <= n_stages <= len(names):
        raise ValueError(
            f"cannot split the {len(names)} layers of {layers or type(model).__name__!r} into "
            f"{n_stages} stages: every stage needs at least one layer"
        )
    size, extra = divmod(len(names), n_stages)
    plan, start = [], 0
    for s in range(n_stages):
        end = start + size + (1 if s < extra else 0)
        plan.append(names[start:end])
        start = end
    if layers is not None:
        children = [name for name, _ in model.named_children()]
        at = children.index(layers.split(".")[0])
        plan[0] = children[:at] + plan[0]
        plan[-1] = plan[-1] + children[at + 1 :]
    return plan


def split_model(
    model: nn.Module,
    plan: int | Sequence[Sequence[str]],
    *,
    layers: str | None = None,
    stages: Iterable[int] | None = None,
) -> list[nn.Module]:
    """Stage modules of ``model`` for the stage indices ``stages`` (default: all).

    ``plan`` lists, per stage, the names of the submodules (layers) it keeps, or is a
    number of stages for :func:`stage_layers` (with ``layers``). Every layer named in the
    plan belongs to exactly one stage; submodules the plan does not name are kept by every
    stage. ``model`` itself is not modified. Raises ValueError for unknown, repeated or
    nested layer names.
    """
    if isinstance(plan, int):
        plan = stage_layers(model, plan, layers=layers)
    owner = _owners(model, plan)
    wanted = range(len(plan)) if stages is None else list(stages)
    return [_stage_copy(model, owner, s) for s in wanted]


def _owners(model: nn.Module, plan: Sequence[Sequence[str]]) -> dict[str, int]:
    owner: dict[str, int] = {}
    modules = dict(model.named_modules())
    for s, names in enumerate(plan):
        for name in names:
            if name not in modules or not name:
                raise ValueError(
                    f"stage {s}: {name!r} is not a submodule of {type(model).__name__}"
                )
            if name in owner:
                raise ValueError(f"{name!r} is given to stages {owner[name]} and {s}")
            owner[name] = s
    for name in owner:
        parent = name.rpartition(".")[0]
        while parent:
            if parent in owner:
                raise ValueError(f"{name!r} is inside {parent!r}, which the plan also names")
            parent = parent.rpartition(".")[0]
    return owner


def _stage_copy(model: nn.Module, owner: dict[str, int], stage: int) -> nn.Module:
    """Deepcopy ``model``, substituting the layers of other stages (never copied)."""
    memo: dict[int, object] = {}
    for name, s in owner.items():
        if s == stage:
            continue
        parent_name, _, _ = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        replacement = nn.Identity() if isinstance(parent, _CONTAINERS) else None
        memo[id(model.get_submodule(name))] = replacement
    return copy.deepcopy(model, memo)
