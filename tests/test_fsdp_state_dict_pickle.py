"""Sharded state dicts survive ``torch.save`` / ``torch.load``, ``pickle`` and ``deepcopy``.

The most common way to save a model is ``torch.save(model.state_dict(), path)`` on each
rank. plait keeps a unit's shards as pieces of one flat buffer; a DTensor around a view at
a non-zero storage offset does not pickle, so every parameter but the first of each unit
used to fail. Here every state-dict form (``model.state_dict()`` with the optimizer's,
``get_model_state_dict``, ``get_state_dict``), in every layout (FSDP at 1, 2 and 4 ranks,
HSDP, FSDP x TP, CPU offload, bf16 mixed precision), at every moment (before the first
forward, after steps, after ``reshard()``) is saved, loaded, pickled and deep-copied; the
copies equal the original and torch's own ``fully_shard`` state dict of the same run, and
a fresh sharded model that loads them trains on exactly as the uninterrupted one.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import plait
from plait.mesh import own_storage

from harness import run_on_ranks
from models import MLPStack
from parity import default_optimizer, local_slice, random_batches

# Widths that split unevenly over 2 and 4 ranks, also after tensor parallelism (10 -> 5).
DIM, HIDDEN = 7, 10
BEFORE, AFTER = 2, 2  # steps before saving, then after loading
Batches = list[tuple[torch.Tensor, torch.Tensor]]


# --- building one layout, on plait or on torch -------------------------------------------------


def _meshes(layout: str) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(the fully_shard mesh, the tensor-parallel mesh or None) for ``layout``."""
    world = dist.get_world_size()
    if layout == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard")), None
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        return mesh["dp"], mesh["tp"]
    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), None


def _build(shard: Callable[..., Any], layout: str, seed: int) -> tuple[nn.Module, Any]:
    """An MLPStack sharded per ``layout`` by ``shard`` (plait's or torch's fully_shard)."""
    api = plait if shard is plait.fully_shard else torch_fsdp
    mesh, tp_mesh = _meshes(layout)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if layout == "offload":
        kwargs["offload_policy"] = api.CPUOffloadPolicy(pin_memory=False)
    if layout == "bf16":
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    torch.manual_seed(seed)
    model = MLPStack(3, dim=DIM, hidden=HIDDEN)
    if tp_mesh is not None:
        plan: dict[str, Any] = {}
        for i in range(len(model.blocks)):
            plan[f"blocks.{i}.in_proj"] = ColwiseParallel()
            plan[f"blocks.{i}.out_proj"] = RowwiseParallel()
        parallelize_module(model, tp_mesh, plan)
    for block in model.blocks:
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model, default_optimizer(model.parameters())


