"""``plait.fsdp.fully_shard``: parity with one process and with torch, layout, schedule, errors."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from plait.fsdp import FSDPModule, ShardedState, fully_shard, register_fsdp_forward_method
from plait.train.model import GPT, GPTConfig, lm_loss

from collective_spy import spy_collectives
from harness import run_on_ranks
from models import MLP, MLPStack
from parity import (
    check_parity,
    default_step,
    full_value,
    local_slice,
    random_batches,
    train_local,
)

WORLD_SIZES = [2, 4]
# Dimensions that do not divide by 2 or 4; the 3-row bias is smaller than 4 ranks.
DIM, HIDDEN = 7, 13


# --- wrapping recipes shared by parity tests ---------------------------------------------


def wrap_blocks(
    shard: Callable[..., Any], raf: bool | None = None
) -> Callable[[nn.Module], nn.Module]:
    def apply(model: nn.Module) -> nn.Module:
        for block in model.blocks:
            shard(block, reshard_after_forward=raf)
        shard(model, reshard_after_forward=raf)
        return model

    return apply


def wrap_every_leaf(shard: Callable[..., Any]) -> Callable[[nn.Module], nn.Module]:
    def apply(model: nn.Module) -> nn.Module:
        for module in list(model.modules())[1:]:
            if isinstance(module, nn.Linear):
                shard(module)
        shard(model)
        return model

    return apply


def _stack() -> MLPStack:
    return MLPStack(3, dim=DIM, hidden=HIDDEN)


def _batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return random_batches(steps, 8, DIM, DIM)


def _assert_same_local_shards(ours: nn.Module, theirs: nn.Module) -> None:
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert isinstance(p, DTensor) and isinstance(q, DTensor), name
        assert p.placements == q.placements == (Shard(0),), name
        torch.testing.assert_close(p.to_local(), q.to_local(), atol=1e-6, rtol=1e-5, msg=name)


# --- parity --------------------------------------------------------------------------------


def _parity_nested(raf: bool | None) -> None:
    check_parity(_stack, wrap_blocks(fully_shard, raf), _batches())
    base = _stack()
    ours = wrap_blocks(fully_shard, raf)(copy.deepcopy(base))
    theirs = wrap_blocks(torch_fully_shard, raf)(copy.deepcopy(base))
    assert train_local(ours, _batches()) == pytest.approx(train_local(theirs, _batches()), abs=1e-6)
    _assert_same_local_shards(ours, theirs)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("raf", [None, True, False])
def test_nested_model_parity(world_size: int, raf: bool | None) -> None:
    run_on_ranks(world_size, _parity_nested, raf)


def _parity_every_leaf() -> None:
    check_parity(_stack, wrap_every_leaf(fully_shard), _batches())
    base = _stack()
    ours = wrap_every_leaf(fully_shard)(copy.deepcopy(base))
    theirs = wrap_every_leaf(torch_fully_shard)(copy.deepcopy(base))
    train_local(ours, _batches())
    train_local(theirs, _batches())
    _assert_same_local_shards(ours, theirs)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_leaf_wrapped_parity(world_size: int) -> None:
    run_on_ranks(world_size, _parity_every_leaf)


TIED = GPTConfig(vocab_size=31, seq_len=6, n_layer=2, n_head=2, d_model=10, tie_weights=True)


def _tied_transformer() -> None:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TIED.vocab_size, (8, TIED.seq_len + 1), generator=gen)
    # One batch three times: its loss falls whatever the initial weights (on fresh random
    # tokens every loss stays near ln 31, and whether the last fell below the first was luck).
    batches = [(tokens[:, :-1], tokens[:, 1:])] * 3
    # Adam normalises tiny gradients, so rounding differences of the reduction show at 1e-6
    report = check_parity(
        lambda: GPT(TIED), wrap_blocks(fully_shard), batches, loss_fn=lm_loss, atol=2e-5
    )
    assert report.parallel_losses[-1] < report.parallel_losses[0]
    model = wrap_blocks(fully_shard)(GPT(TIED))
    assert model.head.weight is model.tok_emb.weight  # still tied, as one sharded parameter


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_transformer_with_tied_weights_in_one_unit(world_size: int) -> None:
    run_on_ranks(world_size, _tied_transformer)


def _delayed_optimizer_step() -> None:
    # two backwards (each reducing) per optimizer step: sharded gradients accumulate
    base = _stack()
    ours = wrap_blocks(fully_shard)(copy.deepcopy(base))
    theirs = wrap_blocks(torch_fully_shard)(copy.deepcopy(base))
    train_local(ours, _batches(4), steps_per_opt=2)
    train_local(theirs, _batches(4), steps_per_opt=2)
    _assert_same_local_shards(ours, theirs)
    reference = copy.deepcopy(base)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for i, (x, y) in enumerate(_batches(4)):
        nn.functional.mse_loss(reference(x), y).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    for (name, p), (_, q) in zip(
        ours.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(full_value(p), q, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_delayed_optimizer_step(world_size: int) -> None:
    run_on_ranks(world_size, _delayed_optimizer_step)


@contextlib.contextmanager
def count_collectives() -> Iterator[dict[str, int]]:
    """Count the unit collectives issued inside the block (read the dict after it ends)."""
    names = ("all_gather_single", "reduce_scatter_single")
    counts = dict.fromkeys(names, 0)
    with spy_collectives(*names) as calls:
        yield counts
    counts.update({name: len(calls[name]) for name in names})


def _delayed_reduce_scatter(k: int) -> list[int]:
    reduce_counts = []

    def step(model: nn.Module, inputs, targets, loss_fn) -> torch.Tensor:
        total = torch.zeros(())
        micro = list(zip(inputs.chunk(k + 1), targets.chunk(k + 1), strict=True))
        for i, (x, y) in enumerate(micro):
            if isinstance(model, FSDPModule):
                model.set_requires_gradient_sync(i == len(micro) - 1)
            with count_collectives() as counts:
                loss = loss_fn(model(x), y) / len(micro)
                loss.backward()
            if isinstance(model, FSDPModule):
                reduce_counts.append(counts["reduce_scatter_single"])
            total += loss.detach()
        return total

    check_parity(
        _stack, wrap_blocks(fully_shard), random_batches(2, 8 * (k + 1), DIM, DIM), step=step
    )
    return reduce_counts


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_delayed_reduce_scatter(world_size: int) -> None:
    counts = run_on_ranks(world_size, _delayed_reduce_scatter, 2)[0]
    assert counts == [0, 0, 4] * 2  # 4 units: 3 blocks + root, reduced only when sync is on


def _uneven_sizes() -> list[tuple[int, ...]]:
    model = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 1))  # rows 3, 3, 1, 1
    check_parity(
        lambda: nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 1)),
        lambda m: fully_shard(m),
        random_batches(3, 8, 5, 1),
    )
    fully_shard(model)
    return [tuple(p.to_local().shape) for p in model.parameters()]


def test_parameters_smaller_than_the_world_have_empty_shards() -> None:
    shapes = run_on_ranks(4, _uneven_sizes)
    assert shapes[0] == [(1, 5), (1,), (1, 3), (1,)]
    assert shapes[3] == [(0, 5), (0,), (0, 3), (0,)]  # torch.chunk leaves the last rank empty
    assert shapes[2] == [(1, 5), (1,), (0, 3), (0,)]


class MixtureOfExperts(nn.Module):
    """A shared trunk sharded over all ranks and one expert per rank, private to it."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = MLP(DIM, HIDDEN)
        torch.manual_seed(100 + dist.get_rank())  # every rank's expert differs
        self.expert = MLP(DIM, HIDDEN)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.expert(torch.relu(self.trunk(x))))


