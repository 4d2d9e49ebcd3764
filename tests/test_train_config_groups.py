"""TrainConfig's groups (plait.train.config): every field in exactly one, built from it.

The flat TrainConfig stays the one source; a group is a view of some of its fields under
the same names, so functions can say which settings they depend on. A field added to
TrainConfig must be placed in a group (or listed among the model's fields): otherwise
the first test here fails, naming it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from plait.layout import LAYOUT_FIELDS, Layout
from plait.train.config import (
    GROUPS,
    MODEL_FIELDS,
    ExecutionConfig,
    OptimConfig,
    TrainConfig,
)

#: Fields that hold a group of their own: ``ExecutionConfig.layout`` is the Layout.
_NESTED = {"layout": LAYOUT_FIELDS}


def _flat_fields(group: type) -> list[str]:
    """The TrainConfig fields ``group`` holds, a nested Layout's expanded."""
    names: list[str] = []
    for f in dataclasses.fields(group):
        names += _NESTED.get(f.name, (f.name,))
    return names


def test_every_field_is_in_exactly_one_group() -> None:
    placed = Counter(MODEL_FIELDS)
    for group in GROUPS.values():
        placed.update(_flat_fields(group))
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert sorted(fields - set(placed)) == [], "put each new field in a group (config.py)"
    assert sorted(set(placed) - fields) == [], "a group names a field TrainConfig lacks"
    assert sorted(name for name, n in placed.items() if n > 1) == [], "in two groups"


def test_group_properties_do_not_shadow_fields() -> None:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not fields & set(GROUPS)
    for name, group in GROUPS.items():
        assert isinstance(getattr(TrainConfig(), name), group)


def test_groups_hold_the_configurations_values() -> None:
    cfg = TrainConfig(lr=1e-4, steps=7, dp_shard=2, tp=2, device="cpu", wandb_project="x")
    for name, group in GROUPS.items():
        view = getattr(cfg, name)
        for f in dataclasses.fields(group):
            assert getattr(view, f.name) == getattr(cfg, f.name), (name, f.name)
    assert cfg.optim == OptimConfig.of(cfg) and cfg.optim.lr == 1e-4
    layout = Layout(**{name: getattr(cfg, name) for name in LAYOUT_FIELDS})
    assert cfg.execution.layout == cfg.layout == layout
    # A group passed where a group or a TrainConfig is taken is used as it is.
    execution = cfg.execution
    assert ExecutionConfig.of(execution) is execution


def test_groups_are_frozen_and_follow_replace() -> None:
    cfg = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0  # type: ignore[misc]
    assert cfg.replace(lr=0.5).optim.lr == 0.5
    assert cfg.replace(keep=9).run.keep == 9
    assert cfg.to_dict() == dataclasses.asdict(cfg)  # the properties add no keys
    assert set(cfg.to_dict()) == {f.name for f in dataclasses.fields(TrainConfig)}
