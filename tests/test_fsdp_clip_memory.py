"""``clip_grad_norm_`` over sharded gradients, and the per-rank memory report.

Clipping must give torch's single-process total norm and clipped gradients, whatever the
gradients' layout: 1-D ``fully_shard`` shards, HSDP ``(Replicate(), Shard(0))``, plain
replicated tensors, and disjoint parameter sets across pipeline stages (``group=``).
The memory report must agree with the storages of the real tensors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from plait.fsdp import MixedPrecisionPolicy, fully_shard
from plait.fsdp.clip import clip_grad_norm_
from plait.fsdp.memory import FSDPMemoryReport, memory_report

from collective_spy import spy_collectives
from harness import run_on_ranks
from models import MLP, MLPStack, hsdp_mesh, shard_blocks
from parity import full_value, local_slice, random_batches

DIM, HIDDEN = 7, 13
CASES = [(norm, max_norm) for norm in (2.0, math.inf, 1.0) for max_norm in (0.05, 1e3)]


def _stack() -> MLPStack:
    return MLPStack(3, dim=DIM, hidden=HIDDEN)


def _shard(model: MLPStack, hsdp: bool = False) -> nn.Module:
    """Shard each block and the root, except ``head.bias``; ``hsdp``: on a 2x2 mesh."""
    root = {"ignored_params": {model.head.bias}}  # one plain grad
    return shard_blocks(model, mesh=hsdp_mesh() if hsdp else None, root_kwargs=root)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full_value(p.grad).clone() for n, p in model.named_parameters()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _chunk(t: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """Rank ``index``'s rows of ``t`` under Shard(0) (torch.chunk layout, maybe none)."""
    chunks = t.chunk(parts)
    return chunks[index].clone() if index < len(chunks) else t[:0].clone()


# --- parity with torch.nn.utils.clip_grad_norm_ --------------------------------------------