def _moe_wrap(shard: Callable[..., Any], own: DeviceMesh) -> Callable[[nn.Module], nn.Module]:
    def apply(model: nn.Module) -> nn.Module:
        shard(model.expert, mesh=own)  # a mesh of this rank alone: never communicates
        shard(model.trunk)
        shard(model)
        return model

    return apply


def _mixture_of_experts() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    own = None
    for r in range(world):  # every rank takes part in creating every group
        group = dist.new_group([r])
        if r == rank:
            own = DeviceMesh.from_group(group, "cpu")
    assert own is not None
    torch.manual_seed(0)
    base = MixtureOfExperts()
    ours = _moe_wrap(fully_shard, own)(copy.deepcopy(base))
    theirs = _moe_wrap(torch_fully_shard, own)(copy.deepcopy(base))
    train_local(ours, _batches())
    train_local(theirs, _batches())
    _assert_same_local_shards(ours, theirs)
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, ours.expert.in_proj.weight.to_local().sum().reshape(1))
    assert len({g.item() for g in gathered}) == world  # experts stayed different


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_mixture_of_experts_with_per_rank_experts(world_size: int) -> None:
    run_on_ranks(world_size, _mixture_of_experts)


# --- layout: shards, placements, sharded vs unsharded --------------------------------------


