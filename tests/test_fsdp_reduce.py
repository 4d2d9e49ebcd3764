"""Gradient reduction of ``fully_shard``: torch's numerics and torch's reduction methods.

The oracle is torch's own ``fully_shard``, run in the same test on the same model and
inputs: gradients must be equal bit for bit, in bf16 and fp16 too (torch splits the
averaging between a division before the reduce-scatter and one after; an implementation
that divides by the whole world first differs in the last bit at 4 ranks), and
``set_gradient_divide_factor`` / ``set_force_sum_reduction_for_comms`` /
``set_all_reduce_hook`` / custom collectives must change them as torch's do.
"""

from __future__ import annotations

import copy
import itertools
import types
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
from torch.distributed.tensor import Shard

from plait.fsdp import MixedPrecisionPolicy, fully_shard
from plait.fsdp.collectives import gradient_division

from harness import run_on_ranks
from models import MLP, MLPStack, hsdp_mesh

Setup = Callable[[nn.Module], None]  # called on every fully_shard-ed module, both libraries


# --- the choice of divisions, against torch's function -----------------------------------------


def _group(size: int) -> Any:
    return types.SimpleNamespace(size=lambda: size)


@pytest.mark.parametrize(
    "shard,replicate,dtype,factor,force_sum",
    [
        (s, r, d, f, fs)
        for s, r, d, f, fs in itertools.product(
            [1, 2, 3, 4, 8, 6],
            [1, 2],
            [torch.float32, torch.bfloat16, torch.float16],
            [None, 1.0, 2.0, 6.0],
            [False, True],
        )
        if not (s == 1 and f is not None)  # torch then divides the copy, see the next test
    ],
)
def test_divisions_are_torchs(
    shard: int, replicate: int, dtype: torch.dtype, factor: float | None, force_sum: bool
) -> None:
    ours = gradient_division(shard, replicate, dtype, factor, force_sum, premul_sum=True)
    all_reduce_group = _group(replicate) if replicate > 1 else None
    pre, post, scatter_op, all_reduce_op = _get_gradient_divide_factors(
        _group(shard), all_reduce_group, dtype, "cpu", factor, force_sum
    )
    assert (ours.pre, ours.post, ours.scale, ours.between) == (pre, post, None, None)
    assert ours.all_reduce_op == all_reduce_op
    assert ours.scatter_op == scatter_op  # PREMUL_SUM compares by kind: check the factor
    assert getattr(ours.scatter_op, "factor", None) == getattr(scatter_op, "factor", None)


def test_divisions_without_premul_sum_and_at_one_shard_rank() -> None:
    # gloo has no PREMUL_SUM: the input is scaled before a SUM instead.
    emulated = gradient_division(4, 1, torch.float32, 8.0, premul_sum=False)
    assert (emulated.scatter_op, emulated.scale, emulated.pre, emulated.post) == (
        dist.ReduceOp.SUM,
        1 / 8.0,
        None,
        None,
    )
    # One shard rank: torch copies the gradients and divides the copy by the factor.
    single = gradient_division(1, 1, torch.bfloat16, 4.0)
    assert (single.between, single.pre, single.post) == (4.0, None, None)


# --- gradients against torch's fully_shard -------------------------------------------------------


def _pair(
    build: Callable[[], nn.Module],
    mesh: DeviceMesh | None = None,
    mp: tuple[torch.dtype | None, torch.dtype | None] = (None, None),
    setup: Setup | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, nn.Module]:
    """The same model sharded by plait and by torch, per block then root, ``setup`` run on
    every sharded module of both; ``kwargs`` go to every ``fully_shard`` call."""
    torch.manual_seed(0)
    base = build()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    for model, shard, policy in (
        (ours, fully_shard, MixedPrecisionPolicy(*mp)),
        (theirs, torch_fully_shard, TorchMixedPrecisionPolicy(*mp)),
    ):
        blocks = list(getattr(model, "blocks", []))
        for module in [*blocks, model]:
            shard(module, mesh=mesh, mp_policy=policy, **kwargs)
            if setup is not None:
                setup(module)
    return ours, theirs