def _data_rank(layout: str) -> tuple[int, int]:
    """(index, count) of this rank's data slice: tp ranks of one dp rank share data."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return (rank // 2, world // 2) if layout == "tp" else (rank, world)


def _train(model: nn.Module, opt: Any, batches: Batches, layout: str) -> list[float]:
    index, count = _data_rank(layout)
    losses = []
    for x, y in batches:
        loss = nn.functional.mse_loss(
            model(local_slice(x, index, count)), local_slice(y, index, count)
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# --- comparing state dicts ---------------------------------------------------------------------


def _leaves(tree: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in _leaves(v, f"{path}/{k}")]
    if isinstance(tree, (list, tuple)):
        return [leaf for i, v in enumerate(tree) for leaf in _leaves(v, f"{path}/{i}")]
    return [(path, tree)]


def _differences(got: Any, want: Any, *, exact: bool = True) -> list[str]:
    """Where two state dicts differ: structure, tensor type, layout or values."""
    got_leaves, want_leaves = _leaves(got), _leaves(want)
    if [p for p, _ in got_leaves] != [p for p, _ in want_leaves]:
        return [f"keys {[p for p, _ in got_leaves]} != {[p for p, _ in want_leaves]}"]
    problems = []
    for (path, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
        if type(a) is not type(b):
            problems.append(f"{path}: {type(a).__name__} != {type(b).__name__}")
        elif isinstance(a, DTensor):
            if a.placements != b.placements or a.shape != b.shape or a.dtype != b.dtype:
                problems.append(f"{path}: {a.placements} {a.shape} != {b.placements} {b.shape}")
            elif a.device_mesh != b.device_mesh:
                problems.append(f"{path}: another mesh")
            else:
                problems += _value_differences(path, a.to_local(), b.to_local(), exact)
        elif isinstance(a, torch.Tensor):
            problems += _value_differences(path, a, b, exact)
        elif a != b:
            problems.append(f"{path}: {a!r} != {b!r}")
    return problems


def _value_differences(path: str, a: torch.Tensor, b: torch.Tensor, exact: bool) -> list[str]:
    if a.shape != b.shape or a.dtype != b.dtype:
        return [f"{path}: local {a.dtype} {tuple(a.shape)} != {b.dtype} {tuple(b.shape)}"]
    if exact and not torch.equal(a, b):
        return [f"{path}: values differ by {(a - b).abs().max().item():.3g}"]
    if not exact and not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
        return [f"{path}: values differ from torch's by {(a - b).abs().max().item():.3g}"]
    return []


def _copies(state: Any) -> dict[str, Any]:
    """``state`` through torch.save / torch.load (both weights_only settings), a file on disk,
    pickle and deepcopy."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    copies = {}
    for weights_only in (True, False):
        buffer.seek(0)
        copies[f"torch.load(weights_only={weights_only})"] = torch.load(
            buffer, weights_only=weights_only
        )
    copies["pickle"] = pickle.loads(pickle.dumps(state))
    copies["deepcopy"] = copy.deepcopy(state)
    return copies


# --- the forms: how a state dict is taken, and loaded into a fresh model ------------------------


def _take(form: str, model: nn.Module, opt: Any) -> Any:
    if form == "state_dict":
        return {"model": model.state_dict(), "optim": opt.state_dict()}
    if form == "get_model_state_dict":
        return get_model_state_dict(model)
    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state}


def _load(form: str, model: nn.Module, opt: Any, state: Any) -> None:
    if form == "state_dict":
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    elif form == "get_model_state_dict":
        set_model_state_dict(model, state)
    else:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _to_moment(moment: str, model: nn.Module, opt: Any, batches: Batches, layout: str) -> None:
    """Bring a fresh model to the moment of saving."""
    if moment == "fresh":  # before the first forward
        return
    _train(model, opt, batches[:BEFORE], layout)
    if moment == "after_reshard":  # gathered by hand, then sharded again
        model.unshard()  # type: ignore[operator]
        model.reshard()  # type: ignore[operator]


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}  # type: ignore[operator]


def _round_trip_body(layout: str, moments: tuple[str, ...]) -> list[str]:
    batches = random_batches(BEFORE + AFTER, 8, DIM, DIM)
    problems: list[str] = []
    for moment in moments:
        # torch's fully_shard on the same run: what the state dict's values must be.
        model, opt = _build(torch_fsdp.fully_shard, layout, seed=0)
        _to_moment(moment, model, opt, batches, layout)
        torch_state = _take("get_state_dict", model, opt)
        for form in ("state_dict", "get_model_state_dict", "get_state_dict"):
            where = f"{layout} {moment} {form}"
            model, opt = _build(plait.fully_shard, layout, seed=0)
            _to_moment(moment, model, opt, batches, layout)
            state = _take(form, model, opt)
            if form == "get_state_dict":
                problems += [f"{where} vs torch: {p}" for p in _differences(state, torch_state)]
            copies = _copies(state)
            for how, copied in copies.items():
                problems += [f"{where} {how}: {p}" for p in _differences(copied, state)]
            # A fresh model of the same layout (other initial values) loads the saved copy
            # and trains on exactly as the uninterrupted one.
            fresh, fresh_opt = _build(plait.fully_shard, layout, seed=1)
            _load(form, fresh, fresh_opt, copies["torch.load(weights_only=True)"])
            if form == "get_model_state_dict":  # the optimizer's state was not saved
                fresh_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            rest = batches[BEFORE:]
            if _train(fresh, fresh_opt, rest, layout) != _train(model, opt, rest, layout):
                problems.append(f"{where}: the loaded model's losses differ")
            problems += [
                f"{where} resumed: {p}" for p in _differences(_params(fresh), _params(model))
            ]
    return problems


