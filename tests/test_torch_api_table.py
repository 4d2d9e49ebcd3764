"""docs/torch_api.md against the code: what it claims plait provides must import, and every
public name of torch 2.13's composable family must have a row."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import torch.distributed.fsdp as torch_fsdp
import torch.distributed.pipelining as torch_pipelining
import torch.distributed.pipelining.microbatch as torch_microbatch
import torch.distributed.pipelining.schedules as torch_schedules
import torch.distributed.pipelining.stage as torch_stage
from torch import nn

TABLE = Path(__file__).resolve().parents[1] / "docs" / "torch_api.md"
STATUSES = ("same", "different on purpose", "not provided")
_NAME = re.compile(r"`([A-Za-z_][\w.]*)`")


class Row:
    def __init__(self, line: str) -> None:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 3, f"a row needs 3 cells (torch | plait | status): {line}"
        self.torch_names = _NAME.findall(cells[0])
        self.plait_names = _NAME.findall(cells[1])
        self.status = cells[2]
        self.line = line


def rows() -> list[Row]:
    lines = TABLE.read_text().splitlines()
    return [Row(line) for line in lines if line.startswith("| `")]


def resolve(dotted: str) -> Any:
    """The object a dotted name denotes: attributes where they exist, else submodules."""
    parts = dotted.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        obj = (
            getattr(obj, part)
            if hasattr(obj, part)
            else importlib.import_module(".".join(parts[:i]))
        )
    return obj


def torch_family() -> list[list[str]]:
    """torch 2.13's public names, each as the spellings a row may use for it."""
    pipelining = "torch.distributed.pipelining"
    names = [[f"torch.distributed.fsdp.{n}"] for n in torch_fsdp.__all__]
    names += [
        [f"torch.distributed.fsdp.FSDPModule.{m}"]
        for m in dir(torch_fsdp.FSDPModule)
        if not m.startswith("_") and not hasattr(nn.Module, m)
    ]
    names += [
        [f"torch.distributed._composable.{n}"]
        for n in ("contract", "_get_registry", "checkpoint", "replicate", "replicate_with_fsdp")
    ]
    names += [[f"{pipelining}.{n}"] for n in torch_pipelining.__all__]
    names += [[f"{pipelining}.{n}"] for n in torch_stage.__all__]
    extra_schedules = ["_ScheduleForwardOnly", "_PipelineScheduleRuntime"]
    names += [
        [f"{pipelining}.{n}", f"{pipelining}.schedules.{n}"]
        for n in [*torch_schedules.__all__, *extra_schedules]
    ]
    names += [
        [f"{pipelining}.schedules.{cls}.{m}"]
        for cls in ("PipelineScheduleSingle", "PipelineScheduleMulti")
        for m in ("step", "eval")
    ]
    names += [[f"{pipelining}.microbatch.{n}"] for n in torch_microbatch.__all__]
    return names


def test_every_row_has_a_status_and_plait_names_that_import() -> None:
    table = rows()
    assert len(table) > 50
    for row in table:
        assert row.status.startswith(STATUSES), f"unknown status in: {row.line}"
        if row.status.startswith("not provided"):
            assert row.plait_names == [], f"'not provided' but names plait code: {row.line}"
            continue
        assert row.plait_names, f"provided, but no plait name given: {row.line}"
        for name in row.plait_names:
            assert name.startswith("plait."), name
            resolve(name)  # raises if the table claims a name plait does not have


def test_every_torch_name_the_table_lists_exists_in_torch() -> None:
    for row in rows():
        for name in row.torch_names:
            resolve(name)


def test_every_public_torch_name_has_a_row() -> None:
    listed = {name for row in rows() for name in row.torch_names}
    missing = [spellings[0] for spellings in torch_family() if not listed & set(spellings)]
    assert missing == [], f"torch names without a row in {TABLE.name}: {missing}"


def test_resolve_fails_for_a_name_that_does_not_exist() -> None:
    # the check above must be able to fail
    try:
        resolve("plait.FSDPModule.no_such_method")
    except (AttributeError, ModuleNotFoundError):
        pass
    else:
        raise AssertionError("resolve accepted a missing name")
