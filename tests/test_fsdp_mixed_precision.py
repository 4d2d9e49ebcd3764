"""Mixed precision's cast of forward inputs through every container torch's cast reaches.

Idea of torch's ``test_fully_shard_mixed_precision.py::test_dataclass_input``: floating
tensors inside dataclasses (frozen too), namedtuples, OrderedDicts, dicts, lists, tuples
and sets reach the module in ``param_dtype``; integer tensors and other objects untouched.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.fsdp import MixedPrecisionPolicy, fully_shard

from harness import run_on_ranks


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    ids: torch.Tensor
    extra: dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def test_cast_floating_reaches_every_container() -> None:
    from plait.fsdp.cast import cast_floating  # here: the end-to-end test runs without it

    f = torch.ones(2)
    tree = (
        Batch(f, torch.ones(2, dtype=torch.long), {"y": f}),
        Frozen(f),
        Pair(f, f),
        OrderedDict(k=f),
        [f, "s", 3],
        {f},
    )
    out = cast_floating(tree, torch.bfloat16)
    batch, frozen, pair, od, lst, st = out
    assert isinstance(batch, Batch) and batch.x.dtype == torch.bfloat16
    assert batch.ids.dtype == torch.long and batch.extra["y"].dtype == torch.bfloat16
    assert isinstance(frozen, Frozen) and frozen.x.dtype == torch.bfloat16
    assert isinstance(pair, Pair) and pair.b.dtype == torch.bfloat16
    assert type(od) is OrderedDict and od["k"].dtype == torch.bfloat16
    assert lst[0].dtype == torch.bfloat16 and lst[1:] == ["s", 3]
    assert next(iter(st)).dtype == torch.bfloat16
    assert tree[0].x.dtype == torch.float32  # the input is not mutated


class _Takes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, batch: Batch, frozen: Frozen) -> torch.Tensor:
        assert batch.x.dtype == torch.bfloat16, batch.x.dtype
        assert frozen.x.dtype == torch.bfloat16, frozen.x.dtype
        assert batch.ids.dtype == torch.long
        return self.lin(batch.x) + self.lin(frozen.x)


def _dataclass_input() -> str:
    model = _Takes()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x = torch.randn(2, 4)
    out = model(Batch(x, torch.zeros(2, dtype=torch.long), {}), frozen=Frozen(x))
    out.sum().backward()
    return str(out.dtype)


def test_dataclass_input() -> None:
    assert run_on_ranks(2, _dataclass_input) == ["torch.bfloat16"] * 2


# --- structured activations between units (test_structured_input_output) -----------------


@dataclasses.dataclass
class Inner:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Outer:
    inner: Inner
    z: torch.Tensor


class _ToOuter(nn.Module):
    def forward(self, x: torch.Tensor) -> Outer:
        return Outer(Inner(x, x.clone()), x.clone())


class _OnOuter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, o: Outer) -> Outer:
        return Outer(Inner(self.lin(o.inner.x), self.lin(o.inner.y)), self.lin(o.z))


class _FromOuter(nn.Module):
    def forward(self, o: Outer) -> torch.Tensor:
        return o.inner.x + o.inner.y + o.z


def _structured(param_dtype: torch.dtype | None) -> None:
    import copy

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    model = nn.Sequential(_ToOuter(), _OnOuter(), _OnOuter(), _FromOuter())
    ref = copy.deepcopy(model)
    compute = copy.deepcopy(ref).to(param_dtype) if param_dtype is not None else ref
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for module in model:
        fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(3):
        batch = torch.rand(world * 2, 8)
        loss = model(batch[rank * 2 : rank * 2 + 2]).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = compute(batch.to(param_dtype or torch.float32)).sum()
        ref_loss.backward()
        for p, c in zip(ref.parameters(), compute.parameters(), strict=True):
            grad = c.grad.float() / world  # the average over ranks, in fp32
            c.grad = None
            p.grad = grad
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for p, c in zip(ref.parameters(), compute.parameters(), strict=True):
                c.copy_(p)
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        tol = 1e-5 if param_dtype is None else 2e-2
        torch.testing.assert_close(total, ref_loss.detach().float(), rtol=tol, atol=tol)
    if param_dtype is None:
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.full_tensor(), r.detach())


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_structured_input_output(param_dtype: torch.dtype | None) -> None:
    run_on_ranks(2, _structured, param_dtype)
