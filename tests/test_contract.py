"""``plait.contract``: every scenario of the torch seed test, plus plait's own guarantees."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import plait
from plait.contract import RegistryItem, contract, get_registry


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq1 = nn.Sequential(*[nn.Linear(10, 10) for _ in range(2)])
        self.seq2 = nn.Sequential(*[nn.Linear(10, 10) for _ in range(2)])
        self.p = nn.Parameter(torch.randn(10, 10))
        self.register_buffer("b", torch.zeros(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.b += x.sum() + y.sum()
        return self.p + self.seq1(x) + self.seq2(y)


# --- the seed scenarios ---------------------------------------------------------------


def test_hooks_added_by_an_api_leave_numerics_unchanged() -> None:
    @contract()
    def noop_api(module: nn.Module) -> nn.Module:
        module.register_forward_pre_hook(lambda m, inp: inp)
        module.register_forward_hook(lambda m, inp, out: out)
        module.register_full_backward_pre_hook(lambda m, grad_out: grad_out)
        module.register_full_backward_hook(lambda m, grad_in, grad_out: grad_in)
        return module

    model = ToyModel()
    reference = copy.deepcopy(model)
    noop_api(model.seq1)
    noop_api(model.seq2)
    x, y = torch.randn(10, 10), torch.randn(10, 10)
    model(x, y).sum().backward()
    reference(x, y).sum().backward()
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad), name
    assert torch.equal(model.b, reference.b)


class ModelWrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_api_that_changes_parameter_fqns_is_refused() -> None:
    @contract()
    def wrap_module(module: nn.Module) -> nn.Module:
        return ModelWrapper(module)

    model = ToyModel()
    with pytest.raises(
        RuntimeError,
        match="Checking parameters: Composable distributed API implementations cannot modify FQNs",
    ) as info:
        wrap_module(model.seq1)
    message = str(info.value)
    assert "wrap_module" in message
    assert "'0.weight'" in message and "'module.0.weight'" in message
    # the failed application left nothing behind, so a correct retry is possible
    assert get_registry(model.seq1) is None
    assert wrap_module.state(model.seq1) is None


def test_state_is_reachable_from_hooks_and_mutable() -> None:
    seen = []

    @contract()
    def api(module: nn.Module) -> nn.Module:
        api.state(module).dummy_state = 7

        def check_and_update(module: nn.Module, inp: tuple[torch.Tensor, ...]) -> None:
            seen.append(api.state(module).dummy_state)
            api.state(module).dummy_state = 8

        module.register_forward_pre_hook(check_and_update)
        return module

    model = ToyModel()
    api(model.seq1)
    assert api.state(model.seq1).dummy_state == 7
    model(torch.zeros(10, 10), torch.zeros(10, 10))
    assert seen == [7]
    assert api.state(model.seq1).dummy_state == 8
    assert api.state(model.seq2) is None


def test_registry_orders_apis_and_refuses_a_second_application() -> None:
    @contract()
    def api1(module: nn.Module) -> nn.Module:
        return module

    @contract()
    def api2(module: nn.Module) -> nn.Module:
        return module

    model = ToyModel()
    model = api1(model)
    registry = get_registry(model)
    assert registry is not None and list(registry) == ["api1"]
    model = api2(model)
    registry = get_registry(model)
    assert registry is not None and list(registry) == ["api1", "api2"]
    assert get_registry(model.seq1) is None
    assert get_registry(model.seq2) is None
    with pytest.raises(AssertionError, match="api1 has already been applied"):
        api1(model)
    assert list(registry) == ["api1", "api2"]


def test_multi_module_api_shares_state_and_registry_per_call() -> None:
    @contract()
    def multi_module_api(modules: list[nn.Module]) -> list[nn.Module]:
        return modules

    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(5)])
    multi_module_api([model[0], model[1]])
    multi_module_api([model[2], model[3]])
    multi_module_api([model[4]])
    states = [multi_module_api.state(m) for m in model]
    assert states[0] is states[1]
    assert states[2] is states[3]
    assert states[0] is not states[2] and states[0] is not states[4]
    assert states[2] is not states[4]
    registries = [get_registry(m) for m in model]
    assert registries[0] == registries[1]
    assert registries[2] == registries[3]
    assert registries[0] != registries[2]
    assert registries[0] != registries[4]
    assert registries[2] != registries[4]

    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(5)])
    multi_module_api([model[0], model[1]])
    with pytest.raises(
        AssertionError,
        match="Each distinct composable distributed API can only be applied to a module once. "
        "multi_module_api has already been applied to the following module:",
    ):
        multi_module_api([model[0], model[2]])
    # the refused call registered nothing on model[2]
    assert get_registry(model[2]) is None


# --- plait's additions ----------------------------------------------------------------


def test_api_may_swap_the_module_class_if_names_are_kept() -> None:
    class Tagged:
        tagged = True

    @contract()
    def retype(module: nn.Module) -> nn.Module:
        module.__class__ = type(f"Tagged{type(module).__name__}", (Tagged, type(module)), {})
        return module

    model = ToyModel()
    x, y = torch.randn(10, 10), torch.randn(10, 10)
    expected = copy.deepcopy(model)(x, y)
    out = retype(model)
    assert out is model and isinstance(model, Tagged) and isinstance(model, ToyModel)
    assert torch.equal(model(x, y), expected)


def test_api_may_return_another_module_object_with_the_same_names() -> None:
    @contract()
    def clone(module: nn.Module) -> nn.Module:
        return copy.deepcopy(module)

    model = ToyModel()
    out = clone(model.seq1)
    assert out is not model.seq1
    assert [n for n, _ in out.named_parameters()] == [n for n, _ in model.seq1.named_parameters()]


def test_buffer_rename_names_the_kind_of_name() -> None:
    @contract()
    def rename_buffer(module: nn.Module) -> nn.Module:
        value = module._buffers.pop("b")
        module.register_buffer("b_renamed", value)
        return module

    with pytest.raises(RuntimeError, match="Checking buffers:") as info:
        rename_buffer(ToyModel())
    assert "['b']" in str(info.value) and "['b_renamed']" in str(info.value)


def test_submodule_rename_is_refused() -> None:
    @contract()
    def add_child(module: nn.Module) -> nn.Module:
        module.extra = nn.ReLU()
        return module

    with pytest.raises(RuntimeError, match="Checking modules:"):
        add_child(ToyModel())


def test_reordering_names_is_refused() -> None:
    @contract()
    def reorder(module: nn.Module) -> nn.Module:
        params = module._parameters
        module._parameters = type(params)(reversed(list(params.items())))
        return module

    with pytest.raises(RuntimeError, match="order of FQNs changed"):
        reorder(nn.Linear(2, 2))


def test_state_lives_on_a_module_deep_in_a_tree() -> None:
    @contract()
    def api(module: nn.Module) -> nn.Module:
        api.state(module).depth = "deep"
        return module

    model = nn.Sequential(ToyModel(), nn.Linear(10, 10))
    leaf = model[0].seq2[1]
    api(leaf)
    assert api.state(leaf).depth == "deep"
    for other in model.modules():
        if other is not leaf:
            assert api.state(other) is None
            assert get_registry(other) is None


def test_registry_of_parent_and_child_after_two_apis() -> None:
    @contract()
    def outer(module: nn.Module) -> nn.Module:
        return module

    @contract()
    def inner(module: nn.Module) -> nn.Module:
        return module

    model = ToyModel()
    inner(model.seq1)
    outer(model)
    inner(model)  # the same API may be applied to a parent and a child separately
    outer(model.seq1)
    parent, child = get_registry(model), get_registry(model.seq1)
    assert parent is not None and child is not None
    assert list(parent) == ["outer", "inner"]
    assert list(child) == ["inner", "outer"]
    assert all(isinstance(item, RegistryItem) for item in parent.values())
    assert parent["inner"] is not child["inner"]
    assert inner.state(model) is not inner.state(model.seq1)
    assert get_registry(model.seq2) is None


def test_nested_modules_in_one_call_register_on_the_outermost_only() -> None:
    @contract()
    def api(modules: list[nn.Module]) -> list[nn.Module]:
        return modules

    model = ToyModel()
    api([model.seq1[0], model.seq1])
    assert get_registry(model.seq1) is not None
    assert get_registry(model.seq1[0]) is None


def test_custom_state_class_and_failure_rollback() -> None:
    class CountingState:
        def __init__(self) -> None:
            self.calls = 0

    @contract(CountingState)
    def flaky(module: nn.Module, fail: bool) -> nn.Module:
        flaky.state(module).calls += 1
        if fail:
            raise ValueError("the api body failed")
        return module

    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="the api body failed"):
        flaky(model, fail=True)
    assert get_registry(model) is None and flaky.state(model) is None
    flaky(model, fail=False)
    assert flaky.state(model).calls == 1


def test_bad_first_argument_is_a_type_error() -> None:
    @contract()
    def api(module: nn.Module) -> nn.Module:
        return module

    with pytest.raises(TypeError, match="api expects an nn.Module or a list of nn.Module"):
        api("not a module")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty list"):
        api([])


def test_state_travels_with_deepcopy() -> None:
    @contract()
    def api(module: nn.Module) -> nn.Module:
        api.state(module).value = 3
        return module

    model = api(nn.Linear(2, 2))
    twin = copy.deepcopy(model)
    assert api.state(twin).value == 3
    assert api.state(twin) is not api.state(model)


def test_get_registry_is_reachable_as_plait_contract_get_registry() -> None:
    model = nn.Linear(2, 2)
    assert plait.contract.get_registry(model) is None
    assert plait.contract.get_registry is get_registry


def test_get_registry_under_torchs_private_name() -> None:
    # torch: ``from torch.distributed._composable import _get_registry, contract``
    from plait import _get_registry
    from plait.contract import _get_registry as from_module

    @contract()
    def api(module: nn.Module) -> nn.Module:
        return module

    model = api(nn.Linear(2, 2))
    assert _get_registry is from_module is plait.contract._get_registry
    registry = _get_registry(model)
    assert registry is not None and list(registry) == ["api"]
    assert _get_registry(nn.Linear(2, 2)) is None
