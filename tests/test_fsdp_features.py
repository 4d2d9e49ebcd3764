"""``fully_shard`` features for real runs: mixed precision, CPU offload, HSDP, hpZ, meta init.

Each parallel run is compared with a single-process reference: for mixed precision the
reference does by hand the casts that fully_shard does (bf16 copies of fp32 master
weights, per-rank bf16 gradients cast to the reduce dtype and averaged).
"""

from __future__ import annotations

import copy
import importlib
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from plait.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardedState,
    fully_shard,
)

from collective_spy import spy_collectives
from harness import run_on_ranks
from models import MLPStack, hsdp_mesh, shard_blocks
from parity import check_parity, default_optimizer, full_value, local_slice, random_batches

DIM, HIDDEN = 7, 13
BF16 = torch.bfloat16


def _stack() -> MLPStack:
    return MLPStack(3, dim=DIM, hidden=HIDDEN)


# --- mixed precision ------------------------------------------------------------------------


def _reference_grads(
    master: nn.Module, micro: list[tuple[torch.Tensor, torch.Tensor]], reduce_dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], float]:
    """What fully_shard computes, by hand: every rank's bf16 gradients of its slice (summed
    over its microbatches in ``reduce_dtype``), each divided by the world and summed."""
    world = dist.get_world_size()
    grads: dict[str, torch.Tensor] = {}
    loss_sum = 0.0
    for rank in range(world):
        low = copy.deepcopy(master).to(BF16)
        per_rank: dict[str, torch.Tensor] = {}
        for inputs, targets in micro:
            out = low(local_slice(inputs, rank, world).to(BF16)).float()
            loss = nn.functional.mse_loss(out, local_slice(targets, rank, world))
            low.zero_grad()
            loss.backward()
            loss_sum += loss.item()
            for name, p in low.named_parameters():
                if p.grad is not None:
                    g = p.grad.to(reduce_dtype)
                    per_rank[name] = g if name not in per_rank else per_rank[name] + g
        for name, g in per_rank.items():
            part = (g / world).float() if reduce_dtype == torch.float32 else (g / world)
            grads[name] = part if name not in grads else grads[name] + part
    return {n: g.float() for n, g in grads.items()}, loss_sum / world / len(micro)


def _mp_parity(reduce_dtype: torch.dtype, microbatches: int, freeze_step: int | None) -> None:
    """bf16 parameters, ``reduce_dtype`` reduction, fp32 outputs, against the hand-made run."""
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype, output_dtype=None)
    torch.manual_seed(0)
    master = _stack()
    model = shard_blocks(copy.deepcopy(master), mp_policy=policy)
    ref_opt, opt = default_optimizer(master.parameters()), default_optimizer(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = random_batches(3 * microbatches, 8, DIM, DIM)
    seen_dtypes: set[torch.dtype] = set()
    model.blocks[1].register_forward_pre_hook(lambda m, _: seen_dtypes.add(m.in_proj.weight.dtype))
    for step in range(3):
        frozen = step == freeze_step
        for m in (master, model):  # freezing between steps must not change any dtype
            m.blocks[0].requires_grad_(not frozen)
        micro = batches[step * microbatches : (step + 1) * microbatches]
        want, ref_loss = _reference_grads(master, micro, reduce_dtype)
        losses = []
        with spy_collectives("reduce_scatter_single") as calls:
            for i, (inputs, targets) in enumerate(micro):
                model.set_requires_gradient_sync(i == len(micro) - 1)
                out = model(local_slice(inputs, rank, world)).float()
                loss = nn.functional.mse_loss(out, local_slice(targets, rank, world))
                loss.backward()
                losses.append(loss.detach())
        assert {dtype for dtype, _ in calls["reduce_scatter_single"]} == {reduce_dtype}
        mean_loss = torch.stack(losses).mean()
        dist.all_reduce(mean_loss)
        assert mean_loss.item() / world == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        for name, p in model.named_parameters():
            if name in want:
                assert p.grad is not None and p.grad.dtype == torch.float32, name
                torch.testing.assert_close(full_value(p.grad), want[name], msg=name)
                master.get_parameter(name).grad = want[name]
            else:
                assert p.grad is None and frozen, name
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    assert seen_dtypes == {BF16}
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name  # master weights and optimizer state stay fp32
        torch.testing.assert_close(full_value(p.detach()), master.get_parameter(name), msg=name)


@pytest.mark.parametrize("world_size", [2, 4])
def test_bf16_params_fp32_reduce_equal_hand_made_casts(world_size: int) -> None:
    run_on_ranks(world_size, _mp_parity, torch.float32, 1, None)


def test_bf16_reduce() -> None:
    run_on_ranks(2, _mp_parity, BF16, 1, None)


def test_accumulation_in_reduce_dtype_and_freezing_keep_dtypes() -> None:
    """Two microbatches accumulated in fp32 (not bf16); block 0 frozen for one step."""
    run_on_ranks(2, _mp_parity, torch.float32, 2, 1)


def _casts_inputs_and_outputs() -> tuple[str, str, str]:
    policy = MixedPrecisionPolicy(param_dtype=BF16, output_dtype=torch.float16)
    model = fully_shard(nn.Linear(4, 4), mp_policy=policy)
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(args[0].dtype))
    out = model(torch.randn(2, 4))
    no_cast = fully_shard(
        nn.Linear(4, 4), mp_policy=MixedPrecisionPolicy(param_dtype=BF16, cast_forward_inputs=False)
    )
    with pytest.raises(RuntimeError):  # fp32 input into bf16 weights: the user asked for it
        no_cast(torch.randn(2, 4))
    model.reshard()  # the root keeps its bf16 unsharded parameters until resharded
    return str(seen[0]), str(out.dtype), str(model.weight.dtype)


