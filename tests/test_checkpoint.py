"""``plait.checkpoint``: every scenario of torch's composable checkpoint test, and more.

The oracle is always the same model without checkpointing (gradients must be bitwise equal
in fp32), and torch's own non-reentrant checkpoints as a second reference. Memory is
*measured*: :class:`StorageTracker` records a weak reference to every storage an op
allocates during the forward, and counts the bytes of those still alive after it, which is
exactly what autograd keeps for backward (plus the output the test holds).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import re
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed._composable as torch_composable
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves

from plait.checkpoint import CheckpointError, checkpoint
from plait.contract import get_registry

from harness import run_on_ranks

aten = torch.ops.aten

# --- measurement helpers ------------------------------------------------------------------


class StorageTracker(TorchDispatchMode):
    """Remembers (weakly) every storage allocated by an op while active.

    ``alive_bytes()`` is the size of those still alive: run the forward under the tracker,
    keep its output, and it gives the bytes the forward left behind for backward. Views and
    in-place ops allocate nothing and are skipped, so parameters never count.
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[StorageWeakRef, int] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if all(ret.alias_info is None for ret in func._schema.returns):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    self.storages[StorageWeakRef(storage)] = storage.nbytes()
        return out

    def alive_bytes(self) -> int:
        gc.collect()
        return sum(n for ref, n in self.storages.items() if not ref.expired())