def _layout_each_step() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _stack()
    model = wrap_blocks(fully_shard)(copy.deepcopy(reference))
    seen_inside: list[bool] = []
    model.blocks[1].in_proj.register_forward_pre_hook(
        lambda m, args: seen_inside.append(
            type(m.weight) is nn.Parameter and not isinstance(m.weight, DTensor)
        )
    )
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _batches():
        for m, o, inp, tgt in (
            (reference, ref_opt, x, y),
            (model, opt, local_slice(x, rank, world), local_slice(y, rank, world)),
        ):
            nn.functional.mse_loss(m(inp), tgt).backward()
            o.step()
            o.zero_grad()
        for (name, p), (_, q) in zip(
            model.named_parameters(), reference.named_parameters(), strict=True
        ):
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
            assert p.device_mesh.size() == world
            assert p.shape == q.shape
            expected = q.detach().chunk(world)[rank] if rank < len(q.chunk(world)) else q[:0]
            torch.testing.assert_close(p.to_local(), expected, atol=1e-6, rtol=1e-5, msg=name)
    assert seen_inside == [True] * 3


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_local_shards_match_reference_slices_after_each_step(world_size: int) -> None:
    run_on_ranks(world_size, _layout_each_step)


def _grads_are_dtensors_and_state_dict_shares_storage() -> None:
    model = wrap_blocks(fully_shard)(_stack())
    x = torch.randn(4, DIM)
    model(x).sum().backward()
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor) and p.grad.placements == (Shard(0),), name
        assert p.grad.shape == p.shape
    state = model.state_dict()
    for name, p in model.named_parameters():
        value = state[name]
        assert isinstance(value, DTensor)
        assert value.to_local().data_ptr() == p.to_local().data_ptr(), name


def test_gradients_are_sharded_and_state_dict_shares_storage() -> None:
    run_on_ranks(2, _grads_are_dtensors_and_state_dict_shares_storage)


# --- collective counts ----------------------------------------------------------------------


def _collectives_per_step(raf: bool | None) -> tuple[int, int, int, int]:
    model = wrap_blocks(fully_shard, raf)(_stack())
    x = torch.randn(4, DIM)
    model(x).sum().backward()  # first step records the order
    with count_collectives() as fwd:
        out = model(x)
    with count_collectives() as bwd:
        out.sum().backward()
    return (
        fwd["all_gather_single"],
        bwd["all_gather_single"],
        fwd["reduce_scatter_single"],
        bwd["reduce_scatter_single"],
    )


@pytest.mark.parametrize(
    ("raf", "expected"),
    [
        # 4 units (3 blocks + root). The root keeps its parameters after forward by default.
        (None, (4, 3, 0, 4)),
        (True, (4, 4, 0, 4)),
        (False, (4, 0, 0, 4)),
    ],
)
def test_collectives_per_unit_per_step(raf: bool | None, expected: tuple[int, ...]) -> None:
    assert run_on_ranks(2, _collectives_per_step, raf)[0] == expected


def _no_grad_forward() -> tuple[int, list[bool]]:
    model = wrap_blocks(fully_shard, False)(_stack())
    with count_collectives() as counts, torch.no_grad():
        model(torch.randn(4, DIM))
        model(torch.randn(4, DIM))
    states = [
        fully_shard.state(m).unit.sharded_state is ShardedState.SHARDED
        for m in [*model.blocks, model]
    ]
    return counts["all_gather_single"], states


def test_no_grad_forward_reshards_everything_and_registers_no_backward() -> None:
    gathers, all_sharded = run_on_ranks(2, _no_grad_forward)[0]
    assert gathers == 8  # 4 units x 2 forwards: even reshard_after_forward=False reshards
    assert all(all_sharded)


# --- behaviours -------------------------------------------------------------------------------


def _several_forwards_one_backward() -> None:
    def step(model: nn.Module, inputs, targets, loss_fn) -> torch.Tensor:
        half = inputs.shape[0] // 2
        loss = (
            loss_fn(model(inputs[:half]), targets[:half])
            + loss_fn(model(inputs[half:]), targets[half:])
        ) / 2
        loss.backward()
        return loss.detach()

    check_parity(_stack, wrap_blocks(fully_shard), _batches(), step=step)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_several_forwards_before_one_backward(world_size: int) -> None:
    run_on_ranks(world_size, _several_forwards_one_backward)


