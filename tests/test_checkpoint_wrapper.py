"""``plait.checkpoint_wrapper``: torch's module-wrapper checkpoint API (torchtitan's full and
selective AC), checked against the unwrapped model and against torch's own wrapper."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as torch_wrapper
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import plait
from plait.checkpoint import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from harness import run_on_ranks
from models import MLP
from parity import check_parity, random_batches

aten = torch.ops.aten
DIM = 6


class Block(nn.Module):
    """An MLP with dropout: recomputing it must replay the random numbers too."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(DIM, 10)
        self.drop = nn.Dropout(0.3)
        self.register_buffer("scale", torch.full((DIM,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.mlp(x).tanh()) * self.scale


class Net(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def wrap_layers(model: Net, wrap: Callable[[nn.Module], nn.Module]) -> Net:
    """Replace each layer by ``wrap(layer)``, the way torchtitan applies AC."""
    for i, layer in enumerate(model.layers):
        model.layers[i] = wrap(layer)
    return model


def grads_after_step(model: nn.Module) -> dict[str, torch.Tensor]:
    """One forward+backward with fixed input and RNG; the gradients by parameter name."""
    torch.manual_seed(3)
    x = torch.randn(5, DIM, requires_grad=True)
    torch.manual_seed(4)
    model(x).pow(2).sum().backward()
    assert x.grad is not None
    return {**grads_by_position(model), "<input>": x.grad}


def grads_by_position(model: nn.Module) -> dict[str, torch.Tensor]:
    # By position: the root's named_parameters shows the wrapper level (as with torch's).
    return {str(i): p.grad for i, p in enumerate(model.parameters()) if p.grad is not None}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def three_copies() -> tuple[Net, Net, Net]:
    torch.manual_seed(0)
    plain = Net()
    return plain, copy.deepcopy(plain), copy.deepcopy(plain)


# --- full AC ------------------------------------------------------------------------------


def test_gradients_bitwise_equal_to_unwrapped_and_to_torch_wrapper() -> None:
    plain, ours, theirs = three_copies()
    # torchtitan's FullAC keywords.
    kwargs: dict[str, Any] = dict(
        preserve_rng_state=True, determinism_check="default", early_stop=False, debug=False
    )
    wrap_layers(ours, lambda m: checkpoint_wrapper(m, **kwargs))
    wrap_layers(theirs, lambda m: torch_wrapper.checkpoint_wrapper(m, **kwargs))
    assert isinstance(ours.layers[0], CheckpointWrapper)
    expected = grads_after_step(plain)
    assert_bitwise_equal(grads_after_step(ours), expected)
    assert_bitwise_equal(grads_after_step(theirs), expected)


def test_wrapped_block_is_recomputed_in_backward() -> None:
    torch.manual_seed(0)
    wrapped = checkpoint_wrapper(Block())
    calls: list[bool] = []
    wrapped.mlp.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    wrapped(torch.randn(2, DIM, requires_grad=True)).sum().backward()
    assert len(calls) == 2  # the forward, then the recompute during backward


def test_no_grad_forward_is_not_checkpointed() -> None:
    torch.manual_seed(0)
    block = Block()
    wrapped = checkpoint_wrapper(copy.deepcopy(block))
    with torch.no_grad():
        x = torch.randn(2, DIM)
        torch.manual_seed(1)
        expected = block(x)
        torch.manual_seed(1)
        assert torch.equal(wrapped(x), expected)


def test_reentrant_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="non-reentrant only"):
        checkpoint_wrapper(Block(), checkpoint_impl=CheckpointImpl.REENTRANT)


def test_unknown_checkpoint_keyword_is_refused() -> None:
    with pytest.raises(ValueError, match="preserve_rng"):
        checkpoint_wrapper(Block(), preserve_rng=True)


def test_checkpoint_fn_is_called_with_the_module_and_keywords() -> None:
    seen: list[tuple[nn.Module, dict[str, Any]]] = []

    def checkpoint_fn(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        seen.append((module, kwargs))
        return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False)

    plain, ours, _ = three_copies()
    wrap_layers(ours, lambda m: checkpoint_wrapper(m, checkpoint_fn=checkpoint_fn, tag=7))
    assert_bitwise_equal(grads_after_step(ours), grads_after_step(plain))
    assert [(type(m), kw) for m, kw in seen[:1]] == [(Block, {"tag": 7})]
    assert seen[0][0] is ours.layers[0]._checkpoint_wrapped_module


# --- names, state dicts, attributes ----------------------------------------------------------


def test_names_and_state_dict_keys_are_those_of_the_unwrapped_model() -> None:
    plain, ours, theirs = three_copies()
    wrap_layers(ours, checkpoint_wrapper)
    wrap_layers(theirs, torch_wrapper.checkpoint_wrapper)
    names = [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in ours.layers[0].named_parameters()] == [
        n for n, _ in plain.layers[0].named_parameters()
    ]
    # On the root, nn.Module's own named_parameters lists the wrapper level, as with torch's.
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert len(names) == len(list(ours.named_parameters()))
    assert list(ours.state_dict()) == list(plain.state_dict()) == list(theirs.state_dict())
    # The module tree does have the extra level (that is what torch's wrapper does too).
    assert "layers.0._checkpoint_wrapped_module.mlp" in dict(ours.named_modules())


def test_state_dicts_load_both_ways_and_from_torch_wrapper() -> None:
    plain, ours, theirs = three_copies()
    wrap_layers(ours, checkpoint_wrapper)
    wrap_layers(theirs, torch_wrapper.checkpoint_wrapper)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    ours.load_state_dict(plain.state_dict())  # strict: every key must match
    assert all(
        torch.equal(a, b) for a, b in zip(ours.parameters(), plain.parameters(), strict=True)
    )
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(2.0)
    plain.load_state_dict(ours.state_dict())
    theirs.load_state_dict(ours.state_dict())
    for a, b, c in zip(ours.parameters(), plain.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    fresh = wrap_layers(Net(), checkpoint_wrapper)
    fresh.load_state_dict(theirs.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), ours.parameters(), strict=True)
    )


def test_nested_wrappers_keep_names() -> None:
    torch.manual_seed(0)
    block = Block()
    names = list(block.state_dict())
    twice = checkpoint_wrapper(
        checkpoint_wrapper(copy.deepcopy(block)), checkpoint_fn=torch.utils.checkpoint.checkpoint
    )
    assert list(twice.state_dict()) == names
    assert [n for n, _ in twice.named_parameters()] == [n for n, _ in block.named_parameters()]
    twice.load_state_dict(block.state_dict())


def test_attributes_and_indexing_reach_the_wrapped_module() -> None:
    block = Block()
    block.custom = "value"  # type: ignore[assignment]
    wrapped = checkpoint_wrapper(block)
    assert wrapped.mlp is block.mlp
    assert wrapped.scale is block.scale
    assert wrapped.custom == "value"
    assert wrapped.checkpoint_impl is CheckpointImpl.NO_REENTRANT
    with pytest.raises(AttributeError, match="missing"):
        _ = wrapped.missing
    seq = checkpoint_wrapper(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert isinstance(seq[1], nn.ReLU)
    assert copy.deepcopy(wrapped).mlp is not block.mlp  # copies (no recursion on lookup)


def test_apply_activation_checkpointing_wraps_chosen_submodules() -> None:
    plain, ours, _ = three_copies()
    apply_activation_checkpointing(ours, check_fn=lambda m: isinstance(m, Block))
    assert all(isinstance(layer, CheckpointWrapper) for layer in ours.layers)
    assert not isinstance(ours.head, CheckpointWrapper)
    assert list(ours.state_dict()) == list(plain.state_dict())
    sized, torch_sized = copy.deepcopy(plain), copy.deepcopy(plain)  # before plain has grads
    expected = grads_after_step(plain)
    assert_bitwise_equal(grads_after_step(ours), expected)
    # A size policy (the Linear layers: 70 elements or fewer, not counting wrapped ones),
    # chooses the same modules as torch's apply_activation_checkpointing does.

    def small(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or 0 < nonwrapped_numel <= 70

    apply_activation_checkpointing(sized, auto_wrap_policy=small)
    torch_wrapper.apply_activation_checkpointing(torch_sized, auto_wrap_policy=small)
    wrapped = {n for n, m in sized.named_modules() if isinstance(m, CheckpointWrapper)}
    torch_wrapped = {
        n for n, m in torch_sized.named_modules() if isinstance(m, torch_wrapper.CheckpointWrapper)
    }
    assert wrapped == torch_wrapped
    assert len(wrapped) == 7  # 2 Linear in each of 3 blocks, and the head
    assert_bitwise_equal(grads_after_step(sized), expected)


def test_exported_from_plait() -> None:
    assert plait.checkpoint_wrapper is checkpoint_wrapper
    assert plait.CheckpointImpl is CheckpointImpl
    assert plait.CheckpointWrapper is CheckpointWrapper
    assert plait.apply_activation_checkpointing is apply_activation_checkpointing


# --- selective AC with torch's contexts -----------------------------------------------------


class OpCounter(TorchDispatchMode):
    """Counts the ops that really run: entered around backward, it sees the recompute, but
    not the ops a selective-checkpoint mode (entered later, so above it) answers itself."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[Any] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def sac(policy: Callable[..., Any]) -> dict[str, Any]:
    """torchtitan's SelectiveAC keywords for ``policy``."""
    return dict(
        context_fn=lambda: create_selective_checkpoint_contexts(policy),
        preserve_rng_state=True,
        determinism_check="default",
        early_stop=False,
        debug=False,
    )


def save_addmm(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if func is aten.addmm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def recompute_all(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def every_other_addmm() -> Callable[..., CheckpointPolicy]:
    """torchtitan's shape of policy: save every second matmul of the forward."""
    count = {"forward": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func is not aten.addmm.default or ctx.is_recompute:
            return CheckpointPolicy.PREFER_RECOMPUTE
        count["forward"] += 1
        return (
            CheckpointPolicy.PREFER_SAVE
            if count["forward"] % 2
            else (CheckpointPolicy.PREFER_RECOMPUTE)
        )

    return policy


def addmm_in_backward(model: nn.Module) -> tuple[int, dict[str, torch.Tensor]]:
    """How many ``addmm`` the backward ran (recomputes), and the gradients."""
    torch.manual_seed(3)
    x = torch.randn(5, DIM, requires_grad=True)
    torch.manual_seed(4)
    loss = model(x).pow(2).sum()
    with OpCounter() as counter:
        loss.backward()
    assert x.grad is not None
    return counter.counts[aten.addmm.default], {**grads_by_position(model), "<input>": x.grad}


@pytest.mark.parametrize(
    ("make_policy", "recomputed"),
    [
        (lambda: save_addmm, 0),  # 2 Linear per block, none recomputed
        (lambda: recompute_all, 6),  # 3 blocks x 2 Linear
        (every_other_addmm, 3),  # one per block kept (per wrapper: a policy per call)
        (lambda: lambda ctx, func, *a, **k: func is aten.addmm.default, 0),  # bool policy
    ],
    ids=["must-save-addmm", "must-recompute", "every-other", "bool"],
)
def test_selective_ac_with_torch_contexts_saves_what_the_policy_says(
    make_policy: Callable[[], Callable[..., Any]], recomputed: int
) -> None:
    plain, ours, theirs = three_copies()
    wrap_layers(ours, lambda m: checkpoint_wrapper(m, **sac(make_policy())))
    wrap_layers(theirs, lambda m: torch_wrapper.checkpoint_wrapper(m, **sac(make_policy())))
    n_plain, expected = addmm_in_backward(plain)
    assert n_plain == 0  # the plain model recomputes nothing; backward itself uses mm
    n_ours, grads = addmm_in_backward(ours)
    n_theirs, _ = addmm_in_backward(theirs)
    assert (n_ours, n_theirs) == (recomputed, recomputed)
    assert_bitwise_equal(grads, expected)


def test_selective_ac_second_backward_is_refused_like_torch() -> None:
    torch.manual_seed(0)
    wrapped = checkpoint_wrapper(Block(), **sac(save_addmm))
    loss = wrapped(torch.randn(2, DIM)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        loss.backward()


# --- under fully_shard --------------------------------------------------------------------


def _shard_wrapped_layers(selective: bool) -> Callable[[nn.Module], nn.Module]:
    def parallelize(model: nn.Module) -> nn.Module:
        assert isinstance(model, Net)
        wrap_layers(
            model, lambda m: checkpoint_wrapper(m, **(sac(save_addmm) if selective else {}))
        )
        for layer in model.layers:
            plait.fully_shard(layer)  # torchtitan: fully_shard on each wrapped block
        return plait.fully_shard(model)

    return parallelize


def _net_without_dropout() -> Net:
    net = Net()
    for layer in net.layers:
        layer.drop.p = 0.0  # ranks see other slices of the batch: their masks would differ
    return net


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


def _reference() -> Net:
    """The unwrapped computation under the wrapped names (check_parity matches by name):
    wrappers whose ``checkpoint_fn`` just calls the block."""
    return wrap_layers(_net_without_dropout(), lambda m: checkpoint_wrapper(m, checkpoint_fn=_call))


def _fully_shard_parity(selective: bool) -> None:
    check_parity(
        _net_without_dropout,
        _shard_wrapped_layers(selective),
        random_batches(3, 8, DIM, DIM),
        build_reference=_reference,
    )


@pytest.mark.parametrize("selective", [False, True], ids=["full", "selective"])
def test_fully_shard_per_wrapped_block_matches_one_process(selective: bool) -> None:
    run_on_ranks(2, _fully_shard_parity, selective)
