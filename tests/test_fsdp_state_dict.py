"""State dicts and checkpoints of ``fully_shard``-ed models.

Sharded state dicts share storage with the parameters; DCP saves model and optimizer at
one world size and resumes at another exactly as an uninterrupted single-process run;
full state dicts gather on rank 0 and load into unsharded and sharded models; bad state
dicts fail naming the key.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from plait.fsdp import MixedPrecisionPolicy, fully_shard
from plait.fsdp.state_dict import (
    get_full_state_dict,
    set_full_state_dict,
)

from harness import run_on_ranks
from models import MLPStack, hsdp_mesh, shard_blocks
from parity import default_optimizer, local_slice, random_batches

# Dimensions that do not divide by 2 or 4; the 7-row bias leaves rank 3 of 4 one row.
DIM, HIDDEN = 7, 13
STEPS, SAVE_AT = 6, 3
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _stack() -> MLPStack:
    return MLPStack(3, dim=DIM, hidden=HIDDEN)


def _shard(model: MLPStack, hsdp: bool = False) -> nn.Module:
    """Shard each block and the root; ``hsdp``: over a 2x2 (replicate, shard) mesh."""
    return shard_blocks(model, mesh=hsdp_mesh() if hsdp else None)


def _batches() -> Batches:
    return random_batches(STEPS, 8, DIM, DIM)


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, batches: Batches, sharded: bool = True
) -> list[float]:
    """Train on this rank's slice (or the whole batch); returns the global mean losses."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    losses = []
    for x, y in batches:
        loss = nn.functional.mse_loss(
            model(local_slice(x, rank, world)), local_slice(y, rank, world)
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if sharded:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _reference(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the global batches, ``steps`` AdamW steps: losses and final parameters."""
    torch.manual_seed(0)
    model = _stack()
    losses = _train(model, default_optimizer(model.parameters()), _batches()[:steps], False)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_params_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert not isinstance(got[key], DTensor), key
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-5, msg=key)


# --- the sharded state dict --------------------------------------------------------------------


def _sharded_state_dict() -> None:
    model = _shard(_stack())
    model(torch.randn(4, DIM)).sum().backward()  # a step, so gradients and unshards happened
    for keep_vars in (False, True):
        state = model.state_dict(keep_vars=keep_vars)
        for name, p in model.named_parameters():
            value = state[name]
            assert isinstance(value, DTensor) and value.placements == (Shard(0),), name
            assert value.to_local().data_ptr() == p.to_local().data_ptr(), name
            assert (value is p) == keep_vars, name
    # The root keeps its parameters gathered after a forward (reshard_after_forward=None):
    # saving then still gives its shards, and leaves the unit as it was.
    out = model(torch.randn(4, DIM))
    assert not isinstance(model.head.weight, DTensor)
    state = model.state_dict()
    assert not isinstance(model.head.weight, DTensor)
    assert isinstance(state["head.weight"], DTensor)
    assert state["head.weight"].to_local().data_ptr() == (
        fully_shard.state(model).unit.params[0].sharded.to_local().data_ptr()
    )
    out.sum().backward()


def test_state_dict_is_sharded_and_shares_storage_even_while_unsharded() -> None:
    run_on_ranks(2, _sharded_state_dict)


def _mixed_precision() -> None:
    torch.manual_seed(0)
    reference = _stack()
    torch.manual_seed(0)
    model = fully_shard(
        _stack(),
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        reshard_after_forward=False,
    )
    model(torch.randn(4, DIM))  # gathered in bf16, and kept so
    assert model.head.weight.dtype == torch.bfloat16
    state = model.state_dict()  # still the fp32 shards
    assert all(isinstance(v, DTensor) and v.dtype == torch.float32 for v in state.values())
    _assert_params_equal(get_full_state_dict(model, rank0_only=False), reference.state_dict())
    torch.manual_seed(5)
    other = _stack().state_dict()
    model.load_state_dict(other)  # reshards the bf16 copies, loads the fp32 shards
    assert isinstance(model.head.weight, DTensor) and model.head.weight.dtype == torch.float32
    _assert_params_equal(get_full_state_dict(model, rank0_only=False), other)


def test_mixed_precision_saves_and_loads_the_fp32_shards() -> None:
    run_on_ranks(2, _mixed_precision)


# --- DCP: save at one world size, resume at another ---------------------------------------------


def _train_and_save(path: str, hsdp: bool) -> list[float]:
    torch.manual_seed(0)
    model = _shard(_stack(), hsdp)
    opt = default_optimizer(model.parameters())
    losses = _train(model, opt, _batches()[:SAVE_AT])
    model_sd, optim_sd = get_state_dict(model, opt)
    placements = (Replicate(), Shard(0)) if hsdp else (Shard(0),)
    assert all(v.placements == placements for v in model_sd.values())
    assert set(optim_sd["state"]) == set(model_sd)  # optimizer state keyed by FQN
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return losses


def _load_and_resume(path: str, hsdp: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(123)  # different initial values: everything must come from the file
    model = _shard(_stack(), hsdp)
    opt = default_optimizer(model.parameters())
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = _train(model, opt, _batches()[SAVE_AT:])
    return losses, get_full_state_dict(model)


@pytest.mark.parametrize(
    ("save", "load"),
    [((4, False), (2, False)), ((2, False), (4, False)), ((4, True), (2, False))],
    ids=["4to2", "2to4", "hsdp2x2to2"],
)
def test_dcp_save_and_resume_at_another_world_size(
    save: tuple[int, bool], load: tuple[int, bool], tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = str(tmp_path_factory.mktemp("dcp"))
    before = run_on_ranks(save[0], _train_and_save, path, save[1])[0]
    after, params = run_on_ranks(load[0], _load_and_resume, path, load[1])[0]
    ref_losses, ref_params = _reference()
    assert before + after == pytest.approx(ref_losses, abs=1e-6, rel=1e-5)
    _assert_params_equal(params, ref_params)


# --- full state dicts ----------------------------------------------------------------------------


def _full_round_trip(hsdp: bool) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _shard(_stack(), hsdp)
    opt = default_optimizer(model.parameters())
    _train(model, opt, _batches()[:SAVE_AT])

    full = get_full_state_dict(model)  # rank 0 only, on CPU
    assert (len(full) > 0) == (rank == 0)
    everywhere = get_full_state_dict(model, rank0_only=False, cpu_offload=False)
    assert all(type(v) is torch.Tensor for v in everywhere.values())
    theirs = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        _assert_params_equal(full, theirs)
        unsharded = _stack()
        unsharded.load_state_dict(full)  # strict: every key, every shape
    full_optim = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True)
    )

    # Into fresh sharded models, four ways, then train on: all must continue identically.
    results = []
    for how in ("load_state_dict", "set_full_state_dict", "broadcast_from_rank0", "meta"):
        torch.manual_seed(100)
        if how == "meta":  # the big-model recipe: no full-size allocation before the load
            with torch.device("meta"):
                fresh = _shard(_stack(), hsdp)
            fresh.to_empty(device="cpu")
        else:
            fresh = _shard(_stack(), hsdp)
        fresh_opt = default_optimizer(fresh.parameters())
        params_before = list(fresh.parameters())
        if how == "load_state_dict":
            fresh.load_state_dict(everywhere)
        elif how == "set_full_state_dict":
            set_full_state_dict(fresh, everywhere)
        else:
            set_full_state_dict(fresh, full, broadcast_from_rank0=True)
        same = [a is b for a, b in zip(fresh.parameters(), params_before, strict=True)]
        assert all(same)  # the same parameter objects: the optimizer stays valid
        assert all(isinstance(p, DTensor) for p in params_before)
        # A copy each time: torch loads 0-dim entries ("step") without copying them, so
        # the optimizer would advance the step counters inside full_optim.
        set_optimizer_state_dict(
            fresh,
            fresh_opt,
            copy.deepcopy(full_optim),
            options=StateDictOptions(full_state_dict=True),
        )
        results.append(_train(fresh, fresh_opt, _batches()[SAVE_AT:]))
    ref_losses, _ = _reference()
    for losses in results:
        assert losses == pytest.approx(ref_losses[SAVE_AT:], abs=1e-6, rel=1e-5)
    return get_full_state_dict(fresh)


@pytest.mark.parametrize(
    ("world_size", "hsdp"), [(2, False), (4, False), (4, True)], ids=["2", "4", "hsdp2x2"]
)
def test_full_state_dict_round_trips(world_size: int, hsdp: bool) -> None:
    results = run_on_ranks(world_size, _full_round_trip, hsdp)
    assert all(r == {} for r in results[1:])
    _assert_params_equal(results[0], _reference()[1])


def _load_into_unsharded_and_assign() -> None:
    torch.manual_seed(0)
    reference = _stack()
    model = _shard(_stack())
    params_before = dict(model.named_parameters())
    out = model(torch.randn(4, DIM))  # leave the root unit gathered: loading reshards it
    assert not isinstance(model.head.weight, DTensor)
    torch.manual_seed(7)
    source = _stack()
    model.load_state_dict(source.state_dict(), assign=True)
    for name, p in model.named_parameters():
        assert p is params_before[name], name  # assign=True kept the unit's parameters
    _assert_params_equal(get_full_state_dict(model, rank0_only=False), source.state_dict())
    del out
    # A sharded state dict of another sharded model loads as well (DTensor into DTensor).
    other = _shard(reference)
    model.load_state_dict(other.state_dict())
    _assert_params_equal(
        get_full_state_dict(model, rank0_only=False), get_full_state_dict(other, rank0_only=False)
    )


def test_load_while_unsharded_and_with_assign() -> None:
    run_on_ranks(2, _load_into_unsharded_and_assign)


# --- errors ---------------------------------------------------------------------------------


def _errors() -> list[str]:
    messages = []

    def expect(call: Callable[[], object]) -> None:
        with pytest.raises(RuntimeError) as info:
            call()
        messages.append(str(info.value))

    model = _shard(_stack())
    full = _stack().state_dict()
    missing = {k: v for k, v in full.items() if k != "head.bias"}
    expect(lambda: model.load_state_dict(missing))
    expect(lambda: set_full_state_dict(model, {**full, "head.extra": torch.zeros(1)}))
    wrong = {**full, "blocks.1.in_proj.weight": torch.zeros(HIDDEN, DIM + 1)}
    expect(lambda: model.load_state_dict(wrong))
    sharded = model.state_dict()
    other = _shard(MLPStack(3, dim=DIM, hidden=HIDDEN + 1)).state_dict()
    expect(
        lambda: model.load_state_dict(
            {**sharded, "blocks.0.out_proj.weight": other["blocks.0.out_proj.weight"]}
        )
    )
    # Rank 0's bad state dict fails on every rank (the others pass nothing): no hang.
    bad = missing if dist.get_rank() == 0 else {}
    expect(lambda: set_full_state_dict(model, bad, broadcast_from_rank0=True))
    return messages


def test_bad_state_dicts_fail_naming_the_key() -> None:
    results = run_on_ranks(2, _errors)
    missing, unexpected, wrong_full, wrong_sharded, broadcast = results[0]
    assert 'Missing key(s) in state_dict: "head.bias"' in missing
    assert 'Unexpected key(s) in state_dict: "head.extra"' in unexpected
    assert "size mismatch for blocks.1.in_proj.weight" in wrong_full
    assert "torch.Size([13, 8])" in wrong_full
    assert "size mismatch for blocks.0.out_proj.weight" in wrong_sharded
    assert "Missing key(s) in state_dict: ['head.bias']" in broadcast
    assert results[1][4] == broadcast