def _non_root_alone() -> None:
    # a unit used on its own (before any parent runs) is its own root
    check_parity(lambda: MLP(DIM, HIDDEN), lambda m: fully_shard(m), _batches())


def test_forward_through_a_non_root_unit_alone() -> None:
    run_on_ranks(2, _non_root_alone)


def _edit(model: nn.Module) -> nn.Module:
    torch.manual_seed(5)
    model.head.weight = nn.Parameter(torch.randn(DIM, DIM))  # replaced
    with torch.no_grad():
        model.blocks[0].in_proj.bias.fill_(0.5)  # modified in place
    return model


def _param_replaced_after_fully_shard() -> None:
    check_parity(
        _stack,
        lambda m: _edit(wrap_blocks(fully_shard)(m)),  # edits land on the sharded model
        _batches(),
        build_reference=lambda: _edit(_stack()),
    )


def test_parameter_modified_or_replaced_before_first_forward() -> None:
    run_on_ranks(2, _param_replaced_after_fully_shard)


def _frozen_mixed_with_trainable() -> list[bool]:
    def build() -> nn.Module:
        model = _stack()
        model.blocks[1].in_proj.weight.requires_grad_(False)
        return model

    check_parity(build, wrap_blocks(fully_shard), _batches())
    model = wrap_blocks(fully_shard)(build())
    model(torch.randn(4, DIM)).sum().backward()
    return [p.grad is None for p in model.blocks[1].parameters()]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_frozen_and_trainable_parameters_in_one_unit(world_size: int) -> None:
    assert run_on_ranks(world_size, _frozen_mixed_with_trainable)[0] == [True, False, False, False]


def _frozen_between_steps() -> None:
    """Freeze a block for the middle step only; every parameter divides evenly, so the
    unit takes the path where unsharded parameters are views of one buffer."""
    calls: dict[int, int] = {}

    def step(
        model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Any
    ) -> torch.Tensor:
        n = calls[id(model)] = calls.get(id(model), -1) + 1
        model.blocks[0].requires_grad_(n != 1)  # type: ignore[index]
        return default_step(model, inputs, targets, loss_fn)

    batches = random_batches(3, 8, 8, 8)
    check_parity(
        lambda: MLPStack(3, dim=8, hidden=16), wrap_blocks(fully_shard), batches, step=step
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_freezing_between_steps(world_size: int) -> None:
    run_on_ranks(world_size, _frozen_between_steps)


def _ignored_params() -> tuple[bool, bool]:
    model = _stack()
    ignored = model.head.weight
    fully_shard(model, ignored_params={ignored})
    model(torch.randn(4, DIM)).sum().backward()
    return isinstance(model.head.weight, DTensor), isinstance(model.head.bias, DTensor)


def test_ignored_params_are_left_alone() -> None:
    assert run_on_ranks(2, _ignored_params)[0] == (False, True)


class SharedAcrossUnits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.b.weight = self.a.weight


def _shared_across_units() -> str:
    model = SharedAcrossUnits()
    fully_shard(model.a)
    with pytest.raises(ValueError) as info:
        fully_shard(model)
    return str(info.value)


def test_parameter_shared_across_units_is_refused() -> None:
    message = run_on_ranks(2, _shared_across_units)[0]
    assert "'b.weight' is shared with another fully_shard unit" in message


class UnusedBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = MLP(DIM, HIDDEN)
        self.unused = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_parameters() -> None:
    check_parity(UnusedBranch, lambda m: fully_shard(m), _batches())
    model = fully_shard(UnusedBranch())
    model(torch.randn(4, DIM)).sum().backward()
    assert model.unused.weight.grad is None


def test_parameters_that_did_not_run_keep_no_gradient() -> None:
    run_on_ranks(2, _unused_parameters)


# --- explicit control ---------------------------------------------------------------------


def _explicit_unshard_and_prefetch() -> None:
    model = wrap_blocks(fully_shard)(_stack())
    blocks = list(model.blocks)
    for i, block in enumerate(blocks[:-1]):
        block.set_modules_to_forward_prefetch([blocks[i + 1]])
        blocks[i + 1].set_modules_to_backward_prefetch([block])
    handle = blocks[0].unshard(async_op=True)
    assert handle is not None
    handle.wait()
    assert fully_shard.state(blocks[0]).unit.sharded_state is ShardedState.UNSHARDED
    blocks[0].reshard()
    assert isinstance(blocks[0].in_proj.weight, DTensor)
    check_parity(_stack, wrap_blocks(fully_shard), _batches())


def test_explicit_unshard_reshard_and_prefetch() -> None:
    run_on_ranks(2, _explicit_unshard_and_prefetch)


class WithGenerate(MLP):
    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.in_proj(x))