def forward_bytes(model: nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run ``model`` and measure the bytes its forward keeps alive until backward."""
    with StorageTracker() as tracker:
        out = model(*inputs)
    return out, tracker.alive_bytes()


def graph_size(out: torch.Tensor) -> int:
    """Autograd nodes reachable from ``out`` (torch's ``_get_graph_size``, deduplicated)."""
    seen: set[Any] = set()
    todo = deque([out.grad_fn])
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return len(seen)


@contextlib.contextmanager
def count_saved_tensors() -> Iterator[list[int]]:
    """Counts the tensors autograd really stores, outside any checkpointed region."""
    count = [0]

    def pack(x: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        yield count


class OpCounter(TorchDispatchMode):
    """Counts the calls of one aten op."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))


def run(model: nn.Module, *inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    out = model(*inputs, **kwargs)
    loss = out.sum()
    loss.backward()
    return loss.detach()


def assert_same_grads(expected: nn.Module, actual: nn.Module) -> None:
    for (name, p1), (_, p2) in zip(
        expected.named_parameters(), actual.named_parameters(), strict=True
    ):
        assert p1.grad is not None and p2.grad is not None, name
        assert torch.equal(p1.grad, p2.grad), name


def leaf(t: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
    return t.detach().clone().requires_grad_(requires_grad)


# --- models ---------------------------------------------------------------------------------


class ToyModel(nn.Module):
    def __init__(self, dim: int = 100) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, dim)
        self.seq = nn.Sequential(
            nn.ReLU(), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim), nn.ReLU()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(self.l1(x))


class RandomModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(100, 100))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.matmul(x, self.p))
        return torch.dropout(torch.tanh(y), 0.3, train=True) @ self.p


class MultiInputModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, xs: list[torch.Tensor], scale: float, bias: torch.Tensor) -> torch.Tensor:
        return sum((x @ self.w).sin() * scale for x in xs) + bias.exp()


class MultiOutputModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        h = (x @ self.w).tanh()
        return h.sin(), "not a tensor", {"cos": h.cos(), "none": None}, 3


class Block(nn.Module):
    """Linear-GELU-Linear residual MLP: the unit a transformer checkpoints."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class BlockStack(nn.Module):
    def __init__(self, n: int = 8, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class CountingLinear(nn.Linear):
    """Counts forward calls: the original ones and the recomputes."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.relu(super().forward(x))


def per_block(model: BlockStack, apply: Callable[[nn.Module], Any]) -> BlockStack:
    for block in model.blocks:
        apply(block)
    return model


# --- the seed scenarios ---------------------------------------------------------------------


def _check_tensor_only(device: torch.device) -> None:
    net = ToyModel().to(device)
    x = torch.randn(20, 100, device=device)
    ref, ckpt_net = net, copy.deepcopy(net)
    assert checkpoint(ckpt_net.seq) is ckpt_net.seq

    with count_saved_tensors() as saved_ref:
        out_ref, bytes_ref = forward_bytes(ref, leaf(x))
    with count_saved_tensors() as saved_ckpt:
        out_ckpt, bytes_ckpt = forward_bytes(ckpt_net, leaf(x))
    # Non-reentrant checkpoint keeps the graph's shape; what shrinks is what it stores.
    assert graph_size(out_ckpt) == graph_size(out_ref)
    assert saved_ckpt[0] < saved_ref[0]
    assert bytes_ckpt < bytes_ref
    out_ref.sum().backward()
    out_ckpt.sum().backward()
    assert_same_grads(ref, ckpt_net)


def test_tensor_only_cpu() -> None:
    _check_tensor_only(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tensor_only_gpu() -> None:
    _check_tensor_only(torch.device("cuda"))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_random_ops_replay_the_forward_rng(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    net = RandomModel().to(device)
    ckpt = checkpoint(copy.deepcopy(net))
    x = torch.randn(20, 100, device=device)
    torch.manual_seed(1)
    run(net, leaf(x))
    torch.manual_seed(1)
    run(ckpt, leaf(x))
    assert_same_grads(net, ckpt)


def test_random_without_preserved_rng_state_differs() -> None:
    net = RandomModel()
    ckpt = checkpoint(copy.deepcopy(net), preserve_rng_state=False)
    x = torch.randn(20, 100)
    torch.manual_seed(1)
    run(net, leaf(x))
    torch.manual_seed(1)
    run(ckpt, leaf(x))
    assert not torch.equal(net.p.grad, ckpt.p.grad)


def test_multi_args() -> None:
    net = MultiInputModel()
    ckpt = checkpoint(copy.deepcopy(net))
    xs = [torch.randn(4, 8) for _ in range(3)]
    bias = torch.randn(4, 8)
    inputs_ref = [leaf(x) for x in xs[:2]] + [leaf(xs[2], requires_grad=False)]
    inputs_ckpt = [leaf(x) for x in xs[:2]] + [leaf(xs[2], requires_grad=False)]
    bias_ref, bias_ckpt = leaf(bias), leaf(bias)
    run(net, inputs_ref, 0.5, bias_ref)
    run(ckpt, inputs_ckpt, 0.5, bias_ckpt)
    assert_same_grads(net, ckpt)
    for a, b in zip(inputs_ref[:2] + [bias_ref], inputs_ckpt[:2] + [bias_ckpt], strict=True):
        assert torch.equal(a.grad, b.grad)


def test_checkpoint_kwargs() -> None:
    class KwargsModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(
            self, x: torch.Tensor, *, gate: torch.Tensor, mode: str = "sin"
        ) -> torch.Tensor:
            h = self.lin(x) * gate
            return h.sin() if mode == "sin" else h.cos()

    net = KwargsModel()
    ckpt = checkpoint(copy.deepcopy(net))
    x, gate = torch.randn(4, 8), torch.randn(4, 8)
    gate_ref, gate_ckpt = leaf(gate), leaf(gate)
    run(net, leaf(x), gate=gate_ref, mode="cos")
    run(ckpt, leaf(x), gate=gate_ckpt, mode="cos")
    assert_same_grads(net, ckpt)
    assert torch.equal(gate_ref.grad, gate_ckpt.grad)


def test_multiple_and_non_tensor_outputs() -> None:
    net = MultiOutputModel()
    ckpt = checkpoint(copy.deepcopy(net))
    x = torch.randn(4, 8)
    for model in (net, ckpt):
        sin, text, extra, three = model(leaf(x))
        assert (text, extra["none"], three) == ("not a tensor", None, 3)
        (sin.sum() + extra["cos"].sum()).backward()
    assert_same_grads(net, ckpt)


def test_clears_state_on_error_in_forward() -> None:
    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x).relu()
            if self.fail:
                raise ValueError("boom in forward")
            return y

    net = Flaky()
    ckpt = checkpoint(copy.deepcopy(net), policy={aten.addmm.default})
    with pytest.raises(ValueError, match="boom in forward"):
        ckpt(torch.randn(4, 8))
    # Nothing left behind: no open call, no saved-tensor hooks, no dispatch mode.
    assert_nothing_left_behind(ckpt)
    net.fail = ckpt.fail = False
    x = torch.randn(4, 8)
    run(net, leaf(x))
    run(ckpt, leaf(x))
    assert_same_grads(net, ckpt)


# --- API surface ----------------------------------------------------------------------------


def test_disabled_hook_behaves_like_no_checkpoint() -> None:
    net = CountingLinear(8, 8)
    ckpt = checkpoint(copy.deepcopy(net))
    checkpoint.state(ckpt).enable_hook = False
    x = torch.randn(4, 8)
    with count_saved_tensors() as saved_ref:
        run(net, leaf(x))
    with count_saved_tensors() as saved_ckpt:
        run(ckpt, leaf(x))
    assert ckpt.calls == 1  # no recompute
    assert saved_ckpt[0] == saved_ref[0]  # autograd stored exactly what it stores without
    assert_same_grads(net, ckpt)
    checkpoint.state(ckpt).enable_hook = True
    run(ckpt, leaf(x))
    assert ckpt.calls == 3  # forward + recompute


def test_names_state_dict_and_registry_unchanged() -> None:
    net = ToyModel(8)
    names = [n for n, _ in net.named_parameters()]
    keys = list(net.state_dict())
    assert checkpoint(net.seq) is net.seq
    assert [n for n, _ in net.named_parameters()] == names
    assert list(net.state_dict()) == keys
    assert list(get_registry(net.seq) or {}) == ["checkpoint"]
    assert checkpoint.state(net.l1) is None
    with pytest.raises(AssertionError, match="checkpoint"):
        checkpoint(net.seq)


def test_deepcopy_of_a_checkpointed_module_recomputes_itself() -> None:
    original = checkpoint(CountingLinear(8, 8))
    clone = copy.deepcopy(original)
    run(clone, torch.randn(4, 8))
    assert (original.calls, clone.calls) == (0, 2)
    assert get_registry(clone) is not None and checkpoint.state(clone) is not None


def test_other_forward_pre_hooks_run_once_per_call_and_recompute() -> None:
    def double_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * 2,)

    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    ckpt = copy.deepcopy(net)
    net.register_forward_pre_hook(double_input)
    ckpt.register_forward_pre_hook(double_input)  # registered before checkpoint
    checkpoint(ckpt)
    x = torch.randn(4, 8)
    run(net, leaf(x))
    run(ckpt, leaf(x))  # the recompute must double the caller's input, not the doubled one
    assert_same_grads(net, ckpt)


def test_argument_validation() -> None:
    with pytest.raises(NotImplementedError, match="non-reentrant"):
        checkpoint(nn.Linear(2, 2), use_reentrant=True)
    with pytest.raises(ValueError, match="bogus, other"):
        checkpoint(nn.Linear(2, 2), bogus=1, other=2)
    with pytest.raises(ValueError, match="determinism_check"):
        checkpoint(nn.Linear(2, 2), determinism_check="strict")
    with pytest.raises(ValueError, match="offload"):
        checkpoint(nn.Linear(2, 2), offload=True, policy={aten.mm.default})
    with pytest.raises(TypeError, match="nn.Module"):
        checkpoint([nn.Linear(2, 2)])
    failed = nn.Linear(2, 2)
    with pytest.raises(ValueError):
        checkpoint(failed, bogus=1)
    assert checkpoint.state(failed) is None and not failed._forward_hooks  # left as it was
    checkpoint(nn.Linear(2, 2), use_reentrant=False)  # torch's spelling of the default


def test_use_reentrant_message_contains_torchs_sentence() -> None:
    """Code (and torch's own test) matching torch's message still matches plait's."""
    torch_words = "use_reentrant=True is not supported in composable checkpoint"
    with pytest.raises(NotImplementedError, match=torch_words):
        checkpoint(nn.Linear(2, 2), use_reentrant=True)


def test_use_reentrant_message_contains_torchs_whole_refusal() -> None:
    """torch's ``test_checkpoint_kwargs`` matches both of torch's sentences (issue 40)."""
    torch_refusal = (
        "use_reentrant=True is not supported in composable checkpoint. "
        "Please use torch.utils.checkpoint.checkpoint instead."
    )
    with pytest.raises(NotImplementedError, match=re.escape(torch_refusal)):
        checkpoint(nn.Linear(2, 2), use_reentrant=True)


def test_context_fn_contexts_wrap_forward_and_recompute() -> None:
    entered: list[str] = []

    @contextlib.contextmanager
    def tag(name: str) -> Iterator[None]:
        entered.append(name)
        yield

    ckpt = checkpoint(nn.Linear(8, 8), context_fn=lambda: (tag("forward"), tag("recompute")))
    out = ckpt(torch.randn(4, 8, requires_grad=True))
    assert entered == ["forward"]
    out.sum().backward()
    assert entered == ["forward", "recompute"]


class Guarded(nn.Module):
    """Raises unless ``allowed``: a context from ``context_fn`` switches it on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.allowed = False
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if not self.allowed:
            raise RuntimeError(f"call {self.calls} ran outside its context")
        return self.lin(x).sin()


@contextlib.contextmanager
def allowing(module: Guarded, exits: list[str], name: str) -> Iterator[None]:
    module.allowed = True
    try:
        yield
    finally:
        module.allowed = False
        exits.append(name)


def assert_nothing_left_behind(module: nn.Module) -> None:
    state = checkpoint.state(module)
    assert state.open_calls == [] and state.replaying is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert _get_current_dispatch_mode() is None


@pytest.mark.parametrize("only", ["forward", "recompute"])
def test_each_context_covers_only_its_own_pass_and_always_exits(only: str) -> None:
    net = Guarded()
    exits: list[str] = []

    def context_fn() -> tuple[Any, Any]:
        forward_ctx = allowing(net, exits, "forward") if only == "forward" else None
        recompute_ctx = allowing(net, exits, "recompute") if only == "recompute" else None
        return forward_ctx or contextlib.nullcontext(), recompute_ctx or contextlib.nullcontext()

    checkpoint(net, context_fn=context_fn)
    x = torch.randn(4, 8, requires_grad=True)
    if only == "recompute":  # the forward runs without the recompute's context
        with pytest.raises(RuntimeError, match="call 1 ran outside"):
            net(x)
        assert exits == []
    else:  # the forward's context is left when the forward ends; the recompute runs without
        out = net(x)
        assert exits == ["forward"] and not net.allowed
        with pytest.raises(RuntimeError, match="call 2 ran outside"):
            out.sum().backward()
    assert_nothing_left_behind(net)


def test_error_in_the_recompute_leaves_nothing_behind() -> None:
    net = Guarded()
    ckpt = copy.deepcopy(net)
    checkpoint(ckpt, policy={aten.addmm.default})
    net.allowed = ckpt.allowed = True
    x = torch.randn(4, 8)
    out = ckpt(leaf(x))
    ckpt.allowed = False
    rng_before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="call 2 ran outside"):
        out.sum().backward()
    assert_nothing_left_behind(ckpt)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the replayed RNG state was undone
    ckpt.allowed = True  # the next step runs and recomputes normally
    ckpt.zero_grad()
    run(net, leaf(x))
    run(ckpt, leaf(x))
    assert_same_grads(net, ckpt)


def test_no_grad_forward_does_no_work() -> None:
    calls: list[int] = []

    def context_fn() -> tuple[Any, Any]:
        calls.append(1)
        return contextlib.nullcontext(), contextlib.nullcontext()

    ckpt = checkpoint(CountingLinear(8, 8), context_fn=context_fn)
    for ctx in (torch.no_grad(), torch.inference_mode()):
        with ctx:
            out = ckpt(torch.randn(4, 8))
        assert out.grad_fn is None
    assert calls == [] and checkpoint.state(ckpt).open_calls == []


# --- behaviours beyond the seed -------------------------------------------------------------


def test_inputs_not_requiring_grad() -> None:
    net = ToyModel(16)
    ckpt = copy.deepcopy(net)
    checkpoint(ckpt.l1)
    checkpoint(ckpt.seq)
    x = torch.randn(4, 16)  # the first region sees an input without grad
    run(net, x)
    run(ckpt, x)
    assert_same_grads(net, ckpt)


def test_backward_twice_with_retain_graph() -> None:
    net = RandomModel()
    ckpt = checkpoint(copy.deepcopy(net))
    x = torch.randn(20, 100)
    for model in (net, ckpt):
        torch.manual_seed(3)
        loss = model(leaf(x)).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert_same_grads(net, ckpt)


def test_module_called_twice_recomputes_each_call() -> None:
    net = CountingLinear(8, 8)
    ckpt = checkpoint(copy.deepcopy(net))
    x = torch.randn(4, 8)
    for model in (net, ckpt):
        out = model(model(leaf(x)))
        out.sum().backward()
    assert ckpt.calls == 4  # two calls, each recomputed once
    assert_same_grads(net, ckpt)


def test_nested_checkpoints() -> None:
    net = BlockStack(n=3)
    nested = copy.deepcopy(net)
    checkpoint(nested)
    per_block(nested, checkpoint)
    x = torch.randn(8, 64)
    out, nested_bytes = forward_bytes(nested, leaf(x))
    out.sum().backward()
    run(net, leaf(x))
    assert_same_grads(net, nested)
    # The children's inputs are saved through the parent's hooks: only the output remains.
    assert nested_bytes == out.numel() * out.element_size()


def test_early_stop_skips_the_rest_of_the_forward() -> None:
    class Tail(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.tails = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x).relu()
            self.tails += 1  # after the last op that saves a tensor
            return y * 2.0

    for early_stop, tails in ((True, 1), (False, 2)):
        ckpt = checkpoint(Tail(), early_stop=early_stop)
        run(ckpt, torch.randn(4, 8))
        assert ckpt.tails == tails


def test_autocast_is_replayed_in_recompute() -> None:
    class Recorder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin1, self.lin2 = nn.Linear(8, 16), nn.Linear(16, 8)
            self.dtypes: list[torch.dtype] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin1(x)
            self.dtypes.append(h.dtype)
            return self.lin2(h.relu())

    net = Recorder()
    ckpt = checkpoint(copy.deepcopy(net))
    x = torch.randn(4, 8)
    for model in (net, ckpt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(leaf(x))
        out.float().sum().backward()  # backward outside autocast
    assert ckpt.dtypes == [torch.bfloat16, torch.bfloat16]
    assert_same_grads(net, ckpt)


def test_autograd_grad_and_unpack_outside_backward() -> None:
    ckpt = checkpoint(ToyModel(8))
    x = leaf(torch.randn(4, 8))
    out = ckpt(x)
    (gx,) = torch.autograd.grad(out.sum(), x, retain_graph=True)
    ref = ToyModel(8)
    ref.load_state_dict(ckpt.state_dict())
    (gx_ref,) = torch.autograd.grad(ref(x).sum(), x)
    assert torch.equal(gx, gx_ref)
    # Reading a saved tensor outside backward recomputes it too (the ReLU's result).
    saved = out.grad_fn._saved_result
    assert torch.equal(saved, out.detach())


@pytest.mark.parametrize("early_stop", [True, False])
def test_backward_inside_a_checkpointed_forward(early_stop: bool) -> None:
    class GradInside(nn.Module):  # torch's composable checkpoint fails on this one
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x).sin()
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            return (g * y).exp()

    net = GradInside()
    ckpt = checkpoint(copy.deepcopy(net), early_stop=early_stop)
    x = torch.randn(4, 8)
    run(net, leaf(x))
    run(ckpt, leaf(x))
    assert_same_grads(net, ckpt)


def test_regions_are_freed_with_the_graph_without_the_cycle_collector() -> None:
    regions: list[weakref.ref[Any]] = []

    class Spy(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            call = checkpoint.state(self).open_calls[-1]
            if call is not None:  # None while backward recomputes
                regions.append(weakref.ref(call))
            return super().forward(x).relu()

    model = nn.Sequential(Spy(8, 8), Spy(8, 8))
    for layer in model:
        checkpoint(layer, policy={aten.addmm.default})
    checkpoint(model)
    x = torch.randn(4, 8, requires_grad=True)
    gc.disable()
    try:
        out = model(x)
        assert len(regions) == 2 and all(r() is not None for r in regions)
        out.sum().backward()
        del out
        assert all(r() is None for r in regions)
        model(x)  # dropped without backward
        assert all(r() is None for r in regions)
    finally:
        gc.enable()


def test_inplace_change_of_input_is_detected() -> None:
    ckpt = checkpoint(nn.Linear(8, 8))
    x = torch.randn(4, 8)
    out = ckpt(x)
    x.add_(1.0)  # backward would recompute from the modified input
    with pytest.raises(RuntimeError, match="inplace operation"):
        out.sum().backward()


class ReluOnRecompute(nn.Module):
    """Modifies its input in place only when backward re-runs it (torch's
    test_checkpoint_kwargs model)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            x.relu_()
        return self.lin(x + 1.0)


@pytest.mark.parametrize(("check", "error"), [("default", CheckpointError), ("none", RuntimeError)])
def test_recompute_that_modifies_an_input_in_place(check: str, error: type[Exception]) -> None:
    """Under the determinism check a CheckpointError, as torch's (whose check trips on the
    tensors the change shifts); without it a RuntimeError, as torch's autograd raises. Both
    name the module and the fix."""
    ckpt = checkpoint(ReluOnRecompute(), determinism_check=check)
    out = ckpt(torch.randn(1, 2, requires_grad=True).clone())
    with pytest.raises(error, match="recomputing ReluOnRecompute modified one of its inputs") as e:
        out.sum().backward()
    assert isinstance(e.value, CheckpointError) == (check == "default")
    assert "clone the input first" in str(e.value)


# --- determinism check ----------------------------------------------------------------------


class Switchy(nn.Module):
    """Takes another path on recompute when ``variant`` changes between forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.variant = "same"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # saves x and the weight
        if self.variant == "narrower":
            h = h[:, :4]
        elif self.variant == "double":
            h = h.double()
        h = h.sin()  # saves its input
        if self.variant == "fewer":
            return h
        out = h.exp()  # saves its result
        if self.variant == "more":
            out.cos()  # saves one more tensor, after all the others
        return out


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("narrower", r"tensor #\d.*\n.*shape=\(4, 8\).*\n.*shape=\(4, 4\)"),
        ("double", r"dtype=torch.float32.*\n.*dtype=torch.float64"),
        ("fewer", "fewer tensors than its forward did"),
        ("more", "more tensors than its forward did"),
    ],
)
def test_recompute_mismatch_raises_checkpoint_error(variant: str, message: str) -> None:
    ckpt = checkpoint(Switchy(), early_stop=False)
    out = ckpt(torch.randn(4, 8, requires_grad=True))
    ckpt.variant = variant
    with pytest.raises(CheckpointError, match=message):
        out.sum().backward()
    assert issubclass(CheckpointError, RuntimeError)


def test_checkpoint_error_is_caught_as_torchs_base_class() -> None:
    """plait imports nothing from torch.utils.checkpoint (docs/architecture.md), so its
    error is not a subclass of torch's; both are RuntimeErrors, which is what portable
    handlers catch."""
    import plait

    assert issubclass(torch_checkpoint.CheckpointError, RuntimeError)
    ckpt = checkpoint(Switchy())
    out = ckpt(torch.randn(4, 8, requires_grad=True))
    ckpt.variant = "double"
    try:
        out.sum().backward()
    except RuntimeError as error:
        assert isinstance(error, plait.CheckpointError)
        assert "recomputing Switchy" in str(error)
    else:
        raise AssertionError("the recompute mismatch raised nothing")


def test_debug_names_the_op_that_saved_the_mismatching_tensor() -> None:
    ckpt = checkpoint(Switchy(), debug=True)
    out = ckpt(torch.randn(4, 8, requires_grad=True))
    ckpt.variant = "narrower"
    with pytest.raises(CheckpointError, match=r"tensor #\d+ \(saved by 'sin'.*'sin' on recompute"):
        out.sum().backward()


def test_determinism_check_none_skips_the_check() -> None:
    net = Switchy()
    ckpt = checkpoint(copy.deepcopy(net), determinism_check="none", early_stop=False)
    x = torch.randn(4, 8)
    out = ckpt(leaf(x))
    ckpt.variant = "more"  # one more saved tensor at the end: harmless, and not checked
    out.sum().backward()
    run(net, leaf(x))
    assert_same_grads(net, ckpt)


# --- references and memory ------------------------------------------------------------------


def test_matches_torch_non_reentrant_checkpoint() -> None:
    net = BlockStack(n=4)
    x = torch.randn(16, 64)
    ours = per_block(copy.deepcopy(net), checkpoint)
    composable = per_block(copy.deepcopy(net), torch_composable.checkpoint)
    functional = copy.deepcopy(net)

    def functional_forward(x: torch.Tensor) -> torch.Tensor:
        for block in functional.blocks:
            x = torch_checkpoint.checkpoint(block, x, use_reentrant=False)
        return functional.head(x)

    out_ours, bytes_ours = forward_bytes(ours, leaf(x))
    out_composable, bytes_composable = forward_bytes(composable, leaf(x))
    out_ours.sum().backward()
    out_composable.sum().backward()
    functional_forward(leaf(x)).sum().backward()
    assert bytes_ours == bytes_composable
    assert_same_grads(composable, ours)
    assert_same_grads(functional, ours)


def test_memory_of_a_checkpointed_block_stack() -> None:
    n, batch, dim, hidden = 8, 32, 128, 512
    net = BlockStack(n, dim, hidden)
    x = torch.randn(batch, dim)
    block_input = batch * dim * 4

    out, bytes_ref = forward_bytes(net, leaf(x))
    nodes_ref = graph_size(out)
    out.sum().backward()

    ckpt = per_block(copy.deepcopy(net), checkpoint)
    out, bytes_ckpt = forward_bytes(ckpt, leaf(x))
    assert graph_size(out) == nodes_ref  # non-reentrant: same graph, emptier nodes
    out.sum().backward()
    assert_same_grads(net, ckpt)

    # What remains: the inputs of blocks 1..n-1, the head's input and the output.
    # (Block 0's input is the caller's tensor, not allocated by the forward.)
    assert bytes_ckpt == (n - 1) * block_input + block_input + block_input
    # Without checkpointing each block also keeps its two hidden activations.
    assert bytes_ref == bytes_ckpt + n * 2 * batch * hidden * 4
    assert bytes_ckpt * 7 < bytes_ref


def test_selective_checkpoint_keeps_only_the_chosen_ops() -> None:
    n, batch, dim, hidden = 4, 16, 64, 256
    net = BlockStack(n, dim, hidden)
    x = torch.randn(batch, dim)
    full = per_block(copy.deepcopy(net), checkpoint)
    sac = per_block(copy.deepcopy(net), lambda b: checkpoint(b, policy={aten.addmm.default}))

    def measure(model: nn.Module) -> tuple[int, int]:
        out, nbytes = forward_bytes(model, leaf(x))
        with OpCounter(aten.addmm.default) as counter:
            out.sum().backward()
        return nbytes, counter.calls

    (none_bytes, none_addmm), (full_bytes, full_addmm), (sac_bytes, sac_addmm) = (
        measure(net),
        measure(full),
        measure(sac),
    )
    assert full_bytes < sac_bytes < none_bytes
    # Each block keeps its two addmm outputs: the hidden pre-activation and the projection.
    assert sac_bytes - full_bytes == n * batch * (hidden + dim) * 4
    # The full recompute re-runs each block's first addmm (early stop skips the second);
    # the selective one re-runs none.
    assert (none_addmm, full_addmm, sac_addmm) == (0, n, 0)
    assert_same_grads(net, full)
    assert_same_grads(net, sac)


def test_selective_checkpoint_matches_torch() -> None:
    net = BlockStack(n=3)
    x = torch.randn(16, 64)
    ops = [aten.addmm.default, aten.gelu.default]
    ours = per_block(copy.deepcopy(net), lambda b: checkpoint(b, policy=set(ops)))
    context_fn = lambda: torch_checkpoint.create_selective_checkpoint_contexts(ops)  # noqa: E731
    theirs = per_block(
        copy.deepcopy(net), lambda b: torch_composable.checkpoint(b, context_fn=context_fn)
    )
    out_ours, bytes_ours = forward_bytes(ours, leaf(x))
    out_theirs, bytes_theirs = forward_bytes(theirs, leaf(x))
    out_ours.sum().backward()
    out_theirs.sum().backward()
    assert bytes_ours == bytes_theirs
    assert_same_grads(theirs, ours)


def test_selective_policy_never_keeps_random_ops() -> None:
    net = RandomModel()
    keep_all = checkpoint(copy.deepcopy(net), policy=lambda op: True)
    x = torch.randn(20, 100)
    for model in (net, keep_all):
        torch.manual_seed(5)
        loss = model(leaf(x)).sum()
        loss.backward(retain_graph=True)
        loss.backward()  # replays the kept outputs a second time
    assert_same_grads(net, keep_all)


@pytest.mark.parametrize(
    ("op", "message"),
    [
        (aten.mm, r"op packet.*aten\.mm\.default"),
        (aten.native_dropout.default, "random"),
        (aten.t.default, "view"),
        (aten.relu_.default, "in place"),
        ("mm", "OpOverload"),
    ],
)
def test_selective_policy_validation(op: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checkpoint(nn.Linear(2, 2), policy={op})


def test_selective_kept_output_modified_in_place_is_recomputed() -> None:
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ self.w).mul_(2.0).sin()  # the kept mm output is changed in place

    net = InPlace()
    ckpt = checkpoint(copy.deepcopy(net), policy={aten.mm.default})
    x = torch.randn(4, 8)
    run(net, x)
    with OpCounter(aten.mm.default) as counter:
        run(ckpt, x)
    assert counter.calls == 3  # forward, recompute (not replayed), weight grad
    assert_same_grads(net, ckpt)


# --- offloading -----------------------------------------------------------------------------


def test_offload_keeps_activations_and_gradients_exact() -> None:
    net = BlockStack(n=3)
    offloaded = per_block(copy.deepcopy(net), lambda b: checkpoint(b, offload=True))
    x = torch.randn(8, 64)
    torch.manual_seed(0)
    run(net, leaf(x))
    with OpCounter(aten.addmm.default) as counter:
        run(offloaded, leaf(x))
    assert counter.calls == 2 * 3 + 1  # forward only: nothing is recomputed
    assert_same_grads(net, offloaded)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_moves_activations_to_pinned_host_memory() -> None:
    net = BlockStack(n=3).cuda()
    offloaded = per_block(copy.deepcopy(net), lambda b: checkpoint(b, offload=True))
    x = torch.randn(8, 64, device="cuda")

    def device_bytes(model: nn.Module) -> int:
        before = torch.cuda.memory_allocated()
        out = model(leaf(x))
        kept = torch.cuda.memory_allocated() - before
        out.sum().backward()
        return kept

    assert device_bytes(offloaded) < device_bytes(net)
    assert_same_grads(net, offloaded)


def _offload_under_tensor_parallelism(device: str) -> None:
    """Offloading a tensor-parallel module: its DTensor parameters stay (their local
    tensors are resident) and its DTensor activations travel as their local tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    group = dist.new_group(backend="nccl") if device == "cuda" else dist.group.WORLD
    mesh = DeviceMesh.from_group(group, device)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).to(device)
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    checkpoint(model, offload=True)
    x = torch.randn(4, 8, device=device)
    torch.testing.assert_close(model(x), ref(x))
    model(x).sum().backward()
    ref(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)  # type: ignore[union-attr]


def test_offload_under_tensor_parallelism() -> None:
    run_on_ranks(2, _offload_under_tensor_parallelism, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_under_tensor_parallelism_on_cuda() -> None:
    run_on_ranks(1, _offload_under_tensor_parallelism, "cuda")


@pytest.mark.parametrize(
    "case",
    [
        test_tensor_only_cpu,
        test_multi_args,
        test_nested_checkpoints,
        test_inplace_change_of_input_is_detected,
    ],
    ids=lambda f: f.__name__,
)
def test_on_torch_without_make_saved_tensor(
    monkeypatch: pytest.MonkeyPatch, case: Callable[[], None]
) -> None:
    # torch before 2.13 (the GPU image's 2.11) lacks torch._C._autograd._make_saved_tensor:
    # inputs are then saved through the active saved-tensor hooks by hand, with the same
    # gradients, nested checkpoints freeing their inputs, and in-place changes caught.
    # plait.checkpoint is also the function plait exports: import the module by its name.
    region = importlib.import_module("plait.checkpoint.region")
    monkeypatch.setattr(region, "_MAKE_SAVED", None)
    case()
