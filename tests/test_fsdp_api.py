"""``fully_shard``'s API surface as torch 2.13 code calls it: signatures, the
``FSDPModule`` state-level methods, errors of the types torch raises, container slicing,
the init-time behaviours of torch's ``test_fully_shard_init.py``, and the layering of
``plait.fsdp``'s own files."""

from __future__ import annotations

import ast
import copy
import inspect
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

import plait
import plait.fsdp.state as fsdp_state
from plait import replicate
from plait.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method, share_comm_ctx

from collective_spy import spy_collectives
from harness import run_on_ranks
from models import MLP, MLPStack

DIM = 8


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


# --- the layering of plait/fsdp ------------------------------------------------------------

# Each file may import only the files listed for it (within plait.fsdp): the DAG of
# docs/architecture.md, collectives <- param <- (settings) <- group <- state <- module <- init <-
# fully_shard (the entry points; api re-exports them), with state_dict / clip / memory
# beside, above state; replicate's unit (replica beside group, replica_state beside state).
_ALLOWED = {
    "policies": set(),
    "collectives": set(),
    "cast": set(),
    "tp": set(),
    "rows": set(),
    "param": {"collectives", "rows", "tp"},
    "settings": {"collectives", "policies"},
    "extensions": {"collectives", "param", "policies"},
    "reduce": {"collectives", "param", "settings"},
    "group": {"collectives", "param", "extensions", "policies", "settings", "reduce"},
    "placement": {"param"},
    "mesh_groups": {"collectives", "group", "param"},
    "root": {"collectives", "param", "group", "settings"},
    "backward_hooks": {"cast"},
    "state": {
        "collectives",
        "param",
        "group",
        "policies",
        "cast",
        "extensions",
        "settings",
        "root",
        "backward_hooks",
    },
    "replica": {"collectives", "param", "group", "settings", "tp"},
    "replica_state": {"param", "root", "state"},
    "state_dict": {"collectives", "param", "rows", "group", "policies", "state"},
    "clip": {"collectives", "param", "group", "policies", "state"},
    "module": {"collectives", "param", "group", "policies", "settings", "root", "state"},
    "init": {
        "collectives",
        "param",
        "group",
        "policies",
        "settings",
        "state",
        "tp",
        "placement",
        "mesh_groups",
    },
    "fully_shard": {
        "collectives",
        "param",
        "group",
        "policies",
        "settings",
        "state",
        "state_dict",
        "module",
        "init",
        "placement",
    },
    "api": {"fully_shard", "init", "module", "state"},
    "memory": {"collectives", "param", "group", "policies", "state", "api"},
}


def _fsdp_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            if module.startswith("plait.fsdp."):
                names.add(module.split(".")[2])
    return names


def test_fsdp_files_import_each_other_as_a_dag() -> None:
    folder = Path(fsdp_state.__file__).parent
    files = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    assert files <= _ALLOWED.keys(), f"new files need a place in the layering: {files}"
    for name in sorted(files):
        extra = _fsdp_imports(folder / f"{name}.py") - _ALLOWED[name]
        assert not extra, f"plait/fsdp/{name}.py imports {sorted(extra)}: a layer above it"


# --- names and signatures torch code uses ---------------------------------------------------


def test_every_public_fsdp_module_method_of_torch_exists() -> None:
    theirs = {n for n in dir(torch_fsdp.FSDPModule) if not n.startswith("_")}
    ours = set(dir(FSDPModule))
    assert theirs <= ours, f"missing: {sorted(theirs - ours)}"
    assert plait.UnshardHandle is plait.fsdp.UnshardHandle
    assert callable(plait.share_comm_ctx)


@pytest.mark.parametrize(
    "name",
    [
        "set_requires_gradient_sync",
        "set_reshard_after_forward",
        "set_reshard_after_backward",
        "set_requires_all_reduce",
        "set_reduce_scatter_unused_params",
        "set_reduce_scatter_max_input_buffers",
        "set_separate_reduce_scatter_group",
    ],
)
def test_recurse_can_be_given_by_position(name: str) -> None:
    # issue 14 #6: set_reshard_after_forward(True, False)
    params = list(inspect.signature(getattr(FSDPModule, name)).parameters.values())
    assert params[2].name == "recurse"
    assert params[2].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def _setters_positional() -> tuple[bool | None, bool | None]:
    model = MLPStack(2, DIM)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.set_reshard_after_forward(True, False)  # recurse=False: the root only
    with pytest.raises(ValueError, match="must be a bool"):
        model.set_reshard_after_forward(2)  # type: ignore[arg-type]
    root, block = fully_shard.state(model), fully_shard.state(model.blocks[0])
    return root.reshard_after_forward, block.reshard_after_forward


