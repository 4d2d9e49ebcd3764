"""Compiled autograd over plait's data-parallel APIs: refused at the first backward, with the fix.

Compiled autograd (``torch._dynamo.config.compiled_autograd = True`` before ``torch.compile``
of a train step, or the ``torch._dynamo.compiled_autograd._enable(compiler)`` context around
``loss.backward()``) captures a whole backward as one graph and hands it to ``torch.compile``.
plait's backward hooks run eagerly inside that graph (graph breaks), but the end-of-backward
callback they queue on the autograd engine is dropped there, so gradients would never be
reduced nor parameters resharded. torch 2.13's own ``fully_shard`` runs on and trains wrong
(losses drift from eager, parameters stay unsharded after backward); without ``fullgraph``
plait used to fail inside dynamo with ``queue_callback() is only supported when Compiled
Autograd is enabled with fullgraph=True``, and with it on an untraceable storage call.

Exactness is out of reach without an eager end-of-backward point (see
``plait.hooks.refuse_compiled_autograd``), so plait refuses, and the oracle is: the error names
the setting and the fix; it comes at the first backward on every rank, before any collective
of that backward (no hang); it leaves the model as it was, so with compiled autograd off the
same model then trains exactly like one process (``check_parity``). With ``fullgraph=True``
dynamo refuses plait's backward hooks with a reason naming the same fix. Compiled autograd
switched on only around a forward whose backward runs outside it has nothing to refuse: exact.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo import compiled_autograd
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from plait import replicate

from harness import run_on_ranks
from models import MLPStack, shard_blocks
from parity import check_parity, local_slice, random_batches

FIX = "torch._dynamo.config.compiled_autograd = False"  # every refusal names it
APIS = {"fully_shard": shard_blocks, "replicate": replicate}
STEPS, BLOCKS = 3, 2


def _reset_dynamo() -> None:
    """Start from no compiled code and zero counters (workers outlive tests)."""
    torch._dynamo.reset()
    counters.clear()


def _rank_and_world() -> tuple[int, int]:
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _backward_under_compiled_autograd(model: nn.Module, how: str) -> None:
    """One step of this rank's batch with compiled autograd on, as users turn it on."""
    x, y = (local_slice(t, *_rank_and_world()) for t in random_batches(1, 8, 8, 8)[0])
    if how == "config":  # the documented switch: a compiled train step, backward inside
        with torch._dynamo.config.patch(compiled_autograd=True):

            @torch.compile(backend="aot_eager")
            def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
                F.mse_loss(model(x), y).backward()

            train_step(x, y)
        return
    loss = F.mse_loss(model(x), y)
    compiler = torch.compile(backend="eager", fullgraph=how == "context_fullgraph")
    with compiled_autograd._enable(compiler):
        loss.backward()


def _refused_then_exact_body(api: str, how: str) -> str:
    """Refused under compiled autograd; then, with it off, the same model trains exactly."""
    _reset_dynamo()
    refusals: list[str] = []

    def parallelize(model: nn.Module) -> nn.Module:
        APIS[api](model)
        with pytest.raises(RuntimeError, match=FIX) as refusal:
            _backward_under_compiled_autograd(model, how)
        refusals.append(str(refusal.value))
        assert not compiled_autograd.compiled_autograd_enabled  # the context did unwind
        if api == "fully_shard" and how == "context_fullgraph":
            # dynamo refused before any plait hook ran, so fully_shard never saw this
            # backward: recover as after any exception between forward and backward.
            model.reset_iter_state()  # type: ignore[operator]
        elif api == "fully_shard":  # plait's own refusal left every unit resharded
            params = [p for m in model.modules() for p in m._parameters.values()]
            assert all(isinstance(p, DTensor) for p in params), "left unsharded"
        # replicate's refusal comes from a post-accumulate-grad hook, so this rank may
        # hold a local gradient of the aborted backward, as after any failed backward:
        # drop it, as code that recovers from one does.
        model.zero_grad(set_to_none=True)
        return model

    check_parity(lambda: MLPStack(BLOCKS), parallelize, random_batches(STEPS, 8, 8, 8))
    return refusals[0]


CASES = [
    (api, how, world)
    for api in APIS
    for how in ("config", "context", "context_fullgraph")
    for world in (1, 2)
]


@pytest.mark.parametrize(("api", "how", "world"), CASES)
def test_compiled_autograd_is_refused_with_the_fix(api: str, how: str, world: int) -> None:
    messages = run_on_ranks(world, _refused_then_exact_body, api, how, timeout=300)
    for message in messages:
        if how == "context_fullgraph":  # dynamo's refusal of the hook, with plait's reason
            assert "compiled autograd cannot capture plait's backward hooks" in message
        else:  # plait's own, from the hook run eagerly in the compiled backward graph
            assert message.startswith(f"{api}: this backward runs under compiled autograd")
            assert "torch._dynamo.compiled_autograd._enable" in message


def _forward_only_body(api: str) -> float:
    """Compiled autograd on while the module is compiled (so around its compiled forward),
    backward outside it: plain autograd runs the backward, and plait trains exactly."""
    _reset_dynamo()

    def parallelize(model: nn.Module) -> nn.Module:
        APIS[api](model)
        with torch._dynamo.config.patch(compiled_autograd=True):
            model.compile(backend="aot_eager")  # in place: parameter names unchanged
        return model

    report = check_parity(lambda: MLPStack(BLOCKS), parallelize, random_batches(STEPS, 8, 8, 8))
    assert int(counters["stats"]["unique_graphs"]) >= 1, "nothing was compiled"
    return report.max_param_diff


@pytest.mark.parametrize("api", list(APIS))
def test_compiled_autograd_around_the_forward_only_is_not_refused(api: str) -> None:
    run_on_ranks(2, _forward_only_body, api, timeout=300)


def test_checkpoint_under_compiled_autograd_is_refused_with_the_fix() -> None:
    """plait's checkpoint: recomputation replayed inside a compiled autograd graph used to
    fail with a misleading "saved a different tensor"; now the same refusal as above."""
    from plait import checkpoint

    _reset_dynamo()
    model = MLPStack(BLOCKS)
    for block in model.blocks:
        checkpoint(block)
    loss = model(torch.randn(4, 8)).sum()
    with (
        pytest.raises(RuntimeError, match=FIX) as refusal,
        compiled_autograd._enable(torch.compile(backend="eager")),
    ):
        loss.backward()
    assert str(refusal.value).startswith("checkpoint: this backward runs under compiled autograd")
    _reset_dynamo()
    model(torch.randn(4, 8)).sum().backward()  # off again: the model still trains
    assert all(p.grad is not None for p in model.parameters())
