"""``plait.replicate``: parity with one process and with torch's DDP, accumulation, errors."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from plait import contract, fully_shard
from plait.replicate import ReplicateModule, replicate

from collective_spy import spy_collectives
from harness import run_on_ranks
from models import MLP, MLPStack
from parity import check_parity, local_slice, random_batches, train_local

WORLD_SIZES = [2, 4]


@contextlib.contextmanager
def recorded_all_reduces() -> Iterator[list[tuple[torch.dtype, int]]]:
    """Record (dtype, numel) of every ``dist.all_reduce`` issued inside the block."""
    with spy_collectives("all_reduce") as calls:
        yield calls["all_reduce"]


def _assert_same_params(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-5, msg=f"parameter {name}")


# --- parity -----------------------------------------------------------------------------


def _parity_with_reference_and_ddp(bucket_cap_mb: float) -> int:
    batches = random_batches(5, 16, 8, 8)
    check_parity(lambda: MLPStack(4), lambda m: replicate(m, bucket_cap_mb=bucket_cap_mb), batches)

    torch.manual_seed(dist.get_rank())  # replicate must broadcast rank 0's init anyway
    base = MLPStack(4)
    ours = replicate(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
    theirs = DDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
    our_losses = train_local(ours, batches)
    their_losses = train_local(theirs, batches)
    assert our_losses == pytest.approx(their_losses, abs=1e-6)
    _assert_same_params(ours, theirs.module)
    return len(replicate.state(ours).buckets)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parity_with_single_process_and_torch_ddp(world_size: int) -> None:
    run_on_ranks(world_size, _parity_with_reference_and_ddp, 25)


def test_parity_with_many_small_buckets() -> None:
    # a cap below one parameter's size puts (almost) every parameter in its own bucket
    buckets = run_on_ranks(2, _parity_with_reference_and_ddp, 1e-4)
    assert buckets[0] >= 10


def _replicas_start_equal() -> list[float]:
    torch.manual_seed(100 + dist.get_rank())  # deliberately different initialisations
    model = MLPStack(2)
    model.register_buffer("counter", torch.full((3,), float(dist.get_rank())))
    replicate(model)
    return [p.sum().item() for p in model.parameters()] + model.counter.tolist()


def test_rank0_parameters_and_buffers_are_broadcast_at_apply_time() -> None:
    values = run_on_ranks(4, _replicas_start_equal)
    assert all(v == values[0] for v in values)
    assert values[0][-3:] == [0.0, 0.0, 0.0]


def _from_the_meta_device(model: MLPStack) -> MLPStack:
    """``model``'s values in a copy built on the meta device, replicated there (nothing to
    broadcast yet), then given storage and, on every rank alike, its values."""
    with torch.device("meta"):
        meta = MLPStack(2)
    with spy_collectives("broadcast") as calls:
        replicate(meta)
    assert calls["broadcast"] == []
    meta.to_empty(device="cpu")
    with torch.no_grad():
        for p, value in zip(meta.parameters(), model.parameters(), strict=True):
            p.copy_(value)
    return meta


def _parity_from_the_meta_device() -> None:
    check_parity(lambda: MLPStack(2), _from_the_meta_device, random_batches(3, 8, 8, 8))


def test_a_meta_module_is_replicated_then_materialized() -> None:
    run_on_ranks(2, _parity_from_the_meta_device)


# --- unused and frozen parameters ------------------------------------------------------


class WithDeadBranch(nn.Module):
    """A model with a branch no rank ever uses (its grads must stay None)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLPStack(2)
        self.dead = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _parity_with_unused_branch() -> None:
    check_parity(
        WithDeadBranch, lambda m: replicate(m, bucket_cap_mb=1e-4), random_batches(4, 8, 8, 8)
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_globally_unused_parameters_keep_no_gradient(world_size: int) -> None:
    run_on_ranks(world_size, _parity_with_unused_branch)


class RankDependentBranch(nn.Module):
    """Each rank takes a different branch: gradients of both must still be averaged."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.even = nn.Linear(8, 8)
        self.odd = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = self.even if dist.get_rank() % 2 == 0 else self.odd
        return branch(torch.relu(self.stem(x)))


def _branch_per_rank_matches_ddp() -> None:
    batches = random_batches(4, 8, 8, 8)
    base = RankDependentBranch()
    ours = replicate(copy.deepcopy(base), bucket_cap_mb=1e-4)
    theirs = DDP(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=1e-4)
    train_local(ours, batches)
    train_local(theirs, batches)
    _assert_same_params(ours, theirs.module)


def test_branch_taken_by_some_ranks_matches_torch_ddp() -> None:
    run_on_ranks(2, _branch_per_rank_matches_ddp)


def _freeze_stem(model: MLPStack) -> MLPStack:
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    return model


def _parity_with_frozen_params() -> int:
    with recorded_all_reduces() as calls:
        check_parity(
            lambda: _freeze_stem(MLPStack(3)), lambda m: replicate(m), random_batches(3, 8, 8, 8)
        )
    trainable = [p for p in _freeze_stem(MLPStack(3)).parameters() if p.requires_grad]
    # check_parity all-reduces one loss per step; the rest are the gradient buckets
    grad_numel = sum(n for _, n in calls if n > 1)
    expected = 3 * (sum(p.numel() for p in trainable) + len(trainable))
    assert grad_numel == expected, "frozen parameters must not be reduced"
    return grad_numel


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_frozen_parameters_are_skipped(world_size: int) -> None:
    run_on_ranks(world_size, _parity_with_frozen_params)


# --- gradient accumulation ---------------------------------------------------------------


def _accumulate_over_microbatches(use_context: bool) -> list[int]:
    counts: list[int] = []

    def step(model: nn.Module, inputs, targets, loss_fn) -> torch.Tensor:
        total = torch.zeros(())
        micro = list(zip(inputs.chunk(4), targets.chunk(4), strict=True))
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            sync: Callable[[], Any]
            if isinstance(model, ReplicateModule):
                if use_context:
                    sync = contextlib.nullcontext if last else model.no_sync
                else:
                    model.set_requires_gradient_sync(last)
                    sync = contextlib.nullcontext
            else:
                sync = contextlib.nullcontext
            with recorded_all_reduces() as calls, sync():
                loss = loss_fn(model(x), y) / len(micro)
                loss.backward()
            if isinstance(model, ReplicateModule):
                counts.append(len(calls))
            total += loss.detach()
        return total

    check_parity(
        lambda: MLPStack(3),
        lambda m: replicate(m, bucket_cap_mb=1e-3),
        random_batches(3, 32, 8, 8),
        step=step,
    )
    model = replicate(MLPStack(3), bucket_cap_mb=1e-3)
    return [len(replicate.state(model).buckets), *counts]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    "use_context", [False, True], ids=["set_requires_gradient_sync", "no_sync"]
)
def test_gradient_accumulation_reduces_once_per_synced_step(
    world_size: int, use_context: bool
) -> None:
    result = run_on_ranks(world_size, _accumulate_over_microbatches, use_context)[0]
    n_buckets, counts = result[0], result[1:]
    assert n_buckets > 1
    # 3 steps x 4 microbatches: no collective in the first three, one per bucket in the last
    assert counts == [0, 0, 0, n_buckets] * 3


# --- reduce dtype --------------------------------------------------------------------------


def _parity_with_bf16_reduce() -> list[torch.dtype]:
    with recorded_all_reduces() as calls:
        check_parity(
            lambda: MLPStack(3),
            lambda m: replicate(m, reduce_dtype=torch.bfloat16),
            random_batches(3, 16, 8, 8),
            atol=2e-2,
            rtol=2e-2,
        )
    return sorted({dtype for dtype, n in calls if n > 1}, key=str)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_dtype_is_used_for_the_all_reduce(world_size: int) -> None:
    dtypes = run_on_ranks(world_size, _parity_with_bf16_reduce)[0]
    assert dtypes == [torch.bfloat16]


def _bf16_grads_equal_hand_computed() -> float:
    # Hand-computed oracle: each rank's local gradient cast to bf16, divided by the world
    # size in bf16, summed in fp32 over ranks (exact for two bf16 addends) and cast back.
    torch.manual_seed(0)
    model = replicate(MLP(8, 16), reduce_dtype=torch.bfloat16)
    reference = MLP(8, 16)
    reference.load_state_dict(model.state_dict())
    inputs, targets = random_batches(1, 8, 8, 8)[0]
    nn.functional.mse_loss(
        model(local_slice(inputs, dist.get_rank(), 2)), local_slice(targets, dist.get_rank(), 2)
    ).backward()
    expected: dict[str, torch.Tensor] = {}
    for rank in range(2):
        reference.zero_grad()
        nn.functional.mse_loss(
            reference(local_slice(inputs, rank, 2)), local_slice(targets, rank, 2)
        ).backward()
        for name, p in reference.named_parameters():
            piece = (p.grad.to(torch.bfloat16) / 2).float()
            expected[name] = expected.get(name, torch.zeros_like(piece)) + piece
    worst = 0.0
    for name, p in model.named_parameters():
        want = expected[name].to(torch.bfloat16).float()
        worst = max(worst, (p.grad - want).abs().max().item())
    return worst


def test_bf16_reduce_matches_hand_computed_gradients() -> None:
    assert run_on_ranks(2, _bf16_grads_equal_hand_computed) == [0.0, 0.0]


# --- overlap -------------------------------------------------------------------------------


def _all_reduces_of_one_backward() -> tuple[list[int], int]:
    """(all-reduces issued before each run of the backward's last compute, all-reduces)."""
    model = MLPStack(6, dim=64, hidden=256)
    replicate(model, bucket_cap_mb=0.1)
    with recorded_all_reduces() as calls:
        before_last_compute: list[int] = []
        # the first block's input gradient is the last piece of compute of the backward
        model.blocks[0].in_proj.register_full_backward_hook(
            lambda *_: before_last_compute.append(len(calls))
        )
        x = torch.randn(4, 64, requires_grad=True)
        model(x).sum().backward()
    return before_last_compute, len(calls)


def test_early_buckets_are_reduced_while_backward_still_runs() -> None:
    before_last_compute, total = run_on_ranks(2, _all_reduces_of_one_backward)[0]
    assert total > 2
    assert before_last_compute, "the last compute never ran"
    launched_early = before_last_compute[0]
    assert launched_early > 0  # the first all-reduce comes before the last compute
    assert launched_early >= total - 1


# --- behaviour and errors -----------------------------------------------------------------


def _state_and_class() -> tuple[bool, list[str], bool]:
    model = MLPStack(2)
    names = [n for n, _ in model.named_parameters()]
    replicate(model)
    ok_names = [n for n, _ in model.named_parameters()] == names
    registry = contract.get_registry(model)
    assert registry is not None
    return (
        isinstance(model, ReplicateModule) and isinstance(model, MLPStack),
        list(registry),
        ok_names,
    )


def test_module_keeps_names_and_gains_the_replicate_methods() -> None:
    is_both, registry, ok_names = run_on_ranks(2, _state_and_class)[0]
    assert is_both and registry == ["replicate"] and ok_names


def _errors() -> list[str]:
    messages = []
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))

    @contract()
    def fully_shard(module: nn.Module) -> nn.Module:  # stands in for plait's fully_shard
        return module

    sharded = MLPStack(2)
    fully_shard(sharded)
    cpu_model = MLP()
    cases: list[tuple[type[Exception], Callable[[], Any]]] = [
        (ValueError, lambda: replicate(MLP(), mesh=mesh_2d)),
        (TypeError, lambda: replicate(MLP(), mesh="dp")),
        (TypeError, lambda: replicate(MLP(), bucket_cap_mb="25")),
        (ValueError, lambda: replicate(MLP(), bucket_cap_mb=0)),
        (TypeError, lambda: replicate(MLP(), reduce_dtype=torch.int32)),
        (TypeError, lambda: replicate("model")),
        (RuntimeError, lambda: replicate(sharded)),
        (RuntimeError, lambda: replicate(MLP(), device_id=[torch.device("cpu")])),
        (ValueError, lambda: replicate(cpu_model, device_id=torch.device("cuda", 0))),
        (ValueError, lambda: replicate(MLP(), mesh=mesh_2d["dp"], device_mesh=mesh_2d["pp"])),
        (TypeError, lambda: replicate(MLP(), gradient_as_bucket_view="yes")),
    ]
    for kind, call in cases:
        with pytest.raises(kind) as info:
            call()
        messages.append(str(info.value))
    model = replicate(MLP())
    with pytest.raises(AssertionError, match="replicate has already been applied"):
        replicate(model)
    # the 2-D mesh's named dimension is a valid data-parallel group
    replicate(MLP(), mesh=mesh_2d["dp"])
    return messages