def test_set_reshard_after_forward_with_positional_recurse() -> None:
    assert run_on_ranks(1, _setters_positional) == [(True, None)]


def _deepcopy_error() -> tuple[bool, bool, str]:
    model = fully_shard(MLP(DIM))
    try:
        copy.deepcopy(model)
    except AssertionError as error:  # what torch raises, and code written for it catches
        return True, isinstance(error, RuntimeError), str(error)
    return False, False, ""


def test_deepcopy_raises_an_assertion_error_with_the_fix() -> None:
    caught, runtime, message = run_on_ranks(1, _deepcopy_error)[0]
    assert caught and runtime and "before calling fully_shard" in message


def _register_forward_method_unsharded() -> bool:
    model = MLP(DIM)
    method = model.forward
    register_fsdp_forward_method(model, "forward")  # not sharded: a no-op, as torch
    sharded = fully_shard(MLP(DIM))
    with pytest.raises(ValueError, match="no method 'generate'"):
        register_fsdp_forward_method(sharded, "generate")
    return model.forward == method


def test_register_fsdp_forward_method_on_an_unsharded_module_is_a_no_op() -> None:
    assert run_on_ranks(1, _register_forward_method_unsharded) == [True]


def _slice_sequential(shard: Any) -> tuple[str, bool, bool, float]:
    torch.manual_seed(0)
    seq = nn.Sequential(MLP(DIM), MLP(DIM), MLP(DIM))
    for mlp in seq:
        shard(mlp)
    shard(seq)
    head = seq[0:2]
    x = torch.randn(2, DIM)
    seq(x).sum().backward()
    out = head(x).sum()  # the slice runs its (sharded) children alone
    out.backward()
    return type(head).__name__, head[0] is seq[0], isinstance(head, FSDPModule), out.item()


def _slicing() -> None:
    ours = _slice_sequential(fully_shard)
    assert ours[:3] == ("Sequential", True, False)
    theirs = _slice_sequential(torch_fsdp.fully_shard)
    assert ours == theirs


def test_slicing_a_sharded_sequential_gives_a_plain_one() -> None:
    # issue 14 #6: seq[0:2] raised AttributeError
    run_on_ranks(2, _slicing)


# --- state-level methods -------------------------------------------------------------------


class _Event:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


def _post_optim_event() -> tuple[int, int]:
    model = fully_shard(MLPStack(2, DIM))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events = []

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        events.append(_Event())
        model.set_post_optim_event(events[-1])

    opt.register_step_post_hook(after_step)
    for _ in range(2):
        model(torch.randn(2, DIM)).sum().backward()
        opt.step()
        opt.zero_grad()
    return events[0].waits, events[1].waits  # the second is never followed by a forward


def test_post_optim_event_is_waited_on_once_by_the_next_forward() -> None:
    assert run_on_ranks(1, _post_optim_event) == [(1, 0)]


class _EmbedThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(tokens))


def _unshard_in_backward(keep: bool) -> tuple[int, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _EmbedThenLinear()
    fully_shard(model.embed)
    fully_shard(model)
    model.embed.set_unshard_in_backward(keep)
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(dist.get_rank()))
    out = model(tokens)
    with spy_collectives("all_gather_single", "all_gather_into_tensor") as calls:
        out.sum().backward()
    gathers = sum(len(c) for c in calls.values())
    return gathers, [_full(p.grad) for p in model.parameters()]


def _unshard_in_backward_check() -> None:
    default_gathers, default_grads = _unshard_in_backward(True)
    gathers, grads = _unshard_in_backward(False)
    assert gathers == default_gathers - 1  # the embedding is not gathered in backward
    for a, b in zip(grads, default_grads, strict=True):
        assert torch.equal(a, b)


def test_set_unshard_in_backward_skips_the_gather_and_keeps_the_gradients() -> None:
    run_on_ranks(2, _unshard_in_backward_check)


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(DIM, DIM)
        self.unused = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_params(shard: Any, flag: bool) -> list[Any]:
    model = _Unused()
    shard(model)
    if flag:
        model.set_reduce_scatter_unused_params(True)
    model(torch.randn(2, DIM)).sum().backward()
    return [None if p.grad is None else _full(p.grad) for p in model.unused.parameters()]


