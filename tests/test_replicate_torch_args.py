"""``replicate`` takes the DDP keywords torch's composable ``replicate`` passes on to DDP
(issue 40: torch's own ``fully_shard`` tests build their reference model with them).

* ``device_ids``: ``None`` (or empty) for a CPU module, as torch's tests pass it on CPU
  (``_get_device_ids(rank)``); ``[d]`` means ``device_id=d``; more than one device, or any
  device for a CPU module, is refused with torch's sentence (``ValueError``), plus the fix;
* ``output_device``: ``None``, or the ``device_ids`` device;
* ``process_group``: the data-parallel group, in place of ``mesh`` / ``device_mesh``: the
  broadcast at apply time and the all-reduces run over it alone;
* ``find_unused_parameters`` (already accepted) together with the above.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.replicate import replicate

from harness import run_on_ranks
from models import MLP

WORLD = 2


def _grads_after_step(module: nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(10 + dist.get_rank())  # each rank its own batch
    module(torch.randn(4, 8)).sum().backward()
    return [p.grad.clone() for p in module.parameters()]


def _reference_grads() -> list[torch.Tensor]:
    """The gradient one process gets for the two ranks' batches (the mean of both)."""
    torch.manual_seed(0)
    model = MLP()
    grads = []
    for rank in range(WORLD):
        model.zero_grad()
        torch.manual_seed(10 + rank)
        model(torch.randn(4, 8)).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return [sum(parts) / WORLD for parts in zip(*grads, strict=True)]


def _ddp_keywords_body() -> list[list[torch.Tensor]]:
    results = []
    for kwargs in (
        {"device_ids": None, "find_unused_parameters": True},
        {"device_ids": [], "output_device": None, "find_unused_parameters": False},
        {"device_ids": None, "process_group": dist.group.WORLD},
    ):
        torch.manual_seed(dist.get_rank())  # replicas differ until replicate broadcasts
        model = MLP()
        replicate(model, **kwargs)
        results.append(_grads_after_step(model))
    return results


def test_ddp_keywords_train_as_one_process() -> None:
    want = _reference_grads()
    for per_rank in run_on_ranks(WORLD, _ddp_keywords_body):
        for grads in per_rank:
            for got, ref in zip(grads, want, strict=True):
                torch.testing.assert_close(got, ref)


def _own_group_body() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    own, _ = dist.new_subgroups(group_size=1)
    torch.manual_seed(dist.get_rank())
    model = MLP()
    before = [p.detach().clone() for p in model.parameters()]
    replicate(model, process_group=own)
    after = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(dist.get_rank())
    local = MLP()  # the same initial values, never replicated
    torch.manual_seed(10 + dist.get_rank())
    local(torch.randn(4, 8)).sum().backward()
    grads = _grads_after_step(model)
    for b, a in zip(before, after, strict=True):
        assert torch.equal(b, a)  # nothing broadcast from outside this rank's group
    return grads, [p.grad for p in local.parameters()], after


def test_process_group_is_the_data_parallel_group() -> None:
    """Over a group of one rank each, nothing is broadcast and nothing is averaged."""
    results = run_on_ranks(WORLD, _own_group_body)
    for grads, local_grads, _ in results:
        for got, ref in zip(grads, local_grads, strict=True):
            torch.testing.assert_close(got, ref)
    assert not torch.equal(results[0][2][0], results[1][2][0])  # the replicas stayed apart


def _refusals_body() -> dict[str, tuple[str, str]]:
    found: dict[str, tuple[str, str]] = {}
    cases = {
        "cpu": {"device_ids": [dist.get_rank()]},
        "many": {"device_ids": [0, 1]},
        "output": {"output_device": 0},
        "both_groups": {"process_group": dist.group.WORLD, "device_mesh": _mesh()},
        "group_type": {"process_group": "world"},
    }
    for key, kwargs in cases.items():
        module = MLP()
        try:
            replicate(module, **kwargs)
        except Exception as error:  # the test inspects what was raised
            found[key] = (type(error).__name__, str(error))
            assert replicate.state(module) is None  # left as it was
        else:
            found[key] = ("", "nothing raised")
    return found


def _mesh() -> object:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


REFUSALS = {
    # torch's sentences (DDP's), which code written for torch matches on, then the fix.
    "cpu": (
        "ValueError",
        "device_ids and output_device arguments only work with",
        "device_ids=None",
    ),
    "many": ("ValueError", "device_ids can only be None or contain a single element", "one"),
    "output": ("ValueError", "device_ids and output_device arguments only work with", "None"),
    "both_groups": ("ValueError", "process_group", "one of"),
    "group_type": ("TypeError", "process_group", "ProcessGroup"),
}


@pytest.mark.parametrize("key", sorted(REFUSALS))
def test_device_ids_refusals_carry_torchs_sentence(key: str) -> None:
    for found in run_on_ranks(WORLD, _refusals_body):
        kind, message = found[key]
        want_kind, torch_words, fix = REFUSALS[key]
        assert kind == want_kind, (kind, message)
        assert torch_words in message and fix in message, message