def _assert_same_grads(
    ours: nn.Module, theirs: nn.Module, inputs: Sequence[torch.Tensor], dtype: torch.dtype
) -> None:
    """Train both for ``len(inputs)`` steps; every gradient must be bitwise torch's."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step, x in enumerate(inputs):
        for model, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad()
            model(x.to(dtype)).float().pow(2).mean().backward()
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            got, want = p.grad.to_local(), q.grad.to_local()  # type: ignore[union-attr]
            assert got.dtype == want.dtype, name
            if not torch.equal(got, want):
                diff = (got - want).abs().max().item()
                raise AssertionError(f"step {step}: {name}.grad differs from torch's by {diff}")
        for opt in opts:
            opt.step()  # the last step's gradients stay, for the caller to inspect


def _inputs(dim: int, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(1 + dist.get_rank())
    return [torch.randn(6, dim) * 3 for _ in range(steps)]


def _stack() -> MLPStack:
    return MLPStack(2, dim=24, hidden=40)


def _low_precision(param_dtype: torch.dtype, reduce_dtype: torch.dtype | None, hsdp: bool) -> None:
    mesh = hsdp_mesh() if hsdp else None
    ours, theirs = _pair(_stack, mesh, (param_dtype, reduce_dtype))
    _assert_same_grads(ours, theirs, _inputs(24), torch.float32)


@pytest.mark.parametrize(
    "world_size,param_dtype,reduce_dtype",
    [
        (world, *dtypes)
        for world in (1, 2, 4)
        for dtypes in [
            (torch.bfloat16, None),
            (torch.float16, None),
            (torch.float32, torch.bfloat16),
            (torch.bfloat16, torch.float32),
        ]
    ]
    # 3 ranks: dividing by the world is not exact, so where it happens shows in the bits
    + [(3, torch.bfloat16, None), (3, torch.float32, None), (3, torch.float16, None)],
)
def test_low_precision_gradients_equal_torchs(
    world_size: int, param_dtype: torch.dtype, reduce_dtype: torch.dtype | None
) -> None:
    run_on_ranks(world_size, _low_precision, param_dtype, reduce_dtype, False)


def _deferred_all_reduce(param_dtype: torch.dtype) -> None:
    """HSDP accumulation without the all-reduce (``set_requires_all_reduce(False)``), then
    a step with it: the partial sums and the divisions combine as torch's do."""
    ours, theirs = _pair(_stack, hsdp_mesh(), (param_dtype, None))
    first, second = _inputs(24, steps=2)
    for model in (ours, theirs):
        model.set_requires_all_reduce(False)  # type: ignore[operator]
        model(first).float().pow(2).mean().backward()
        model.set_requires_all_reduce(True)  # type: ignore[operator]
    _assert_same_grads(ours, theirs, [second], torch.float32)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_hsdp_deferred_all_reduce_equals_torchs(param_dtype: torch.dtype) -> None:
    run_on_ranks(4, _deferred_all_reduce, param_dtype)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_hsdp_low_precision_gradients_equal_torchs(param_dtype: torch.dtype) -> None:
    run_on_ranks(4, _low_precision, param_dtype, None, True)


def _largest_dim(param: nn.Parameter) -> Shard:
    sizes = list(param.shape)
    return Shard(sizes.index(max(sizes)))


def _low_precision_placed(param_dtype: torch.dtype, reshard_after_forward: bool | int) -> None:
    """torch's test_compute_dtype setting: largest-dim sharding, hpZ resharding."""
    kwargs = {"mp": (param_dtype, None), "shard_placement_fn": _largest_dim}
    ours, theirs = _pair(_stack, reshard_after_forward=reshard_after_forward, **kwargs)
    if reshard_after_forward == 2:
        # torch 2.13 fails here on CPU (IndexError in its all-gather copy-out for a 1-D
        # parameter): compare with plait's run that reshards fully, whose reduction is
        # the same.
        theirs = _pair(_stack, reshard_after_forward=True, **kwargs)[0]
    _assert_same_grads(ours, theirs, _inputs(24), torch.float32)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reshard_after_forward", [False, True, 2])
def test_low_precision_with_shard_placement_equals_torchs(
    param_dtype: torch.dtype, reshard_after_forward: bool | int
) -> None:
    run_on_ranks(4, _low_precision_placed, param_dtype, reshard_after_forward)


def _divide_factor(factor: float, force_sum: bool, param_dtype: torch.dtype | None) -> None:
    def setup(module: nn.Module) -> None:
        if force_sum:
            module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        module.set_gradient_divide_factor(factor)  # type: ignore[operator]

    ours, theirs = _pair(_stack, mp=(param_dtype, None), setup=setup)
    _assert_same_grads(ours, theirs, _inputs(24), torch.float32)


FACTOR_CASES = [
    (1.0, True, None),  # torchtitan's call on CPU: a plain sum
    (3.0, True, None),
    (1.0, True, torch.bfloat16),
    (1.0, False, torch.float16),  # fp16 splits the factor around the reduction
    (6.0, False, torch.float16),
    (6.0, True, torch.float16),
]


@pytest.mark.parametrize(
    "world_size,factor,force_sum,param_dtype",
    [
        (world, *case)
        for world in (1, 2, 4)
        for case in FACTOR_CASES
        # at world size 1 torch divides twice by a factor other than 1 when it pre/post
        # divides (forced sums, fp16); plait once: see test_one_rank_divides_once
        if world > 1 or case[0] == 1.0
    ],
)
def test_divide_factor_and_forced_sums_equal_torchs(
    world_size: int, factor: float, force_sum: bool, param_dtype: torch.dtype | None
) -> None:
    run_on_ranks(world_size, _divide_factor, factor, force_sum, param_dtype)