def _reduce_scatter_unused() -> None:
    assert _unused_params(fully_shard, False) == [None, None]  # plait's default: as one process
    ours = _unused_params(fully_shard, True)
    theirs = _unused_params(torch_fsdp.fully_shard, True)
    for a, b in zip(ours, theirs, strict=True):
        assert a is not None and torch.equal(a, torch.zeros_like(a)) and torch.equal(a, b)


def test_reduce_scatter_unused_params_gives_zero_gradients_as_torch() -> None:
    run_on_ranks(2, _reduce_scatter_unused)


def _in_flight(limit: int | None) -> tuple[int, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = MLPStack(4, DIM)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if limit is not None:
        model.set_reduce_scatter_max_input_buffers(limit)
    root = fully_shard.state(model)
    most = 0
    original = fsdp_state.FSDPState.reduce_or_stash

    def counting(self: fsdp_state.FSDPState) -> None:
        nonlocal most
        original(self)
        most = max(most, len(root.reducing))

    fsdp_state.FSDPState.reduce_or_stash = counting  # type: ignore[method-assign]
    try:
        model(torch.randn(2, DIM)).sum().backward()
    finally:
        fsdp_state.FSDPState.reduce_or_stash = original  # type: ignore[method-assign]
    return most, [_full(p.grad) for p in model.parameters()]


def _max_input_buffers() -> None:
    default, grads = _in_flight(None)
    two, grads_two = _in_flight(2)
    assert (default, two) == (1, 2)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_two, strict=True))
    model = fully_shard(MLP(DIM))
    with pytest.raises(ValueError, match=">= 1"):
        model.set_reduce_scatter_max_input_buffers(0)
    with pytest.raises(TypeError, match="must be an int"):
        model.set_reduce_scatter_max_input_buffers(True)


def test_reduce_scatter_max_input_buffers_bounds_the_reductions_in_flight() -> None:
    run_on_ranks(2, _max_input_buffers)


def _accepted_no_ops() -> None:
    model = fully_shard(MLP(DIM))
    model.set_allocate_memory_from_process_group_for_comm(True)
    model.set_symm_mem_for_comm()
    model.set_separate_reduce_scatter_group(True, False)
    with pytest.raises(ValueError, match="NCCL"):
        model.set_symm_mem_for_comm("NVSHMEM")
    with pytest.raises(ValueError, match="fully_shard-ed modules"):
        share_comm_ctx([model, nn.Linear(2, 2)])  # type: ignore[list-item]
    model(torch.randn(2, DIM)).sum().backward()
    # torch refuses process-group allocation beside a custom comm (upstream's
    # test_exception_when_used_together_with_comm_hooks), whichever is custom.
    for setter in ("set_custom_all_gather", "set_custom_reduce_scatter"):
        custom = fully_shard(MLP(DIM))
        getattr(custom, setter)(object())
        kind = setter.removeprefix("set_custom_").replace("_", " ")
        with pytest.raises(AssertionError, match=f"when {kind} comm is custom: object"):
            custom.set_allocate_memory_from_process_group_for_comm(False)


def test_transport_knobs_are_accepted() -> None:
    run_on_ranks(2, _accepted_no_ops)


def _share_comm_ctx() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(MLP(DIM) for _ in range(3)))
    reference = copy.deepcopy(model)
    for layer in model:
        fully_shard(layer)  # three roots, no parent unit (torch's test_share_comm_context)
    share_comm_ctx(list(model))
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = model(x).sum()
    ref_loss = reference(x).sum()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    loss.backward()
    ref_loss.backward()
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert ref.grad is not None
        dist.all_reduce(ref.grad)
        torch.testing.assert_close(_full(p.grad), ref.grad / dist.get_world_size())


def test_share_comm_ctx_over_several_roots() -> None:
    run_on_ranks(2, _share_comm_ctx)


def _modules_to_run_stay_empty() -> bool:
    model = MLP(DIM)
    fully_shard(model.in_proj)
    fully_shard(model.out_proj)
    fully_shard(model)
    model(torch.randn(2, DIM)).sum().backward()
    return all(not s.modules_to_run for s in fully_shard.state(model).all_states)


