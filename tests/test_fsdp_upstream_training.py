"""``fully_shard`` in the patterns of torch's ``test_fully_shard_training.py`` that plait
used to refuse: units of several modules under a parent (tied weights), chunked losses
that call the output head on its own after the model's forward, a child unit run alone
after the root, recovery after an exception.

The oracle is torch's own ``fully_shard`` on the same model, inputs and ranks (bitwise
where the maths allows), and a single-process model where the pattern allows one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from plait import checkpoint
from plait.fsdp import ShardedState, fully_shard
from plait.fsdp.state import fsdp_state_of

from harness import run_on_ranks
from models import MLP

DIM, VOCAB, CHUNKS, STEPS = 8, 13, 2, 3  # 13 rows: uneven over 2 ranks

Shard = Callable[..., Any]


class ChunkedHead(nn.Module):
    """Embedding, body, norm, head; ``skip_head`` stops before the head (chunked loss)."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, DIM, bias=False)
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))  # (B, T, DIM)
        return h if skip_head else self.head(h)


def _model(tie: bool) -> ChunkedHead:
    torch.manual_seed(0)
    return ChunkedHead(tie)


def _shard(shard: Shard, model: ChunkedHead, grouping: str, **kwargs: Any) -> ChunkedHead:
    """``grouping``: "grouped" = [norm, head] one unit (torchtitan), "tied" = [embed, norm,
    head] one unit (tied weights), "separate" = one unit each."""
    if grouping == "tied":
        shard(model.body, **kwargs)
        shard([model.embed, model.norm, model.head], **kwargs)
    else:
        shard(model.embed, **kwargs)
        shard(model.body, **kwargs)
        if grouping == "grouped":
            shard([model.norm, model.head], **kwargs)
        else:
            shard(model.norm, **kwargs)
            shard(model.head, **kwargs)
    shard(model, **kwargs)
    return model


def _tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randint(0, VOCAB, (2, 6), generator=g)


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _average_grads(model: nn.Module) -> None:
    """What data parallelism does to a single-process model's gradients."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())


def _chunked_step(model: ChunkedHead, tokens: torch.Tensor) -> tuple[float, list[Any]]:
    """torchtitan's chunked loss: forward without the head, then head + backward per chunk
    of the detached hidden state, then the body's backward. Returns the loss and the head
    weight's gradient after each chunk."""
    h = model(tokens, skip_head=True)
    grads, total, snapshots = [], 0.0, []
    for chunk in torch.chunk(h.detach(), CHUNKS, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        loss = model.head(chunk).square().mean()
        loss.backward()
        total += loss.item()
        grads.append(chunk.grad)
        snapshots.append(_full(model.head.weight.grad))
    h.backward(torch.cat(grads, dim=1))
    return total, snapshots


def _train_chunked(shard: Shard | None, tie: bool, grouping: str, raf: bool) -> dict[str, Any]:
    model = _model(tie)
    if shard is not None:
        _shard(shard, model, grouping, reshard_after_forward=raf)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, snapshots = [], []
    for step in range(STEPS):
        loss, chunk_grads = _chunked_step(model, _tokens(step))
        if shard is None:
            _average_grads(model)
            chunk_grads = [g.clone() for g in chunk_grads]
            for g in chunk_grads:
                dist.all_reduce(g)
                g.div_(dist.get_world_size())
        losses.append(loss)
        snapshots.append(chunk_grads)
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "head_grads": snapshots, "grads": grads, "params": params}


def _assert_same(ours: Any, theirs: Any, where: str, atol: float = 0.0) -> None:
    if isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), where
        for key in ours:
            _assert_same(ours[key], theirs[key], f"{where}.{key}", atol)
    elif isinstance(ours, list):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _assert_same(a, b, f"{where}[{i}]", atol)
    elif isinstance(ours, torch.Tensor):
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=0 if atol == 0 else 1e-5)
    else:
        assert ours == pytest.approx(theirs, abs=atol, rel=0 if atol == 0 else 1e-5), where