def _one_rank_divides_once(factor: float, force_sum: bool, param_dtype: torch.dtype) -> None:
    grads = {}
    for divide in (False, True):
        torch.manual_seed(0)
        model = fully_shard(MLP(8, 16), mp_policy=MixedPrecisionPolicy(param_dtype))
        if divide:
            model.set_force_sum_reduction_for_comms(force_sum)  # type: ignore[operator]
            model.set_gradient_divide_factor(factor)  # type: ignore[operator]
        torch.manual_seed(1)
        model(torch.randn(4, 8).to(param_dtype)).float().sum().backward()
        grads[divide] = [p.grad.to_local() for p in model.parameters()]  # type: ignore[union-attr]
    division = gradient_division(1, 1, param_dtype, factor, force_sum)
    for plain, divided in zip(grads[False], grads[True], strict=True):
        want = plain.to(param_dtype)  # the reduction ran in param_dtype
        for divisor in (division.pre, division.between, division.post):
            want = want / divisor if divisor is not None else want
        assert torch.equal(divided, want.float())


@pytest.mark.parametrize(
    "force_sum,param_dtype",
    [(True, torch.float32), (False, torch.float16), (True, torch.float16), (False, torch.float32)],
)
def test_one_rank_divides_once(force_sum: bool, param_dtype: torch.dtype) -> None:
    run_on_ranks(1, _one_rank_divides_once, 6.0, force_sum, param_dtype)


def _sum_without_premul_sum() -> None:
    """torch needs NCCL's PREMUL_SUM for a custom factor without forced sums; plait scales
    the input instead on gloo: factor 1 gives the plain sum, ``world`` the average."""
    world = dist.get_world_size()
    results = {}
    for factor in (None, 1.0, float(world)):
        torch.manual_seed(0)
        model = fully_shard(MLP(8, 16))
        if factor is not None:
            model.set_gradient_divide_factor(factor)  # type: ignore[operator]
        torch.manual_seed(1 + dist.get_rank())
        model(torch.randn(4, 8)).sum().backward()
        results[factor] = [p.grad.to_local() for p in model.parameters()]  # type: ignore[union-attr]
    for default, summed, averaged in zip(*results.values(), strict=True):
        assert torch.equal(averaged, default) and torch.equal(default * world, summed)


def test_custom_factor_without_premul_sum() -> None:
    run_on_ranks(2, _sum_without_premul_sum)


def _deprecated_alias() -> None:
    model = fully_shard(MLP(8, 16))
    with pytest.warns(DeprecationWarning, match="set_gradient_divide_factor"):
        model.set_reduce_scatter_divide_factor(2.0)  # type: ignore[operator]
    assert fully_shard.state(model).unit.gradient_divide_factor == 2.0


def test_reduce_scatter_divide_factor_is_a_deprecated_alias() -> None:
    run_on_ranks(1, _deprecated_alias)


# --- the all-reduce hook --------------------------------------------------------------------------


def _groups_of_two() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """On 4 ranks: this rank's "node" {0, 1} / {2, 3} and its peers across nodes."""
    rank = dist.get_rank()
    intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    inter = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    return intra, inter


def _hook_replaces_hsdp_all_reduce() -> None:
    """torch's own example: 1-D FSDP inside each node, the hook averages across nodes."""
    intra, inter = _groups_of_two()
    mesh = DeviceMesh.from_group(intra, "cpu", dist.get_process_group_ranks(intra))
    calls = []

    def hook(output: torch.Tensor) -> None:
        calls.append(output.numel())
        dist.all_reduce(output, group=inter, op=dist.ReduceOp.AVG)

    def build() -> nn.Module:
        model = MLP(10, 40)
        node = dist.get_rank() // 2
        nn.init.constant_(model.in_proj.weight, 1.0 * node)
        nn.init.constant_(model.out_proj.weight, 2.0 * node)
        return model

    ours, theirs = _pair(build, mesh, setup=lambda m: m.set_all_reduce_hook(hook))  # type: ignore[operator]
    x = torch.arange(10, dtype=torch.float32).view(1, 10)
    _assert_same_grads(ours, theirs, [x], torch.float32)
    assert len(calls) == 2 and calls[0] == calls[1]  # one reduction per unit, each library
    # the hook sees the gradients only: the shards of this unit's four parameters
    assert calls[0] == sum(p.to_local().numel() for p in ours.parameters())
    # The nodes' gradients differ (node 0's weights are 0) until the hook averages them.
    for p in ours.parameters():
        assert torch.equal(*dist_all_gather(p.grad.to_local(), inter))  # type: ignore[union-attr]


