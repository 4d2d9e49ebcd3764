"""More of torch's upstream fully_shard tests, written from reading them (issue 19).

* ``test_fully_shard_state_dict.py::test_cached_state_dict``: a state dict taken once keeps
  sharing storage with the sharded parameters through optimizer steps, so training code can
  take it once and reuse it (uneven widths included);
* ``test_fully_shard_mixed_precision.py::test_reduce_dtype_after_frozen_first_forward``: a
  unit whose parameters are all frozen in its first forward (under ``no_grad``), with a
  non-float parameter beside them, still reduces in the policy's fp32 once they are
  unfrozen: its gradients are fp32 and equal a bf16 copy's (torch 2.13 fails it on CPU).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait.fsdp import MixedPrecisionPolicy, fully_shard

from harness import run_on_ranks


def _cached_state_dict_body() -> list[str]:
    problems = []
    for width in (2, 3, 4, 5):
        torch.manual_seed(42)
        model = nn.Linear(width, width, bias=False)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = model.state_dict()  # taken once
        weight = model.weight
        assert isinstance(weight, DTensor)

        def shares(state: dict[str, DTensor] = state, weight: DTensor = weight) -> bool:
            mine = state["weight"]._local_tensor.untyped_storage().data_ptr()
            return mine == weight._local_tensor.untyped_storage().data_ptr()

        if not shares():
            problems.append(f"width {width}: state dict does not share the shard's storage")
        x = torch.rand(width, width)
        for _ in range(5):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            if not shares():
                problems.append(f"width {width}: an optimizer step broke the sharing")
        if not torch.equal(state["weight"].to_local(), weight.to_local()):
            problems.append(f"width {width}: the cached state dict holds stale values")
    return problems


def test_a_state_dict_taken_once_follows_training() -> None:
    for problems in run_on_ranks(2, _cached_state_dict_body):
        assert not problems, problems


class _Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        self.non_float = nn.Parameter(torch.ones(16, dtype=torch.int64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _frozen_first_forward_body() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """plait's gradients, and those of a bf16 copy of the model cast to fp32: the same casts
    (every rank sees the same input, so the fp32 average over ranks changes nothing).
    torch 2.13's own fully_shard fails this case on CPU: it assigns the bf16 gradient to
    the fp32 parameter ("attempting to assign a gradient with dtype BFloat16")."""
    torch.manual_seed(0)
    model = _Frozen()
    reference = copy.deepcopy(model.layers).to(torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mp_policy=policy)
    model.requires_grad_(False)
    x = torch.randn(4, 16)
    with torch.no_grad():
        model(x)
    model.layers.requires_grad_(True)
    model(x).sum().backward()
    reference(x.to(torch.bfloat16)).sum().backward()
    ours = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert p.grad.dtype == torch.float32, (name, p.grad.dtype)
            ours[name] = p.grad.full_tensor()  # type: ignore[attr-defined]
    assert model.non_float.grad is None
    theirs = {f"layers.{n}": p.grad.float() for n, p in reference.named_parameters()}  # type: ignore[union-attr]
    return ours, theirs


def test_reduce_dtype_after_a_frozen_first_forward() -> None:
    for ours, theirs in run_on_ranks(2, _frozen_first_forward_body):
        assert ours.keys() == theirs.keys() and len(ours) == 4, ours.keys()
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], atol=0, rtol=0, msg=name)