def _forward_method() -> tuple[bool, bool]:
    model = WithGenerate(DIM, HIDDEN)
    fully_shard(model)
    with torch.no_grad():
        try:
            model.generate(torch.randn(2, DIM))  # sharded DTensor weights meet a plain input
            unregistered_failed = False
        except Exception:
            unregistered_failed = True
        register_fsdp_forward_method(model, "generate")
        out = model.generate(torch.randn(2, DIM))
    return unregistered_failed, out.shape == (2, DIM) and isinstance(model.in_proj.weight, DTensor)


def test_register_fsdp_forward_method() -> None:
    assert run_on_ranks(2, _forward_method) == [(True, True), (True, True)]


# --- errors ---------------------------------------------------------------------------------


def _errors() -> list[str]:
    messages = []

    def expect(kind: type[BaseException], call: Callable[[], Any]) -> None:
        with pytest.raises(kind) as info:
            call()
        messages.append(str(info.value))

    model = fully_shard(_stack())
    expect(AssertionError, lambda: fully_shard(model))

    meta_model = fully_shard(nn.Linear(4, 4, device="meta"))
    expect(RuntimeError, lambda: meta_model(torch.randn(2, 4)))

    two_roots = _stack()
    fully_shard(two_roots.blocks[0])
    two_roots.blocks[0](torch.randn(2, DIM))  # the child ran alone: it became a root
    fully_shard(two_roots)
    expect(RuntimeError, lambda: two_roots(torch.randn(2, DIM)))

    transposed = nn.Linear(4, 4)
    transposed.weight = nn.Parameter(torch.randn(4, 4).t())
    expect(ValueError, lambda: fully_shard(transposed))

    scalar = nn.Module()
    scalar.scale = nn.Parameter(torch.tensor(1.0))
    expect(ValueError, lambda: fully_shard(scalar))

    expect(AssertionError, lambda: copy.deepcopy(model))  # torch's type (also RuntimeError)
    expect(
        ValueError,
        lambda: fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (2, 1, 1))),
    )
    expect(ValueError, lambda: fully_shard(nn.Linear(2, 2), reshard_after_forward=3))
    expect(TypeError, lambda: fully_shard(nn.Linear(2, 2), reshard_after_forward="yes"))
    cuda_mesh = DeviceMesh("cuda", [0, 1], _init_backend=False)  # never used to communicate
    expect(ValueError, lambda: fully_shard(nn.Linear(2, 2), mesh=cuda_mesh))
    return messages


def test_errors_name_the_problem_and_the_fix() -> None:
    messages = run_on_ranks(2, _errors)[0]
    assert "fully_shard has already been applied" in messages[0]
    assert "meta device" in messages[1] and "['weight', 'bias']" in messages[1]
    assert "already ran its own forward" in messages[2]
    assert "'weight' is not contiguous" in messages[3]
    assert "'scale' is 0-dim" in messages[4] and "ignored_params" in messages[4]
    assert "deepcopy" in messages[5] and "before calling fully_shard" in messages[5]
    assert "2-D (replicate, shard) for HSDP" in messages[6] and "3-D" in messages[6]
    assert "reshard_after_forward=3 must divide the shard group size 2" in messages[7]
    assert "an int (the group size" in messages[8]
    assert "mesh is on 'cuda'" in messages[9] and "module.to('cuda')" in messages[9]


def _names_and_class() -> tuple[bool, list[str], list[str]]:
    model = _stack()
    names = [n for n, _ in model.named_parameters()]
    wrap_blocks(fully_shard)(model)
    after = [n for n, _ in model.named_parameters()]
    return isinstance(model.blocks[0], FSDPModule) and isinstance(model, MLPStack), names, after


def test_fsdp_module_isinstance_and_names() -> None:
    is_fsdp, before, after = run_on_ranks(1, _names_and_class)[0]
    assert is_fsdp and before == after