def test_inputs_and_outputs_are_cast() -> None:
    assert run_on_ranks(2, _casts_inputs_and_outputs)[0] == (
        "torch.bfloat16",
        "torch.float16",
        "torch.float32",
    )


class _MixedDtypes(nn.Module):
    """fp32 and fp64 layers and a frozen uint8 lookup table in one unit."""

    def __init__(self) -> None:
        super().__init__()
        self.single = nn.Linear(DIM, HIDDEN)
        self.wide = nn.Linear(HIDDEN, DIM).double()
        self.table = nn.Parameter(torch.arange(5 * DIM, dtype=torch.uint8).view(5, DIM), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.single(x)).double()
        return self.wide(h).float() + self.table[1].float() / 100


def _mixed_dtypes() -> tuple[int, list[torch.dtype]]:
    check_parity(_MixedDtypes, fully_shard, random_batches(3, 8, DIM, DIM))
    model = fully_shard(_MixedDtypes())
    with spy_collectives("all_gather_single", "reduce_scatter_single") as calls:
        model(torch.randn(4, DIM)).sum().backward()
    assert model.table.grad is None and isinstance(model.table, DTensor)
    return len(calls["all_gather_single"]), sorted(
        (d for d, _ in calls["reduce_scatter_single"]), key=str
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_mixed_dtype_unit_gathers_once_and_reduces_per_dtype(world_size: int) -> None:
    gathers, reduce_dtypes = run_on_ranks(world_size, _mixed_dtypes)[0]
    assert gathers == 1
    assert reduce_dtypes == [torch.float32, torch.float64]


# --- CPU offload ----------------------------------------------------------------------------


def _offload() -> None:
    offload = CPUOffloadPolicy(pin_memory=False)
    check_parity(
        _stack, lambda m: shard_blocks(m, offload_policy=offload), random_batches(3, 8, DIM, DIM)
    )
    torch.manual_seed(0)
    base = _stack()
    plain = shard_blocks(copy.deepcopy(base))
    moved = shard_blocks(copy.deepcopy(base), offload_policy=CPUOffloadPolicy())
    for model in (plain, moved):
        opt = default_optimizer(model.parameters())
        for inputs, targets in random_batches(3, 8, DIM, DIM):
            nn.functional.mse_loss(model(inputs), targets).backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(plain.named_parameters(), moved.parameters(), strict=True):
        assert q.device.type == "cpu" and q.to_local().device.type == "cpu"
        assert torch.equal(p.to_local(), q.to_local()), name  # bitwise: same arithmetic


@pytest.mark.parametrize("world_size", [2, 4])
def test_cpu_offload_equals_no_offload(world_size: int) -> None:
    run_on_ranks(world_size, _offload)


def _offload_on_cuda() -> None:
    """On a GPU the reduced gradients go to pinned host memory by asynchronous copies:
    each step accumulates two microbatches (the second added on the host, which must wait
    for its copy) and steps the optimizer (which must see finished copies)."""
    device = torch.device("cuda", torch.cuda.current_device())
    mesh = DeviceMesh.from_group(dist.new_group(backend="nccl"), "cuda")
    torch.manual_seed(0)
    base = _stack()
    plain = shard_blocks(copy.deepcopy(base).to(device), mesh=mesh)
    moved = shard_blocks(copy.deepcopy(base), mesh=mesh, offload_policy=CPUOffloadPolicy())
    for model in (plain, moved):
        opt = default_optimizer(model.parameters())
        for inputs, targets in random_batches(3, 8, DIM, DIM):
            for x, y in zip(inputs.chunk(2), targets.chunk(2), strict=True):
                nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(plain.named_parameters(), moved.parameters(), strict=True):
        assert q.to_local().device.type == "cpu", name
        torch.testing.assert_close(p.to_local().cpu(), q.to_local(), atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_offload_on_cuda_equals_no_offload() -> None:
    run_on_ranks(1, _offload_on_cuda)


class _Shifted(nn.Module):
    """A linear layer plus a buffer its forward reads (as rotary tables are)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.register_buffer("shift", torch.arange(DIM, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.shift


def _offload_moves_buffers() -> list[list[str]]:
    """Which modules' buffers ``fully_shard`` and ``replicate`` send to the mesh's device:
    under ``CPUOffloadPolicy`` their own (a module built on the CPU runs forward on the
    device), otherwise none (the module must be on the mesh's device already)."""
    from plait import replicate

    moved: list[list[str]] = []
    original = importlib.import_module("plait.mesh").buffers_to_mesh_device

    def record(mesh: DeviceMesh, modules: Any) -> None:
        moved.append([type(m).__name__ for m in modules])
        original(mesh, modules)

    # the modules, not the functions of the same names that plait's packages export
    users = [importlib.import_module(f"plait.{name}") for name in ("fsdp.fully_shard", "replicate")]
    for where in users:
        where.buffers_to_mesh_device = record  # type: ignore[attr-defined]
    try:
        for offload in (CPUOffloadPolicy(), None):
            model = nn.Sequential(_Shifted(), _Shifted())
            fully_shard(model[0], offload_policy=offload or OffloadPolicy())
            replicate(model[1], offload_policy=offload or OffloadPolicy())
    finally:
        for where in users:
            where.buffers_to_mesh_device = original  # type: ignore[attr-defined]
    return moved


def test_an_offloaded_unit_takes_its_buffers_to_the_mesh_device() -> None:
    assert run_on_ranks(2, _offload_moves_buffers)[0] == [["_Shifted"], ["_Shifted"]]


def _offloaded_buffers_on_cuda() -> None:
    """A module built on the CPU, offloaded: its buffer must reach the GPU (torch moves
    buffers), and replicate's broadcast of CPU parameters must pass through the GPU (NCCL
    has no CPU tensors)."""
    from plait import replicate

    device = torch.device("cuda", torch.cuda.current_device())
    mesh = DeviceMesh.from_group(dist.new_group(backend="nccl"), "cuda")
    torch.manual_seed(0)
    base = nn.Sequential(_Shifted(), _Shifted())
    want = copy.deepcopy(base).to(device)(torch.ones(2, DIM, device=device))
    sharded = shard_blocks(copy.deepcopy(base), mesh=mesh, offload_policy=CPUOffloadPolicy())
    replicated = copy.deepcopy(base)
    replicate(replicated, device_mesh=mesh, offload_policy=CPUOffloadPolicy())
    for model in (sharded, replicated):
        assert all(b.device == device for b in model.buffers())
        got = model(torch.ones(2, DIM, device=device))
        torch.testing.assert_close(got, want)
        got.sum().backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloaded_units_built_on_the_cpu_run_on_cuda_with_their_buffers() -> None:
    run_on_ranks(1, _offloaded_buffers_on_cuda)


# --- HSDP -----------------------------------------------------------------------------------


def _hsdp() -> None:
    mesh = hsdp_mesh()
    batches = random_batches(3, 8, DIM, DIM)
    check_parity(_stack, lambda m: shard_blocks(m, mesh=mesh), batches)
    torch.manual_seed(0)
    base = _stack()
    ours = shard_blocks(copy.deepcopy(base), mesh=mesh)
    theirs = copy.deepcopy(base)
    for block in theirs.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    for model in (ours, theirs):
        opt = default_optimizer(model.parameters())
        rank, world = dist.get_rank(), dist.get_world_size()
        for inputs, targets in batches:
            out = model(local_slice(inputs, rank, world))
            nn.functional.mse_loss(out, local_slice(targets, rank, world)).backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert p.placements == q.placements == (Replicate(), Shard(0)), name
        torch.testing.assert_close(p.to_local(), q.to_local(), atol=1e-6, rtol=1e-5, msg=name)


def test_hsdp_2x2_equals_one_process_and_torch() -> None:
    run_on_ranks(4, _hsdp)


def _hsdp_deferred_all_reduce() -> list[int]:
    """Microbatch 1 with the all-reduce deferred, microbatch 2 with it: equal to one
    process accumulating both."""
    mesh = hsdp_mesh()
    batches = random_batches(2, 8, DIM, DIM)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _stack()
    model = shard_blocks(copy.deepcopy(reference), mesh=mesh)
    all_reduces = []
    for i, (inputs, targets) in enumerate(batches):
        nn.functional.mse_loss(reference(inputs), targets).backward()
        model.set_requires_all_reduce(i == 1)
        with spy_collectives("all_reduce", "reduce_scatter_single") as calls:
            out = model(local_slice(inputs, rank, world))
            nn.functional.mse_loss(out, local_slice(targets, rank, world)).backward()
        assert len(calls["reduce_scatter_single"]) == 4  # the shard-group reduction still runs
        all_reduces.append(len(calls["all_reduce"]))
    for name, p in model.named_parameters():
        want = reference.get_parameter(name).grad  # both batches' gradients, summed
        torch.testing.assert_close(full_value(p.grad), want, msg=name)
    return all_reduces


def test_hsdp_set_requires_all_reduce_defers_only_the_all_reduce() -> None:
    assert run_on_ranks(4, _hsdp_deferred_all_reduce)[0] == [0, 4]


# --- partial resharding (hpZ) ---------------------------------------------------------------


@contextmanager
def _gather_group_sizes() -> Iterator[list[int]]:
    sizes: list[int] = []
    original = dist.all_gather_single

    def spy(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(dist.get_world_size(kwargs["group"]))
        return original(out, inp, *args, **kwargs)

    dist.all_gather_single = spy
    try:
        yield sizes
    finally:
        dist.all_gather_single = original


def _partial_reshard() -> tuple[list[int], list[int], bool]:
    batches = random_batches(3, 8, DIM, DIM)
    check_parity(_stack, lambda m: shard_blocks(m, reshard_after_forward=2), batches)
    model = shard_blocks(_stack(), reshard_after_forward=2)
    model(torch.randn(4, DIM)).sum().backward()  # the first step records the order
    with _gather_group_sizes() as forward:
        loss = model(torch.randn(4, DIM)).sum()
    block = model.blocks[0]
    unit = fully_shard.state(block).unit
    kept = unit.sharded_state is ShardedState.SHARDED_POST_FORWARD
    freed = block.in_proj.weight.to_local().untyped_storage().nbytes() > 0 and all(
        p.unsharded.untyped_storage().nbytes() == 0 for p in unit.params
    )
    with _gather_group_sizes() as backward:
        loss.backward()
    return forward, backward, kept and freed


def test_partial_reshard_equals_full_and_gathers_locally_in_backward() -> None:
    forward, backward, kept = run_on_ranks(4, _partial_reshard)[0]
    assert forward == [4, 4, 4, 4]  # root and three blocks, over the whole shard group
    assert backward == [2, 2, 2, 2]  # every unit re-gathers inside its pair of ranks
    assert kept


# --- meta-device initialisation -------------------------------------------------------------


def _init_weights(model: nn.Module) -> None:
    """A per-parameter init that gives the same values sharded or not (the user's job)."""
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        full = torch.randn(p.shape, generator=gen) * 0.2
        if isinstance(p, DTensor):  # each rank writes its own shard: no communication
            full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        with torch.no_grad():
            p.copy_(full)


def _meta_init() -> None:
    def deferred() -> nn.Module:
        with torch.device("meta"):
            model = _stack()
        shard_blocks(model)
        model.to_empty(device="cpu")
        _init_weights(model)
        return model

    def eager() -> nn.Module:
        model = _stack()
        _init_weights(model)
        return model

    check_parity(deferred, lambda m: m, random_batches(3, 8, DIM, DIM), build_reference=eager)
    # torch's own initialisers run on the shards too (values differ from eager: DTensor RNG)
    with torch.device("meta"):
        model = _stack()
    shard_blocks(model).to_empty(device="cpu")
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    assert all(p.to_local().abs().sum() > 0 for p in model.parameters())
    model(torch.randn(4, DIM)).sum().backward()


@pytest.mark.parametrize("world_size", [2, 4])
def test_meta_device_init_equals_eager_init(world_size: int) -> None:
    run_on_ranks(world_size, _meta_init)


def _dtype_change_after_sharding() -> None:
    """``.double()`` after fully_shard changes every parameter's dtype: the unit's gather
    layout (byte offsets, gather dtype, reduce dtype) must follow. Uneven parameters take
    the byte-offset copy path, even ones the single split-copy path."""
    for dim, hidden in [(DIM, HIDDEN), (8, 16)]:
        batches = [(x.double(), y.double()) for x, y in random_batches(3, 8, dim, dim)]
        check_parity(
            lambda dim=dim, hidden=hidden: MLPStack(3, dim=dim, hidden=hidden),
            lambda m: shard_blocks(m).double(),
            batches,
            build_reference=lambda dim=dim, hidden=hidden: MLPStack(3, dim, hidden).double(),
        )


@pytest.mark.parametrize("world_size", [2, 4])
def test_dtype_change_after_fully_shard_equals_one_process(world_size: int) -> None:
    run_on_ranks(world_size, _dtype_change_after_sharding)


def _uninitialised() -> str:
    with torch.device("meta"):
        model = _stack()
    shard_blocks(model)
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, DIM))
    return str(info.value)


def test_meta_parameters_at_first_forward_are_listed() -> None:
    message = run_on_ranks(2, _uninitialised)[0]
    assert "still on the meta device" in message and "to_empty" in message