def test_bad_arguments_are_clear_errors() -> None:
    messages = run_on_ranks(4, _errors)[0]
    assert "needs a 1-D mesh" in messages[0] and 'mesh["dp"]' in messages[0]
    assert "DeviceMesh" in messages[1]
    assert "bucket_cap_mb must be a number" in messages[2]
    assert "must be positive" in messages[3]
    assert "reduce_dtype" in messages[4]
    assert "expects an nn.Module" in messages[5]
    assert "MLPStack: it is already managed by fully_shard" in messages[6]
    assert "Expected device_id to be int or torch.device" in messages[7]
    assert "parameter 'in_proj.weight' of MLP is on cpu" in messages[8]
    assert "mesh= or device_mesh=, not both" in messages[9]
    assert "gradient_as_bucket_view must be a bool" in messages[10]


def _recovers_after_failed_backward() -> None:
    model = replicate(MLPStack(2), bucket_cap_mb=1e-4)
    out = model(torch.randn(4, 8))

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("backward failed")

    # the first block's weight gradient comes last, after some buckets were launched
    handle = model.blocks[0].in_proj.weight.register_hook(fail)
    with pytest.raises(ValueError, match="backward failed"):
        out.sum().backward()
    assert replicate.state(model).in_backward  # the end-of-backward callback never ran
    handle.remove()
    model.zero_grad()
    x = local_slice(torch.randn(8, 8), dist.get_rank(), 2)
    model(x).sum().backward()
    assert not replicate.state(model).in_backward
    grads = [p.grad.clone() for p in model.parameters()]
    gathered = [torch.cat([g.flatten() for g in grads]) for _ in range(2)]
    dist.all_gather(gathered, torch.cat([g.flatten() for g in grads]))
    assert torch.equal(gathered[0], gathered[1]), "gradients were not averaged"


