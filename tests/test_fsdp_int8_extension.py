"""The README's all-gather extension: weights all-gathered as int8 with a per-row scale.

Oracles: (1) training with ``fully_shard`` at 2 ranks matches, bit for bit, one process
that does the same casts by hand each step (quantize each full weight per row, dequantize,
gradient straight through to the fp32 weight; the batch halves backpropagated one after the
other and averaged as the 2-rank reduce-scatter does); (2) the all-gather moves int8 bytes:
counted on the collective plait calls, a step gathers exactly the int8 rows, the fp32
scales and the fp32 biases, about a quarter of the plain fp32 gather.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.int8_weight import Int8GatherWeight, dequantize, int8_gather_linears, quantize
from plait.fsdp import fully_shard

from collective_spy import spy_collectives
from harness import run_on_ranks


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _shard(model: nn.Sequential, reshard_after_forward: bool) -> nn.Sequential:
    for layer in (model[0], model[2]):
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


class _StraightThrough(torch.autograd.Function):
    """Forward ``cast`` (the dequantized weight); the gradient goes to ``weight`` unchanged."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
        return cast

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _reference_forward(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for layer in model:
        if isinstance(layer, nn.Linear):
            cast = dequantize(*quantize(layer.weight), layer.weight.dtype)
            x = F.linear(x, _StraightThrough.apply(layer.weight, cast), layer.bias)
        else:
            x = layer(x)
    return x


def _train(reshard_after_forward: bool) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _mlp(), _mlp()
    assert int8_gather_linears(model) == 2
    _shard(model, reshard_after_forward)
    assert isinstance(model[0].weight.to_local(), Int8GatherWeight)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(4):
        batch = torch.randn(world, 4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(batch[rank]).sum()
        loss.backward()
        for half in batch:  # the ranks' gradients, summed in rank order, then averaged
            _reference_forward(ref, half).sum().backward()
        for param in ref.parameters():
            param.grad.div_(world)
        ref_loss = _reference_forward(ref, batch[rank]).sum()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=0, atol=0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(
            param.full_tensor(), ref_param.detach(), rtol=0, atol=0, msg=name
        )
    # The weights really went through int8: they differ from plain fp32 training's.
    plain = _shard(_mlp(), reshard_after_forward)
    out, plain_out = model(batch[rank]), plain(batch[rank])
    return int(not torch.equal(out, plain_out))


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_int8_gather_trains_exactly_like_casts_by_hand(reshard_after_forward: bool) -> None:
    assert run_on_ranks(2, _train, reshard_after_forward) == [1, 1]


def _gathered_bytes(int8: bool) -> tuple[int, list[str]]:
    model = _mlp()
    if int8:
        int8_gather_linears(model)
    _shard(model, reshard_after_forward=False)  # one gather per unit per step
    x = torch.randn(4, 8)
    model(x).sum().backward()  # warm up: the first gather allocates
    with spy_collectives("all_gather_single") as calls:
        model(x).sum().backward()
    gathers = calls["all_gather_single"]
    return sum(numel * dtype.itemsize for dtype, numel in gathers), [str(d) for d, _ in gathers]


def test_all_gather_moves_int8_bytes() -> None:
    world = 2
    for (int8_bytes, dtypes), (plain_bytes, _) in zip(
        run_on_ranks(world, _gathered_bytes, True),
        run_on_ranks(world, _gathered_bytes, False),
        strict=True,
    ):
        # Per Linear(i, o): o * i int8 weights, o fp32 scales, o fp32 biases (all ranks' rows).
        assert int8_bytes == (16 * 8 + 16 * 4 + 16 * 4) + (8 * 16 + 8 * 4 + 8 * 4)
        assert plain_bytes == (16 * 8 * 4 + 16 * 4) + (8 * 16 * 4 + 8 * 4)
        assert dtypes == ["torch.uint8", "torch.uint8"]  # each unit: one gather, as bytes


def _uneven() -> str:
    model = nn.Sequential(nn.Linear(8, 5))
    int8_gather_linears(model)
    fully_shard(model)
    try:
        model(torch.randn(2, 8))
    except ValueError as err:
        return str(err)
    return "no error"


def test_uneven_rows_are_refused_with_the_fix() -> None:
    for text in run_on_ranks(2, _uneven):
        assert "does not shard evenly over 2 ranks" in text, text