def test_single_module_units_track_no_modules_to_run() -> None:
    # torch's test_modules_to_run_forward_empty_for_single_module
    assert run_on_ranks(1, _modules_to_run_stay_empty) == [True]


# --- init-time behaviours (torch's test_fully_shard_init.py) --------------------------------


def _multi_module_root() -> str:
    model = nn.Sequential(MLP(DIM), MLP(DIM))
    fully_shard([model[0], model[1]])
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, DIM))
    return str(info.value)


def test_a_unit_of_several_modules_cannot_be_the_root() -> None:
    # torch's test_fully_shard_multi_module_root
    assert "a root must be one module" in run_on_ranks(1, _multi_module_root)[0]


def _roots_and_managed() -> tuple[list[bool | None], int, bool]:
    model = nn.Sequential(MLP(DIM), MLP(DIM))
    fully_shard(model[0].in_proj)
    fully_shard(model[0].out_proj)
    fully_shard(model)  # the root gets model[1] only
    model(torch.randn(2, DIM))
    root = fully_shard.state(model)
    flags = [s.is_root for s in root.all_states]
    assert root.unit is not None
    fqns = sorted(p.fqn for p in root.unit.params)
    return (
        flags,
        len(root.all_states),
        fqns == sorted(f"1.{n}" for n, _ in model[1].named_parameters()),
    )


def test_root_and_managed_parameters_after_lazy_init() -> None:
    # torch's test_fully_shard_is_root / _module_and_param_fqns / test_managed_modules_nested
    assert run_on_ranks(1, _roots_and_managed) == [([True, False, False], 3, True)]


def _replicate_child() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(MLP(DIM), MLP(DIM), MLP(DIM))
    reference = copy.deepcopy(model)
    replicate(model[0])
    fully_shard(model[2])
    fully_shard(model)  # manages model[1] only, as torch
    assert not isinstance(model[0].in_proj.weight, DTensor)
    assert isinstance(model[1].in_proj.weight, DTensor)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step))
        mine = x.chunk(dist.get_world_size())[dist.get_rank()]
        model(mine).square().mean().backward()
        reference(x).square().mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(_full(p), ref.detach())


def test_fully_shard_of_a_parent_leaves_a_replicated_child_to_replicate() -> None:
    # torch's test_managed_modules_nested_fully_shard_and_replicate
    run_on_ranks(2, _replicate_child)


def _mesh_errors() -> list[tuple[str, bool]]:
    out = []
    unnamed = init_device_mesh("cpu", (1, 2))
    for call in (
        lambda: fully_shard(MLP(DIM), mesh=unnamed),
        lambda: fully_shard(nn.Conv2d(4, 4, 3).to(memory_format=torch.channels_last)),
    ):
        with pytest.raises(ValueError) as info:
            call()
        error = info.value
        out.append((str(error), isinstance(error, (AssertionError, NotImplementedError))))
    return out


def test_errors_have_torchs_exception_types() -> None:
    # torch's test_2d_mesh_without_mesh_dim_names (AssertionError) and
    # test_raise_noncontiguous_parameter (NotImplementedError)
    (names, names_type), (strides, strides_type) = run_on_ranks(2, _mesh_errors)[0]
    assert "needs mesh_dim_names" in names and names_type
    assert "not contiguous" in strides and strides_type


def _dtensor_params() -> tuple[str, bool]:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    model = MLP(DIM)
    parallelize_module(model, mesh, {"in_proj": ColwiseParallel()})
    with pytest.raises(ValueError) as info:
        fully_shard(model, mesh=mesh)
    return str(info.value), isinstance(info.value, NotImplementedError)


def test_tensor_parallel_parameters_are_refused_clearly() -> None:
    # torch's test_shard_dtensor_parameters: TP over the very mesh fully_shard shards over
    # (test_fsdp_tp.py covers TP on its own mesh dimension, which composes)
    message, not_implemented = run_on_ranks(2, _dtensor_params)[0]
    assert "'in_proj.weight' is a DTensor on mesh" in message and not_implemented
    assert 'mesh["tp"]' in message