def test_failed_backward_leaves_no_stale_state() -> None:
    run_on_ranks(2, _recovers_after_failed_backward)


# --- torch's keywords -------------------------------------------------------------------


class ScaledMLP(MLP):
    """Takes a keyword argument that is a tensor needing grad, and one that is not a tensor."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, *, scale: torch.Tensor, square: bool = False
    ) -> torch.Tensor:
        out = super().forward(x) * scale
        return out * out if square else out


class _WithScale(nn.Module):
    """Owns the ``scale`` parameter and passes it to the replicated module as a keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.body = ScaledMLP()
        self.scale = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x, scale=self.scale, square=True)


def _parity_with_torch_keywords() -> int:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))

    def parallelize(model: _WithScale) -> _WithScale:
        # torchtitan's call (device_mesh=, bucket_cap_mb=) plus DDP's switches and device_id
        replicate(
            model,
            device_mesh=mesh,
            bucket_cap_mb=1e-4,
            gradient_as_bucket_view=True,
            find_unused_parameters=False,
            static_graph=True,
            broadcast_buffers=False,
            device_id=torch.device("cpu"),
        )
        return model

    check_parity(_WithScale, parallelize, random_batches(3, 8, 8, 8))
    model = parallelize(_WithScale())
    return len(replicate.state(model).buckets)


