"""``TORCH_LOGS`` turns on plait's loggers as it does torch's (``plait.logs``), and
``fully_shard``'s hooks and collectives then log one DEBUG line each, naming the unit."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.fsdp import fully_shard
from plait.logs import TORCH_NAMES, apply_torch_logs

from harness import run_on_ranks

_ALL = sorted({name for names in TORCH_NAMES.values() for name in names})


def _reset() -> None:
    """Every logger :func:`apply_torch_logs` may touch back to logging's defaults."""
    for name in _ALL:
        logger = logging.getLogger(name)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
        for handler in [h for h in logger.handlers if getattr(h, "plait_torch_logs", False)]:
            logger.removeHandler(handler)


@pytest.fixture(autouse=True)
def _loggers_restored() -> Iterator[None]:
    yield
    _reset()


def test_torch_logs_names_set_plait_loggers_at_torchs_levels() -> None:
    levels = apply_torch_logs("+fsdp, -pp,dynamo,output_code")
    assert levels == {
        "plait.fsdp": logging.DEBUG,
        "plait.replicate": logging.DEBUG,
        "plait.pipeline": logging.ERROR,
    }
    fsdp = logging.getLogger("plait.fsdp")
    assert fsdp.getEffectiveLevel() == logging.DEBUG and not fsdp.propagate
    assert logging.getLogger("plait").level == logging.NOTSET  # "distributed" not given
    apply_torch_logs("distributed")  # again: the same handler, not a second one
    apply_torch_logs("+fsdp")
    assert len([h for h in fsdp.handlers if getattr(h, "plait_torch_logs", False)]) == 1
    assert logging.getLogger("plait").level == logging.INFO
    assert apply_torch_logs("") == {} and apply_torch_logs("+dynamo") == {}


def test_the_environment_variable_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_LOGS", "+ddp")
    assert apply_torch_logs() == {"plait.replicate": logging.DEBUG}
    monkeypatch.delenv("TORCH_LOGS")
    assert apply_torch_logs() == {}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _logged_step() -> list[str]:
    """One forward and backward of two ``fully_shard`` blocks under ``+fsdp``: the lines."""
    apply_torch_logs("+fsdp")
    lines = _Lines()
    logging.getLogger("plait.fsdp").addHandler(lines)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        model(torch.randn(2, 4)).sum().backward()
        dist.barrier()
    finally:
        logging.getLogger("plait.fsdp").removeHandler(lines)
        _reset()  # the worker runs other tests next
    return lines.lines


def test_fully_shard_logs_each_hook_and_collective_with_its_unit() -> None:
    lines = run_on_ranks(2, _logged_step)[0]
    units = {"'0'", "'2'"}
    for action in ("pre_forward", "pre_backward", "post_backward", "all_gather"):
        named = {line.rpartition(" unit ")[2].rstrip(")") for line in lines if action in line}
        assert units <= named, (action, lines)
    assert any(line.startswith("plait.fsdp.reduce_scatter (") for line in lines), lines
    order = [line for line in lines if "pre_forward" in line or "post_backward" in line]
    forward = [i for i, line in enumerate(order) if "pre_forward" in line and "'" in line]
    backward = [i for i, line in enumerate(order) if "post_backward" in line]
    assert forward and backward and max(forward) < min(backward), order
    assert "'2'" in order[backward[0]] and "'0'" in order[backward[-1]], order