def _clip_parity(hsdp: bool) -> list[int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = random_batches(1, 8, DIM, DIM)[0]
    torch.manual_seed(0)
    reference = _stack()
    torch.manual_seed(0)
    model = _shard(_stack(), hsdp)
    placements = (Replicate(), Shard(0)) if hsdp else (Shard(0),)
    nn.functional.mse_loss(reference(x), y).backward()
    nn.functional.mse_loss(
        model(local_slice(x, rank, world)), local_slice(y, rank, world)
    ).backward()
    bias = model.head.bias.grad
    assert bias is not None and not isinstance(bias, DTensor)
    dist.all_reduce(bias)  # an ignored parameter: average it by hand, as replicate would
    bias /= world
    sharded = [p.grad for p in model.parameters() if isinstance(p.grad, DTensor)]
    assert len(sharded) == 13 and all(g.placements == placements for g in sharded)
    saved = [_local(p.grad).clone() for p in model.parameters()]
    ref_saved = [q.grad.clone() for q in reference.parameters()]
    reductions = []
    for norm_type, max_norm in CASES:
        for p, g in zip(model.parameters(), saved, strict=True):
            _local(p.grad).copy_(g)
        for q, g in zip(reference.parameters(), ref_saved, strict=True):
            q.grad.copy_(g)
        with spy_collectives("all_reduce") as calls:
            got = clip_grad_norm_(model.parameters(), max_norm, norm_type)
        reductions.append(len(calls["all_reduce"]))
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        clipped = bool(want > max_norm)
        assert clipped == (max_norm < 1)  # both regimes are exercised
        after, ref_after = _grads(model), _grads(reference)
        for name, value in ref_after.items():
            torch.testing.assert_close(after[name], value, atol=1e-7, rtol=1e-5, msg=name)
    return reductions


@pytest.mark.parametrize(
    ("world_size", "hsdp"), [(2, False), (4, False), (4, True)], ids=["2", "4", "hsdp2x2"]
)
def test_clip_grad_norm_matches_torch(world_size: int, hsdp: bool) -> None:
    reductions = run_on_ranks(world_size, _clip_parity, hsdp)[0]
    assert reductions == [1] * len(CASES)  # one all-reduce for every sharded parameter


def _meshes_and_stages() -> None:
    """HSDP, a second 1-D mesh, plain tensors and two pipeline stages, against torch."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))  # (stage, shard)
    stage, shard = mesh.get_coordinate()
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    gen = torch.Generator().manual_seed(3)
    shapes = [(5, 3), (3,), (7, 2), (1, 4), (6,)]
    full = [torch.randn(s, generator=gen) for s in shapes]  # the same on every rank

    def as_param(g: torch.Tensor, layout: str) -> nn.Parameter:
        if layout == "plain":
            grad = g.clone()
        elif layout == "hsdp":  # replicated over "rep", sharded over "shard"
            piece = _chunk(g, hsdp.get_coordinate()[1], 2)
            grad = DTensor.from_local(
                piece, hsdp, (Replicate(), Shard(0)), shape=g.shape, stride=g.stride()
            )
        else:  # 1-D shards over this stage's "dp" ranks
            piece = _chunk(g, shard, 2)
            grad = DTensor.from_local(
                piece, mesh["dp"], (Shard(0),), shape=g.shape, stride=g.stride()
            )
        p = nn.Parameter(torch.zeros_like(grad))
        p.grad = grad
        return p

    groups = {id(hsdp.get_group("shard")), id(mesh.get_group("dp"))}
    for norm_type in (2.0, math.inf):
        for max_norm in (0.1, 100.0):
            # Every rank holds all five tensors in three layouts...
            layouts = ["hsdp", "dp", "plain", "hsdp", "dp"]
            params = [as_param(g, how) for g, how in zip(full, layouts, strict=True)]
            with spy_collectives("all_reduce") as calls:
                got = clip_grad_norm_(params, max_norm, norm_type)
            assert len(calls["all_reduce"]) == len(groups)  # one per group, not per tensor
            ref = [nn.Parameter(torch.zeros_like(g)) for g in full]
            for p, g in zip(ref, full, strict=True):
                p.grad = g.clone()
            want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
            torch.testing.assert_close(got, want)
            for p, q in zip(params, ref, strict=True):
                torch.testing.assert_close(full_value(p.grad), q.grad)

            # ... and as pipeline stages: stage 0 owns tensors 0-2, stage 1 tensors 3-4.
            mine = range(3) if stage == 0 else range(3, 5)
            params = [as_param(full[i], "dp") for i in mine]
            got = clip_grad_norm_(params, max_norm, norm_type, group=mesh.get_group("pp"))
            torch.testing.assert_close(got, want)
            for i, p in zip(mine, params, strict=True):
                torch.testing.assert_close(full_value(p.grad), ref[i].grad)


def test_clip_grad_norm_hsdp_plain_and_pipeline_stages() -> None:
    run_on_ranks(4, _meshes_and_stages)


def _nonfinite() -> tuple[str, str]:
    model = _shard(_stack())
    model(torch.randn(4, DIM)).sum().backward()
    if dist.get_rank() == 1:
        model.blocks[0].in_proj.weight.grad.to_local()[0, 0] = float("nan")
    with pytest.raises(RuntimeError) as info:
        clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    total = clip_grad_norm_(model.parameters(), 1.0)  # scales by the nan norm, as torch does
    return str(info.value), str(total.item())


def test_nonfinite_norm_raises_on_every_rank() -> None:
    results = run_on_ranks(2, _nonfinite)
    assert all("non-finite" in message and total == "nan" for message, total in results)


# --- the memory report ------------------------------------------------------------------------


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _memory(mixed: bool) -> tuple[FSDPMemoryReport, dict[str, int], str]:
    world = dist.get_world_size()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mixed else None)
    model = _stack()
    model.blocks[1] = MLP(DIM, 29)  # the largest unit
    unit_bytes: dict[str, int] = {}
    for name, block in model.blocks.named_children():
        fully_shard(block, mp_policy=policy)

        def measure(module: nn.Module, args: object, name: str = name) -> None:
            unsharded = [p for p in module.parameters() if not isinstance(p, DTensor)]
            unit_bytes[f"blocks.{name}"] = _storage_bytes(unsharded)  # they share one buffer

        block.register_forward_pre_hook(measure)  # runs after the unit's unshard
    # An fp32 parameter left out of a bf16 unit would not mix with its bf16 input.
    ignored = set() if mixed else {model.head.bias}
    fully_shard(model, mp_policy=policy, ignored_params=ignored)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    before = memory_report(model, opt)
    # Shards are padded to ceil(rows / world) rows on every rank.
    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    padded = sum(-(-p.shape[0] // world) * math.prod(p.shape[1:]) * 4 for p in params)
    assert before.sharded_params == padded
    plain = sum(p.numel() * 4 for p in model.parameters() if not isinstance(p, DTensor))
    assert before.other_params == plain == (0 if mixed else DIM * 4)
    assert before.gradients == before.optimizer_state == 0

    model(torch.randn(4, DIM)).sum().backward()
    opt.step()
    report = memory_report(model, opt)
    grads = [p.grad for p in model.parameters()]
    assert report.gradients == _storage_bytes(grads)
    local = [p.to_local().numel() * 4 for p in params]
    assert report.gradients >= sum(local) + plain
    state = [v for s in opt.state.values() for v in s.values()]
    assert report.optimizer_state == _storage_bytes(state)
    n_params = len(list(model.parameters()))
    assert report.optimizer_state == 2 * (sum(local) + plain) + n_params * 4  # 2 moments, steps
    assert report.sharded_params == before.sharded_params
    assert report.persistent == (
        report.sharded_params + report.other_params + report.gradients + report.optimizer_state
    )
    return report, unit_bytes, str(report)


@pytest.mark.parametrize(
    ("world_size", "mixed"), [(2, False), (4, False), (2, True)], ids=["2", "4", "bf16"]
)
def test_memory_report_matches_the_tensors(world_size: int, mixed: bool) -> None:
    blocks_1 = (DIM * 29 + 29 + 29 * DIM + DIM) * (2 if mixed else 4)  # unsharded, gathered
    for report, measured, text in run_on_ranks(world_size, _memory, mixed):
        assert report.largest_unit_name == "blocks.1"
        assert report.largest_unit == max(measured.values()) == measured["blocks.1"] == blocks_1
        assert report.units == 4
        assert "blocks.1" in text and f"{report.gradients:,d}" in text