def dist_all_gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return out


def test_all_reduce_hook_on_a_one_dim_mesh() -> None:
    run_on_ranks(4, _hook_replaces_hsdp_all_reduce)


def _hook_after_hsdp_all_reduce() -> None:
    seen: list[torch.Tensor] = []

    def hook(output: torch.Tensor) -> None:
        seen.append(output.clone())
        output.mul_(3)

    ours, theirs = _pair(_stack, hsdp_mesh(), setup=lambda m: m.set_all_reduce_hook(hook))  # type: ignore[operator]
    _assert_same_grads(ours, theirs, _inputs(24, steps=2), torch.float32)
    assert len(seen) == 2 * 3 * 2  # steps x units x libraries
    with pytest.raises(ValueError, match="stream cannot be set when using native HSDP"):
        ours.set_all_reduce_hook(hook, stream=object())  # type: ignore[operator]


def test_all_reduce_hook_after_hsdp_all_reduce() -> None:
    run_on_ranks(4, _hook_after_hsdp_all_reduce)


class _Logged:
    """A collective's work whose wait is logged."""

    def __init__(self, work: Any, name: str, log: list[str]) -> None:
        self._work, self._name, self._log = work, name, log

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._log.append(f"wait {self._name}")
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._work, attr)


def _hsdp_all_reduce_left_in_flight() -> list[str]:
    """HSDP: each unit's all-reduce across replicas is issued when its reduce-scatter is
    waited for and itself waited for only at the next unit's reduction (the backward in
    between hides it), not at once; the gradients are still torch's."""
    log: list[str] = []
    originals = {name: getattr(dist, name) for name in ("reduce_scatter_single", "all_reduce")}

    def spy(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            n = sum(e.startswith(name) for e in log)
            log.append(f"{name} {n}")
            work = originals[name](*args, **kwargs)
            return _Logged(work, f"{name} {n}", log) if work is not None else None

        return call

    ours, theirs = _pair(_stack, hsdp_mesh())
    for name in originals:
        setattr(dist, name, spy(name))
    try:
        ours(_inputs(24, steps=1)[0]).sum().backward()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    ours.zero_grad()
    _assert_same_grads(ours, theirs, _inputs(24, steps=2), torch.float32)
    return log


def test_hsdp_all_reduce_overlaps_the_next_units_backward() -> None:
    log = run_on_ranks(4, _hsdp_all_reduce_left_in_flight)[0]
    units = sum(e.startswith("reduce_scatter_single") for e in log)
    assert units == 3 and sum(e.startswith("all_reduce") for e in log) == units, log
    for k in range(units - 1):  # the last unit's finishes at the end of backward
        issued, waited = log.index(f"all_reduce {k}"), log.index(f"wait all_reduce {k}")
        assert log.index(f"reduce_scatter_single {k + 1}") < waited, log
        assert log.index(f"wait reduce_scatter_single {k}") < issued < waited, log


# --- custom collectives ---------------------------------------------------------------------------


class _CountingAllocations:
    """torch's comm protocol allocates the output first; count allocations and calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.allocations = 0

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)


class CountingAllGather(_CountingAllocations, AllGather):
    """torch's protocol: allocate the output, then gather into it."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.calls += 1
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(_CountingAllocations, ReduceScatter):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.calls += 1
        return dist.reduce_scatter_single(
            output_tensor, input_tensor, group=group, op=op, async_op=async_op
        )


def _custom_comms() -> None:
    comms: dict[str, list[Any]] = {"ag": [], "rs": []}

    def setup(module: nn.Module) -> None:
        comms["ag"].append(CountingAllGather())
        comms["rs"].append(CountingReduceScatter())
        module.set_custom_all_gather(comms["ag"][-1])  # type: ignore[operator]
        module.set_custom_reduce_scatter(comms["rs"][-1])  # type: ignore[operator]

    ours, theirs = _pair(_stack, mp=(torch.bfloat16, None), setup=setup)
    _assert_same_grads(ours, theirs, _inputs(24, steps=2), torch.float32)
    ours_ag, theirs_ag = comms["ag"][:3], comms["ag"][3:]
    ours_rs = comms["rs"][:3]
    # plait: per step, 3 all-gathers in forward and 2 more in backward (the root stays
    # unsharded), one reduce-scatter per unit; each call allocates its buffers.
    assert sum(c.calls for c in ours_ag) == sum(c.calls for c in theirs_ag) == 2 * 5
    assert [c.calls for c in ours_rs] == [2, 2, 2]
    assert all(c.allocations == c.calls for c in ours_ag)
    assert all(c.allocations == 2 * c.calls for c in ours_rs)  # input and output


def test_custom_all_gather_and_reduce_scatter_are_called() -> None:
    run_on_ranks(2, _custom_comms)