def _chunked_loss(tie: bool, grouping: str, raf: bool) -> None:
    ours = _train_chunked(fully_shard, tie, grouping, raf)
    theirs = _train_chunked(torch_fully_shard, tie, grouping, raf)
    _assert_same(ours, theirs, "plait vs torch")
    single = _train_chunked(None, tie, grouping, raf)
    _assert_same(ours, single, "plait vs one process", atol=1e-5)


@pytest.mark.parametrize(
    ("tie", "grouping", "raf"),
    [
        (False, "grouped", True),
        (False, "grouped", False),
        (False, "separate", True),
        (True, "tied", True),
        (True, "tied", False),
    ],
)
def test_chunked_loss_calls_the_head_alone_after_forward(
    tie: bool, grouping: str, raf: bool
) -> None:
    run_on_ranks(2, _chunked_loss, tie, grouping, raf)


# --- units of several modules under a parent ---------------------------------------------


def _train_full(shard: Shard | None, tie: bool, grouping: str, raf: bool) -> dict[str, Any]:
    model = _model(tie)
    if shard is not None:
        _shard(shard, model, grouping, reshard_after_forward=raf)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        logits = model(_tokens(step))  # (B, T, VOCAB)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), _tokens(step + 7).flatten())
        loss.backward()
        if shard is None:
            _average_grads(model)
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()}}


def _grouped_under_parent(tie: bool, grouping: str, raf: bool) -> None:
    ours = _train_full(fully_shard, tie, grouping, raf)
    _assert_same(ours, _train_full(torch_fully_shard, tie, grouping, raf), "plait vs torch")
    _assert_same(ours, _train_full(None, tie, grouping, raf), "plait vs one process", 1e-5)


@pytest.mark.parametrize(
    ("tie", "grouping", "raf"),
    [(False, "grouped", True), (True, "tied", True), (True, "tied", False)],
)
def test_a_unit_of_several_modules_under_a_parent(tie: bool, grouping: str, raf: bool) -> None:
    # issue 14 #2 / issue 18 #1: fully_shard([norm, head]) then fully_shard(model)
    run_on_ranks(2, _grouped_under_parent, tie, grouping, raf)


def _tied_uneven_rows_all_train() -> None:
    model = _shard(fully_shard, _model(tie=True), "tied")
    before = _full(model.embed.weight)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        model(_tokens(step)).sum().backward()
        opt.step()
        opt.zero_grad()
    after = _full(model.embed.weight)
    assert before is not None and after is not None
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert model.embed.weight is model.head.weight  # still tied


def test_tied_weights_in_one_unit_train_every_row() -> None:
    # torch's test_train_shared_params_uneven_shard: 13 rows over 2 ranks
    run_on_ranks(2, _tied_uneven_rows_all_train)


class _CastCheck(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM, bias=False)
        self.b = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).float())  # b sees fp32: only its own input cast saves it


def _grouped_cast_forward_inputs() -> tuple[torch.dtype, bool]:
    from plait import MixedPrecisionPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = _CastCheck()
    fully_shard([model.a, model.b], mp_policy=bf16)
    fully_shard(model, mp_policy=bf16)
    out = model(torch.randn(2, DIM))
    out.sum().backward()
    return out.dtype, all(p.grad is not None for p in model.parameters())


def test_every_module_of_a_unit_casts_its_inputs() -> None:
    # torch's test_grouped_module_cast_forward_inputs
    assert run_on_ranks(2, _grouped_cast_forward_inputs) == [(torch.bfloat16, True)] * 2


# --- a unit run alone, partial forwards, toggles, recovery ----------------------------------


def _non_root_forward_backward(shard: Shard | None) -> list[Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*(MLP(DIM, 16) for _ in range(3)))
    if shard is not None:
        for mlp in model:
            shard(mlp)
        shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(4, DIM)
    out = []
    for run in (model, model[0]):  # the root, then its first child alone
        loss = run(x).sum()
        loss.backward()
        if shard is None:
            _average_grads(model)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    out.append(model(x).sum().item())
    return out