def test_torch_keywords_and_forward_keywords() -> None:
    buckets = run_on_ranks(2, _parity_with_torch_keywords)
    assert buckets[0] == 5  # bucket_cap_mb reached plait's buckets: one per parameter


def _ignored_modules_are_not_synced() -> tuple[bool, bool]:
    model = MLPStack(2)
    replicate(model, [model.blocks[0]])
    torch.manual_seed(dist.get_rank())  # a different batch on each rank
    model(torch.randn(4, 8)).sum().backward()

    def same_on_all_ranks(t: torch.Tensor) -> bool:
        gathered = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(gathered, t)
        return torch.equal(gathered[0], gathered[1])

    ignored = same_on_all_ranks(model.blocks[0].in_proj.weight.grad)
    synced = all(same_on_all_ranks(p.grad) for p in model.blocks[1].parameters())
    return ignored, synced


def test_ignored_modules_keep_their_local_gradients() -> None:
    ignored_same, synced_same = run_on_ranks(2, _ignored_modules_are_not_synced)[0]
    assert not ignored_same and synced_same


# --- replicate around fully_shard -------------------------------------------------------


def _shard_blocks_then_replicate(model: MLPStack) -> MLPStack:
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    replicate(model, device_mesh=mesh)
    return model


def _replicate_around_fully_shard() -> list[int]:
    with recorded_all_reduces() as calls:
        check_parity(lambda: MLPStack(3), _shard_blocks_then_replicate, random_batches(3, 8, 8, 8))
    model = _shard_blocks_then_replicate(MLPStack(3))
    bucketed = [p for b in replicate.state(model).buckets for p in b.params]
    assert bucketed == [model.head.bias, model.head.weight]  # only what fully_shard left
    return [n for _, n in calls]


