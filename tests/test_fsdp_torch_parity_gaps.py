"""The last behaviours torch's own ``fully_shard`` tests rely on (issue 40).

Each test here failed before issue 40 and states one behaviour that torch's upstream tests
(run by ``clients/torch_fsdp``) check:

* ``test_fully_shard_frozen.py``: parameters frozen with ``requires_grad_(False)`` *after*
  ``fully_shard`` leave the reduce-scatter (its numel is the trainable parameters' only)
  and come back when unfrozen, with the numerics of one process on the global batch;
* ``test_fully_shard_autograd.py``: hooks registered with
  ``register_post_accumulate_grad_hook`` on the sharded parameters run once per backward,
  after the sharded gradient is in place, so the optimizer stepped inside backward (one
  optimizer per parameter) trains exactly as the optimizer stepped after it, and as one
  process;
* ``test_fully_shard_init.py``: torch's ``_get_managed_modules`` / ``_get_managed_states``
  (which modules and parameters a ``fully_shard`` call manages) count plait's units; and
  plait's refusals carry torch's sentence, which code written for torch matches on;
* ``test_checkpoint.py``: composable ``checkpoint`` refuses an unknown keyword with torch's
  sentence (``Unexpected keyword arguments: foo``) before plait's list of what it takes.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from plait.checkpoint import checkpoint
from plait.fsdp import fully_shard
from plait.fsdp.backward_hooks import RegisterPostBackwardFunction
from plait.fsdp.init import _get_managed_modules, _get_managed_states
from plait.replicate import replicate

from collective_spy import spy_collectives
from harness import run_on_ranks
from models import MLP

WORLD = 2


def _global_and_local(step: int, rows: int = 4, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(100 + step)
    x = torch.randn(WORLD * rows, dim)
    rank = dist.get_rank()
    return x, x[rank * rows : (rank + 1) * rows]


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def _freeze_weights(model: nn.Module, frozen: bool) -> None:
    for name, param in model.named_parameters():
        if "bias" not in name:
            param.requires_grad_(not frozen)


def _frozen_after_init_body() -> list[str]:
    problems: list[str] = []
    torch.manual_seed(0)
    model = nn.Sequential(*[MLP(8, 16) for _ in range(3)])
    ref = copy.deepcopy(model)
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    _freeze_weights(model, True)  # after fully_shard: the case torch's test adds
    _freeze_weights(ref, True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    # The spy records the output (this rank's chunk): the trainable parameters' shards
    # and, after them, one usage count per trainable parameter (plait's unused-parameter
    # detection; torch's reduce-scatter has no such column).
    biases = [p for n, p in model[0].named_parameters() if "bias" in n]
    frozen_want = sum(p.to_local().numel() for p in biases) + len(biases)
    unfrozen_want = sum(p.to_local().numel() + 1 for p in model[0].parameters())
    orig_backward = RegisterPostBackwardFunction.backward
    post_backwards = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal post_backwards
        post_backwards += 1
        return orig_backward(*args, **kwargs)

    for step in range(4):
        if step == 2:  # unfrozen again: the weights are reduced (and trained) once more
            _freeze_weights(model, False)
            _freeze_weights(ref, False)
        x, local = _global_and_local(step)
        RegisterPostBackwardFunction.backward = counted  # as torch's test helper patches it
        post_backwards = 0
        try:
            with spy_collectives("reduce_scatter_single") as calls:
                model(local).pow(2).mean().backward()
        finally:
            RegisterPostBackwardFunction.backward = orig_backward
        ref(x).pow(2).mean().backward()
        numels = sorted({numel for _, numel in calls["reduce_scatter_single"]})
        want = frozen_want if step < 2 else unfrozen_want
        if numels != [want]:
            problems.append(f"step {step}: reduce-scatter numels {numels}, want [{want}]")
        # Each MLP unit's post-backward runs through autograd, but the first's (its
        # input needs no gradient): torch's test counts them through this class.
        if post_backwards < len(model) - 1:
            problems.append(f"step {step}: {post_backwards} post-backwards through autograd")
        for opt_ in (opt, ref_opt):
            opt_.step()
            opt_.zero_grad()
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            if not torch.allclose(_full(p), r.detach(), rtol=1e-5, atol=1e-6):
                problems.append(f"step {step}: {name} differs from one process")
    return problems


def test_params_frozen_after_fully_shard_leave_the_reduce_scatter() -> None:
    for problems in run_on_ranks(WORLD, _frozen_after_init_body):
        assert not problems, problems


def _post_acc_grad_hook_counts_body() -> dict[str, int]:
    torch.manual_seed(0)
    model = MLP(8, 16)
    for module in (model.in_proj, model.out_proj, model):
        fully_shard(module)
    counts: dict[str, int] = {}

    def hook_for(name: str) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            assert param.grad is not None, f"{name}: hook ran before the gradient was set"
            counts[name] = counts.get(name, 0) + 1

        return hook

    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(hook_for(name))
    model(torch.randn(2, 8)).sum().backward()
    return counts


def test_post_accumulate_grad_hooks_run_on_sharded_params() -> None:
    names = {name for name, _ in MLP(8, 16).named_parameters()}
    for counts in run_on_ranks(WORLD, _post_acc_grad_hook_counts_body):
        assert counts == dict.fromkeys(names, 1)


def _optimizer_in_backward_body() -> list[str]:
    problems: list[str] = []
    torch.manual_seed(0)
    single = nn.Sequential(*[MLP(8, 16) for _ in range(2)])
    stepped_after, in_backward = copy.deepcopy(single), copy.deepcopy(single)
    for model in (stepped_after, in_backward):
        for block in model:
            fully_shard(block)
        fully_shard(model)
    kwargs = {"lr": 1e-2, "foreach": False}
    single_opt = torch.optim.AdamW(single.parameters(), **kwargs)
    after_opt = torch.optim.AdamW(stepped_after.parameters(), **kwargs)
    per_param = {p: torch.optim.AdamW([p], **kwargs) for p in in_backward.parameters()}

    def step_in_backward(param: torch.Tensor) -> None:
        per_param[param].step()
        per_param[param].zero_grad()

    for param in in_backward.parameters():
        param.register_post_accumulate_grad_hook(step_in_backward)
    for step in range(4):
        x, local = _global_and_local(step)
        single(x).pow(2).mean().backward()
        single_opt.step()
        single_opt.zero_grad()
        stepped_after(local).pow(2).mean().backward()
        after_opt.step()
        after_opt.zero_grad()
        in_backward(local).pow(2).mean().backward()  # steps inside
        params = zip(
            in_backward.named_parameters(),
            stepped_after.parameters(),
            single.parameters(),
            strict=True,
        )
        for (name, p), after, one in params:
            if not torch.equal(p.to_local(), after.to_local()):
                problems.append(f"step {step}: {name} differs from the optimizer after backward")
            if not torch.allclose(_full(p), one.detach(), rtol=1e-5, atol=1e-6):
                problems.append(f"step {step}: {name} differs from one process")
            if p.grad is not None:
                problems.append(f"step {step}: {name} kept a gradient after zero_grad in the hook")
    return problems


def test_optimizer_in_backward_equals_optimizer_after_and_one_process() -> None:
    for problems in run_on_ranks(WORLD, _optimizer_in_backward_body):
        assert not problems, problems


def _managed_counts_body() -> list[str]:
    problems: list[str] = []
    model = nn.Sequential(*[MLP(8, 16) for _ in range(3)])
    model[1].register_buffer("buf", torch.zeros(2))
    replicate(model[0])
    fully_shard(model[2])
    managed = _get_managed_modules((model,))
    want = [*model[1].modules(), model]
    if len(managed) != len(want) or set(managed) != set(want):
        problems.append(f"managed modules {managed} != {want}")
    params, buffers = _get_managed_states(managed)
    if {id(p) for p in params} != {id(p) for p in model[1].parameters()}:
        problems.append("managed parameters are not model[1]'s")
    if [id(b) for b in buffers] != [id(model[1].buf)]:
        problems.append("managed buffers are not model[1]'s")
    shared = MLP(8, 16)
    twice = nn.Sequential(shared, shared)
    if len(_get_managed_modules((twice,))) != len([*shared.modules(), twice]):
        problems.append("a module registered twice is counted twice")
    ignored = set(model[1].out_proj.parameters())
    if model[1].out_proj in _get_managed_modules((model[1],), ignored):
        problems.append("a module whose parameters are all ignored is still managed")
    return problems


def test_managed_modules_and_states_count_plaits_units() -> None:
    for problems in run_on_ranks(WORLD, _managed_counts_body):
        assert not problems, problems


def _refusals_body() -> dict[str, tuple[list[str], str]]:
    """Each refusal's exception classes (its MRO's names) and message."""
    found: dict[str, tuple[list[str], str]] = {}

    def refused(key: str, call: Callable[[], object]) -> None:
        try:
            call()
        except Exception as error:  # the refusal is what is recorded
            found[key] = ([c.__name__ for c in type(error).__mro__], str(error))

    refused("ndim", lambda: fully_shard(MLP(), mesh=init_device_mesh("cpu", (WORLD, 1, 1))))
    refused("names", lambda: fully_shard(MLP(), mesh=init_device_mesh("cpu", (1, WORLD))))
    scalar = MLP()
    scalar.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    refused("scalar", lambda: fully_shard(scalar))
    conv = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    refused("contiguous", lambda: fully_shard(conv))
    with torch.device("meta"):
        meta = nn.Sequential(MLP(), MLP())
    for module in (meta[0], meta[1], meta):
        fully_shard(module)
    refused("meta", lambda: meta(torch.randn(2, 8)))
    return found


# torch's sentences as torch's tests match them (regular expressions), and the type.
TORCH_REFUSALS = {
    "ndim": ("ValueError", r"fully\_shard expects a 1D or 2D DeviceMesh but got DeviceMesh"),
    "names": ("AssertionError", "Please init the 2D mesh for HSDP with mesh_dim_names specified"),
    "scalar": ("ValueError", "Change scalar_p to a 1D tensor with numel equal to 1."),
    "contiguous": ("NotImplementedError", "FSDP does not support non-contiguous parameters"),
    "meta": (
        "RuntimeError",
        "FSDP parameters should be materialized from meta device before training, but the "
        "following were still on meta device: "
        r"\['0.in_proj.weight', '0.in_proj.bias', '0.out_proj.weight', '0.out_proj.bias'\]",
    ),
}
# plait's own explanation, kept beside torch's sentence.
PLAIT_WORDS = {
    "ndim": "slice it",
    "names": "needs mesh_dim_names",
    "scalar": "ignored_params",
    "contiguous": "param.data = param.data.contiguous()",
    "meta": "to_empty",
}


@pytest.mark.parametrize("key", sorted(TORCH_REFUSALS))
def test_refusals_carry_torchs_sentence_and_plaits(key: str) -> None:
    for found in run_on_ranks(WORLD, _refusals_body):
        classes, message = found[key]
        want_type, pattern = TORCH_REFUSALS[key]
        assert want_type in classes, (classes, message)  # code catching torch's type still does
        assert re.search(pattern, message), message
        assert PLAIT_WORDS[key] in message, message


def test_checkpoint_unknown_keyword_carries_torchs_sentence() -> None:
    """torch's ``test_checkpoint_kwargs`` matches ``Unexpected keyword arguments: foo``."""
    module = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="Unexpected keyword arguments: foo") as caught:
        checkpoint(module, foo="bar")
    assert "context_fn" in str(caught.value)  # plait's list of what it does take follows
    assert checkpoint.state(module) is None  # the module is left as it was