def _non_root() -> None:
    ours = _non_root_forward_backward(fully_shard)
    _assert_same(ours, _non_root_forward_backward(torch_fully_shard), "plait vs torch")
    _assert_same(ours, _non_root_forward_backward(None), "plait vs one process", 1e-5)


def test_a_child_unit_runs_forward_and_backward_alone_after_the_root() -> None:
    # torch's test_non_root_forward_backward
    run_on_ranks(2, _non_root)


def _accumulate_chunked(grouping: str, raf: bool) -> dict[str, Any]:
    model = _shard(fully_shard, _model(tie=False), grouping, reshard_after_forward=raf)
    for micro in range(3):
        last = micro == 2
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        _chunked_step(model, _tokens(micro))
    return {n: _full(p.grad) for n, p in model.named_parameters()}


def _grad_accum_chunked(raf: bool) -> None:
    grouped = _accumulate_chunked("grouped", raf)
    _assert_same(grouped, _accumulate_chunked("separate", raf), "grouped vs separate", 1e-6)


@pytest.mark.parametrize("raf", [True, False])
def test_chunked_loss_with_gradient_accumulation(raf: bool) -> None:
    # torch's test_partial_group_forward_grad_accum_chunked
    run_on_ranks(2, _grad_accum_chunked, raf)


def _reshard_toggle(tie: bool, initial: bool) -> None:
    model = _model(tie)
    if tie:
        fully_shard(model.body)
        fully_shard([model.embed, model.norm, model.head], reshard_after_forward=initial)
    else:
        fully_shard(model.embed)
        fully_shard(model.body)
        fully_shard([model.norm, model.head], reshard_after_forward=initial)
    fully_shard(model)
    unit = fsdp_state_of(model.head)
    assert unit is not None and unit.unit is not None
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        h = model(_tokens(step), skip_head=True)
        model.head.set_reshard_after_forward(False)
        model.head.set_reshard_after_backward(False)
        grads = []
        for chunk in torch.chunk(h.detach(), CHUNKS, dim=1):
            chunk = chunk.contiguous().requires_grad_(True)
            model.head(chunk).sum().backward()
            grads.append(chunk.grad)
            assert unit.unit.sharded_state is ShardedState.UNSHARDED, "resharded mid-loop"
        model.head.set_reshard_after_forward(True)
        model.head.set_reshard_after_backward(True)
        model.head.reshard()
        assert unit.unit.sharded_state is ShardedState.SHARDED
        h.backward(torch.cat(grads, dim=1))
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)


@pytest.mark.parametrize(("tie", "initial"), [(False, False), (False, True), (True, False)])
def test_head_kept_unsharded_over_the_chunks(tie: bool, initial: bool) -> None:
    # torch's test_partial_group_reshard_toggle (torchtitan's ChunkedCELoss)
    run_on_ranks(2, _reshard_toggle, tie, initial)


def _double_partial_forward() -> tuple[bool, bool, bool]:
    model = _model(tie=False)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    h1 = model(_tokens(0), skip_head=True)
    h2 = model(_tokens(1), skip_head=True)
    (h1.sum() + h2.sum()).backward()
    grads = dict((n, p.grad) for n, p in model.named_parameters())
    embed_grad = grads["embed.weight"]
    return (
        embed_grad is not None and bool(torch.isfinite(embed_grad.to_local()).all()),
        grads["norm.weight"] is not None,
        grads["head.weight"] is None,  # the head never ran
    )


def test_two_partial_forwards_then_one_backward() -> None:
    # torch's test_double_partial_forward_then_backward
    assert run_on_ranks(2, _double_partial_forward) == [(True, True, True)] * 2