MOMENTS = ("fresh", "after_steps", "after_reshard")
CASES = [
    pytest.param(1, "fsdp", MOMENTS, id="fsdp-1"),
    pytest.param(2, "fsdp", MOMENTS, id="fsdp-2"),
    pytest.param(4, "fsdp", MOMENTS, id="fsdp-4"),
    pytest.param(4, "hsdp", ("after_steps",), id="hsdp-4"),
    pytest.param(2, "tp", ("after_steps",), id="fsdp-x-tp-2"),
    pytest.param(4, "tp", ("fresh", "after_steps"), id="fsdp-x-tp-4"),
    pytest.param(2, "offload", ("after_steps",), id="cpu-offload-2"),
    pytest.param(2, "bf16", ("after_steps", "after_reshard"), id="bf16-2"),
]


@pytest.mark.parametrize(("world", "layout", "moments"), CASES)
def test_state_dict_saves_loads_and_trains_on(
    world: int, layout: str, moments: tuple[str, ...]
) -> None:
    for problems in run_on_ranks(world, _round_trip_body, layout, moments, timeout=180):
        assert not problems, "\n".join(problems)


# --- the storage the shards live in --------------------------------------------------------------


def _one_buffer_body() -> list[str]:
    """Shards still live in one flat buffer per unit (the fast path), each at offset 0 of
    its own storage object, so a DTensor around it pickles."""
    model, _ = _build(plait.fully_shard, "fsdp", seed=0)
    problems = []
    for block in model.blocks:
        unit = plait.fully_shard.state(block).unit
        flat = unit.flat
        if flat is None:
            problems.append("a unit has no flat buffer")
            continue
        begin, end = flat.data_ptr(), flat.data_ptr() + flat.nbytes
        for p in unit.params:
            local = p.sharded.to_local()
            if local.storage_offset() != 0:
                problems.append(f"{p.fqn}: storage offset {local.storage_offset()}")
            if not begin <= local.data_ptr() < end or local.data_ptr() == 0:
                problems.append(f"{p.fqn}: not inside the unit's buffer")
        # Reduced gradients are pieces of one reduce-scatter output: they pickle too.
        model(torch.randn(2, DIM)).sum().backward()
        for p in unit.params:
            grad = p.sharded.grad
            if grad is None or not torch.equal(
                pickle.loads(pickle.dumps(grad)).to_local(), grad.to_local()
            ):
                problems.append(f"{p.fqn}: its gradient does not pickle")
        # Writing through a shard (what optimizers do) reaches the all-gather's input.
        with torch.no_grad():
            unit.params[-1].sharded.to_local().fill_(3.0)
        if not (flat == 3.0).any():
            problems.append("a write to a shard did not reach the flat buffer")
    return problems


def test_shards_stay_in_one_buffer_per_unit() -> None:
    for problems in run_on_ranks(2, _one_buffer_body):
        assert not problems, problems


def test_own_storage_aliases_without_copying() -> None:
    flat = torch.arange(12.0)
    view = flat[4:10].view(2, 3)
    alias = own_storage(view)
    assert alias.storage_offset() == 0 and alias.shape == (2, 3)
    assert alias.data_ptr() == view.data_ptr()
    alias.fill_(-1.0)
    assert flat[4:10].eq(-1.0).all() and flat[:4].eq(torch.arange(4.0)).all()
    del flat, view
    assert pickle.loads(pickle.dumps(alias)).eq(-1.0).all()  # the buffer lives on
    assert own_storage(torch.arange(3.0)[:0]).numel() == 0
    with pytest.raises(ValueError, match="contiguous"):
        own_storage(torch.zeros(4, 4)[1:, 1:])
