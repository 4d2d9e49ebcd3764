"""DCP checkpoints across (dp, tp) layouts: saved at one, loaded at another, training goes on
exactly as if it had never stopped.

A TinyGPT (tests/tp_models.py) trains 2 steps at one layout, saves model and AdamW state with
``torch.distributed.checkpoint`` (``get_state_dict`` / ``set_state_dict`` as torchtitan does),
then a fresh model at another layout loads it and trains 2 more steps. Every layout's 4
losses and final parameters must equal one process training 4 steps on the same global
batches. Layouts: dp 2 x tp 2 (fully_shard over TP, sequence parallel), dp 4 (fully_shard
alone), one process (no parallelism at all); pp 2 x tp 2 loads are covered through
``plait train`` in tests/test_train_tp.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from tp_models import TinyGPT, apply_tp, lm_loss, token_batches

from plait.fsdp import fully_shard

from harness import run_on_ranks
from parity import full_value, local_slice

BATCH, SAVED_AT, STEPS = 4, 2, 4


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _build(layout: str) -> tuple[nn.Module, int, int]:
    """The model at ``layout`` and this rank's data slice (rank, world) in the dp split."""
    torch.manual_seed(0)
    model = TinyGPT()
    if layout == "one":
        return model, 0, 1
    if layout == "dp4":
        dp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    else:  # "dp2xtp2"
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        apply_tp(model, mesh["tp"], sequence_parallel=True)
        dp_mesh = mesh["dp"]
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model, dp_mesh.get_local_rank(), dp_mesh.size()


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, steps: range
) -> list[float]:
    losses = []
    batches = token_batches(STEPS, BATCH)
    for i in steps:
        tokens, targets = batches[i]
        loss = lm_loss(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized() and world > 1:
            dist.all_reduce(total)  # tp ranks hold the same loss: the world mean is the dp mean
            total /= dist.get_world_size()
        losses.append(total.item())
    return losses


def _save_body(layout: str, path: str) -> list[float]:
    model, rank, world = _build(layout)
    opt = _optimizer(model)
    losses = _train(model, opt, rank, world, range(SAVED_AT))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return losses


def _resume_body(layout: str, path: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, rank, world = _build(layout)
    opt = _optimizer(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = _train(model, opt, rank, world, range(SAVED_AT, STEPS))
    return losses, {k: full_value(v.detach()) for k, v in model.named_parameters()}


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model, _, _ = _build("one")
    losses = _train(model, _optimizer(model), 0, 1, range(STEPS))
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _run(layout: str, body: object, *args: object) -> object:
    return run_on_ranks(1 if layout == "one" else 4, body, layout, *args)[0]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [("dp2xtp2", "dp4"), ("dp2xtp2", "one"), ("dp2xtp2", "dp2xtp2"), ("dp4", "dp2xtp2")],
)
def test_checkpoint_moves_between_layouts(saved: str, loaded: str, tmp_path: Path) -> None:
    want_losses, want_params = _reference()
    first = _run(saved, _save_body, str(tmp_path))
    then, params = _run(loaded, _resume_body, str(tmp_path))  # type: ignore[misc]
    assert first + then == pytest.approx(want_losses, abs=1e-6), (first, then, want_losses)
    for name, want in want_params.items():
        torch.testing.assert_close(params[name], want, atol=1e-5, rtol=1e-5, msg=name)