class _Raiser(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("boom")
        return self.inner(x)


def _reset_after_exception() -> tuple[str, str, bool]:
    model = _model(tie=False)
    model.body = _Raiser(model.body)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    model.body.armed = True
    with pytest.raises(RuntimeError, match="boom"):
        model(_tokens(0), skip_head=True)
    model.body.armed = False
    with pytest.raises(RuntimeError) as not_root:
        model.head.reset_iter_state()
    model.reset_iter_state()
    model(_tokens(1)).sum().backward()
    states = {s.training_state.name for s in fully_shard.state(model).all_states}
    return (
        str(not_root.value),
        ",".join(sorted(states)),
        all(p.grad is not None for p in model.parameters()),
    )


def test_reset_iter_state_recovers_after_an_exception() -> None:
    # torch's test_reset_iter_state_after_exception
    for message, states, grads in run_on_ranks(2, _reset_after_exception):
        assert "root" in message
        assert states == "IDLE" and grads


def _tied_in_separate_units() -> str:
    model = _model(tie=True)
    fully_shard(model.embed)
    fully_shard(model.head)
    fully_shard(model)
    with pytest.raises(ValueError) as info:
        model(_tokens(0))
    return str(info.value)


def test_tied_weights_in_separate_units_are_refused() -> None:
    # torch's test_shared_params_separate_fsdp_groups_error
    message = run_on_ranks(2, _tied_in_separate_units)[0]
    assert "already managed by another fully_shard unit" in message
    assert "fully_shard([module_a, module_b])" in message


def _layer_by_layer_no_false_positive() -> None:
    import gc

    model = nn.Sequential()
    for _ in range(6):
        block = MLP(DIM, 16)
        model.append(block)
        fully_shard(block)
        gc.collect()  # freed originals: their ids may be reused by the next block's
    fully_shard(model)
    model(torch.randn(2, DIM)).sum().backward()


def test_many_units_sharded_one_by_one_are_not_mistaken_for_ties() -> None:
    # torch's test_layer_by_layer_shard_no_false_positive
    run_on_ranks(2, _layer_by_layer_no_false_positive)


# --- activation checkpointing with the module groupings of torch's test ----------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(DIM, 16)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class _Tiny(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(6, DIM)
        self.layers = nn.ModuleList(_Block() for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.output.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _ac_grouping(
    shard: Shard, ckpt: Callable[[nn.Module], Any] | None, grouping: str, raf: bool
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Tiny(tie=grouping != "mem_eff")
    if ckpt is not None:
        for layer in model.layers:
            ckpt(layer)
    if grouping == "mem_eff":
        shard(model.layers[0], reshard_after_forward=raf)
        shard([model.layers[1], model.layers[2]], reshard_after_forward=raf)
        shard([model.tok, model.pos], reshard_after_forward=raf)
        model.tok.set_unshard_in_backward(False)  # an embedding's backward needs no weights
        shard([model.norm, model.output], reshard_after_forward=raf)
    elif grouping == "mem_eff_weight_tied":
        shard([model.tok, model.output], reshard_after_forward=raf)
        for layer in model.layers:
            shard(layer, reshard_after_forward=raf)
    else:
        for layer in model.layers:
            shard(layer, reshard_after_forward=raf)
    shard(model, reshard_after_forward=raf)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = model(_tokens(step)).sum()
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()}}


def _ac_parity(grouping: str, raf: bool) -> None:
    from torch.distributed._composable import checkpoint as torch_checkpoint

    ours = _ac_grouping(fully_shard, checkpoint, grouping, raf)
    theirs = _ac_grouping(torch_fully_shard, torch_checkpoint, grouping, raf)
    _assert_same(ours, theirs, "plait vs torch")


@pytest.mark.parametrize(
    ("grouping", "raf"),
    [("block", True), ("block", False), ("mem_eff", True), ("mem_eff_weight_tied", True)],
)
def test_activation_checkpointing_with_grouped_units(grouping: str, raf: bool) -> None:
    # torch's test_train_parity_with_activation_checkpointing (composable checkpoint)
    run_on_ranks(2, _ac_parity, grouping, raf)