def test_replicate_of_a_parent_whose_blocks_are_fully_shard_ed() -> None:
    reduced = run_on_ranks(2, _replicate_around_fully_shard)[0]
    head = 8 * 8 + 8
    # per step: the head's gradients plus one count per parameter, and check_parity's loss
    assert reduced == [head + 2, 1] * 3


def _nested_replicate() -> list[int]:
    def parallelize(model: MLPStack) -> MLPStack:
        replicate(model.blocks[0])
        return replicate(model)

    with recorded_all_reduces() as calls:
        check_parity(lambda: MLPStack(2), parallelize, random_batches(2, 8, 8, 8))
    return [n for _, n in calls]


def test_nested_replicate_reduces_each_parameter_once() -> None:
    reduced = run_on_ranks(2, _nested_replicate)[0]
    block = 8 * 16 + 16 + 16 * 8 + 8  # one MLP block's parameters
    rest = block + 8 * 8 + 8  # the other block and the head
    # per step: the inner replicate's bucket, the outer one's, check_parity's loss
    assert sorted(reduced) == sorted([block + 4, rest + 6, 1] * 2)


def _reducing_api_after_replicate(api_name: str) -> str:
    model = replicate(MLPStack(2))
    {"fully_shard": fully_shard, "replicate": replicate}[api_name](model.blocks[1])
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 8))
    return str(info.value)


@pytest.mark.parametrize("api_name", ["fully_shard", "replicate"])
def test_api_inside_after_replicate_is_refused_at_first_forward(api_name: str) -> None:
    message = run_on_ranks(2, _reducing_api_after_replicate, api_name)[0]
    assert f"{api_name} was applied to 'blocks.1'" in message
    assert f"Apply {api_name} to the submodules first" in message


def _inputs_follow_device_id() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model = ScaledMLP().to(device)
    replicate(model, device_mesh=init_device_mesh("cuda", (1,)), device_id=device.index)
    # CPU inputs, positional and keyword, are moved to the device first (as DDP does)
    out = model(torch.randn(2, 8), scale=torch.ones(8))
    assert out.device == device
    out.sum().backward()
    assert all(p.grad is not None and p.grad.device == device for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_id_moves_tensor_inputs_to_the_device() -> None:
    run_on_ranks(1, _inputs_follow_device_id)


def _swapped_to_float64_body(wrap: str) -> list[str]:
    # module.to(dtype) under torch's swap-tensors mode (torch.utils.swap_tensors for every
    # parameter) after replicate or fully_shard, then a training step beside a float64
    # reference: torch refuses to swap a tensor that has weak references, and replicate's
    # parameters are the module's own (upstream's test_to_float64_after_init).
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model = copy.deepcopy(ref)
    apply: Callable[..., Any] = replicate if wrap == "replicate" else fully_shard
    for module in (model[0], model[1], model):
        apply(module)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    ref.to(torch.float64)
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(3, 4, dtype=torch.float64)
    model(x).sum().backward()
    ref(x).sum().backward()
    problems = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert q.grad is not None
        dist.all_reduce(q.grad)
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if p.dtype != torch.float64 or got is None or not torch.allclose(got, q.grad / 2):
            problems.append(f"{name}: {p.dtype}, gradient differs")
    return problems


@pytest.mark.parametrize("wrap", ["replicate", "fully_shard"])
def test_to_dtype_with_swapped_parameters(wrap: str) -> None:
    assert run_on_ranks(2, _swapped_to_float64_body, wrap) == [[], []]