def _rank0_broadcast_meta_init() -> None:
    torch.manual_seed(0)
    reference = MLPStack(2, DIM)
    full = reference.state_dict()
    for block in reference.blocks:
        fully_shard(block)
    fully_shard(reference)
    with torch.device("meta"):
        model = MLPStack(2, DIM)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    sharded = {}
    for name, meta in model.state_dict().items():
        value = full[name] if dist.get_rank() == 0 else torch.empty(meta.shape)
        dist.broadcast(value, src=0)
        sharded[name] = nn.Parameter(distribute_tensor(value, meta.device_mesh, meta.placements))
    model.load_state_dict(sharded, assign=True)
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert isinstance(p, DTensor) and p.device.type == "cpu"
        assert torch.equal(p.to_local(), ref.to_local())
    x = torch.randn(4, DIM)
    loss, ref_loss = model(x).sum(), reference(x).sum()
    loss.backward()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad.to_local(), ref.grad.to_local())  # type: ignore[union-attr]


def test_meta_init_then_load_a_sharded_state_dict_with_assign() -> None:
    # torch's test_rank0_broadcast_meta_device_init
    run_on_ranks(2, _rank0_broadcast_meta_init)


class _NormFromLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x)).sum() + self.weight_norm.sum()


def _root_param_computed_after_to_empty() -> tuple[bool, bool]:
    with torch.device("meta"):
        model = _NormFromLayers()
    fully_shard(model.layer1)
    fully_shard(model.layer2)
    fully_shard(model)
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    torch.manual_seed(0)
    for layer in (model.layer1, model.layer2):
        layer.reset_parameters()
    with torch.no_grad():
        norm = torch.linalg.norm(_full(model.layer1.weight), dim=1)
    model.weight_norm = nn.Parameter(norm)  # a full tensor in place of the meta shard
    model(torch.randn(3, 3)).backward()
    weight = model.weight_norm
    return isinstance(weight, DTensor) and torch.equal(_full(weight), norm), (
        weight.grad is not None
    )


def test_a_meta_parameter_replaced_by_a_real_one_is_taken_in() -> None:
    # torch's test_reset_sharded_param_in_lazy_init
    assert run_on_ranks(2, _root_param_computed_after_to_empty) == [(True, True)] * 2


def _frozen_per_group(freeze_after_init: bool, ac: bool, raf: bool | int) -> int:
    from plait import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(*(MLP(DIM, 32) for _ in range(3)))
    reference = copy.deepcopy(model)

    def freeze(m: nn.Module) -> None:
        for name, p in m.named_parameters():
            if "bias" not in name:  # train biases only (BitFit)
                p.requires_grad_(False)

    if not freeze_after_init:
        freeze(model)
    for mlp in model:
        if ac:
            checkpoint(mlp)
        fully_shard(mlp, reshard_after_forward=raf)
    fully_shard(model, reshard_after_forward=raf)
    freeze(model)
    freeze(reference)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.Adam([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    calls = 0
    original = fsdp_state._PostBackward.backward

    def counting(ctx: Any, *grads: torch.Tensor) -> Any:
        nonlocal calls
        calls += 1
        return original(ctx, *grads)

    fsdp_state._PostBackward.backward = staticmethod(counting)  # type: ignore[method-assign]
    try:
        with spy_collectives("reduce_scatter_single") as scattered:
            for step in range(3):
                x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step))
                mine = x.chunk(dist.get_world_size())[dist.get_rank()]
                model(mine).sum().backward()
                (reference(x).sum() / dist.get_world_size()).backward()
                opt.step()
                ref_opt.step()
                opt.zero_grad(set_to_none=step % 2 == 0)
                ref_opt.zero_grad(set_to_none=step % 2 == 0)
    finally:
        fsdp_state._PostBackward.backward = staticmethod(original)  # type: ignore[method-assign]
    world = dist.get_world_size()
    biases = sum(-(-p.numel() // world) for n, p in model[0].named_parameters() if "bias" in n)
    for _, numel in scattered["reduce_scatter_single"]:  # this rank's row: its bias shards
        assert biases <= numel < biases + 4  # (and a count per parameter), no weights
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(_full(p), ref.detach())
    return calls


@pytest.mark.parametrize(
    ("freeze_after_init", "ac", "raf"),
    [(False, False, True), (True, False, False), (False, True, True), (True, True, 2)],
)
def test_frozen_weights_and_trained_biases_in_one_unit(
    freeze_after_init: bool, ac: bool, raf: bool | int
) -> None:
    # torch's test_train_mixed_requires_grad_per_group: reductions run in backward (through
    # the post-backward autograd function), not all deferred to its end
    calls = run_on_ranks(2, _frozen_per_group, freeze_after_init, ac, raf)[0]
    assert calls >= 3 * (3 - 1)


def _frozen_across_groups(unfreeze: bool, raf: bool | int) -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(DIM, DIM), nn.ReLU()]
    model = nn.Sequential(*layers)
    reference = copy.deepcopy(model)
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, reshard_after_forward=raf)  # every linear its own root
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for m in (model, reference):
        m[0].requires_grad_(False)
    x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(0))
    mine = x.chunk(dist.get_world_size())[dist.get_rank()]
    for step in range(3):
        if unfreeze and step == 2:
            for m in (model, reference):
                m[0].requires_grad_(True)
        if step == 1:
            with torch.no_grad():
                torch.testing.assert_close(model(x).sum(), reference(x).sum())
            continue
        model(mine).sum().backward()
        (reference(x).sum() / dist.get_world_size()).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=step % 2 == 0)
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(_full(p), ref.detach())


@pytest.mark.parametrize(("unfreeze", "raf"), [(False, True), (True, False), (True, 2)])
def test_frozen_and_trained_units_interleaved(unfreeze: bool, raf: bool | int) -> None:
    # torch's test_train_mixed_requires_grad_across_groups
    run_on_ranks(2, _frozen_across_groups, unfreeze, raf)


def _world_size_one(shapes: tuple[tuple[int, int], tuple[int, int]]) -> None:
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(*shapes[0]), nn.ReLU(), nn.Linear(*shapes[1]))
    reference = copy.deepcopy(model)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    x = torch.randn(4, shapes[0][0])
    for step in range(3):
        with CommDebugMode() as comms:
            loss = model(x).sum()
            loss.backward()
        assert comms.get_total_counts() == 0  # one rank: nothing to communicate
        ref_loss = reference(x).sum()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss), step
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=step % 2 == 0)


@pytest.mark.parametrize("shapes", [((16, 15), (15, 8)), ((7, 15), (15, 3))])
def test_world_size_one_communicates_nothing_and_matches(
    shapes: tuple[tuple[int, int], tuple[int, int]],
) -> None:
    # torch's test_train_parity_single_worldsize1
    run_on_ranks(1, _world_size_one, shapes)


def _shared_and_duplicate_modules() -> tuple[int, int]:
    torch.manual_seed(0)
    mlp = MLP(DIM)
    model = nn.Sequential(mlp, mlp, MLP(DIM))  # one module twice
    model[2].in_proj.weight = model[0].in_proj.weight  # and a parameter shared across
    reference = copy.deepcopy(model)
    fully_shard(model)
    unit = fully_shard.state(model).unit
    assert unit is not None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step))
        mine = x.chunk(dist.get_world_size())[dist.get_rank()]
        model(mine).square().mean().backward()
        reference(x).square().mean().backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(_full(p), ref.detach())
    return len(unit.params), len(list(model.parameters()))


def test_shared_modules_and_parameters_are_managed_once() -> None:
    # torch's test_managed_modules_duplicate / test_managed_states_shared_params_and_buffers
    assert run_on_ranks(2, _shared_and_duplicate_modules)[0] == (7, 7)


_WITHOUT_INIT = """
import os, sys, torch
from torch import nn
import plait
m = nn.Linear(4, 4)
for env in ({}, dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])):
    os.environ.update(env)  # first bare, then as torchrun leaves it
    try:
        getattr(plait, sys.argv[1])(m)
    except RuntimeError as err:
        print("error:", err)
    else:
        m(torch.randn(2, 4)).sum().backward()
        print("trained", type(m).__name__, torch.distributed.get_world_size())
"""


@pytest.mark.parametrize("api", ["fully_shard", "replicate"])
def test_without_a_process_group_the_environment_starts_one(api: str) -> None:
    # torch's fully_shard and replicate initialise the default process group from the
    # environment (torchrun's variables) when none exists; without those variables plait
    # says what to do. One process tries both: bare, then with torchrun's variables.
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_INIT, api, str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout + out.stderr[-2000:]
    bare, torchrun = lines
    cls = "FSDPLinear" if api == "fully_shard" else "ReplicateLinear"
    assert torchrun == f"trained {cls} 1"
    assert bare.startswith(f"error: {api} needs a default process group"), bare
    assert "environment variable RANK expected" in bare and "run under torchrun" in bare
