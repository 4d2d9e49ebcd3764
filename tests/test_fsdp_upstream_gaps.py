"""More of torch's upstream fully_shard tests, written from reading them (issue 19).

* ``test_fully_shard_state_dict.py::test_cached_state_dict``: a state dict taken once keeps
  sharing storage with the sharded parameters through optimizer steps, so training code can
  take it once and reuse it (uneven widths included);
* ``test_fully_shard_mixed_precision.py::test_reduce_dtype_after_frozen_first_forward``: a
  unit whose parameters are all frozen in its first forward (under ``no_grad``), with a
  non-float parameter beside them, still reduces in the policy's fp32 once they are
  unfrozen: its gradients are fp32 and equal a bf16 copy's (torch 2.13 fails it on CPU);
* ``test_fully_shard_mixed_precision.py::test_grad_acc_with_reduce_dtype``: gradients
  accumulated over microbatches without sync are kept in fp32, not bf16;
* ``test_float16_on_one_submodule`` (subtests 1 and 3; subtest 2 relies on torch's helper
  model casting inside its own forward, which says nothing about fully_shard) and
  ``test_submodules_with_external_inputs``: which inputs each unit's policy casts;
* ``test_fully_shard_state_dict.py::test_dp_state_dict_cpu_offload``: an offloaded meta
  model loads one parameter at a time with ``assign=True`` (the GPU-only "parameters on a
  non-CPU device" error has no CPU counterpart);
* ``test_fully_shard_mixed_precision.py::test_no_warmup_jvp_reshard_after_forward_false``:
  a unit's first forward inside ``torch.func.jvp``; beyond it, jvp and vmap through
  sharded units against the unsharded model, and a training step after them (the
  post-backward identity is a functorch-ready ``autograd.Function``, and a unit gathers
  its parameters outside the transforms).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait.fsdp import MixedPrecisionPolicy, fully_shard

from harness import run_on_ranks
from models import MLP


def _cached_state_dict_body() -> list[str]:
    problems = []
    for width in (2, 3, 4, 5):
        torch.manual_seed(42)
        model = nn.Linear(width, width, bias=False)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = model.state_dict()  # taken once
        weight = model.weight
        assert isinstance(weight, DTensor)

        def shares(state: dict[str, DTensor] = state, weight: DTensor = weight) -> bool:
            mine = state["weight"]._local_tensor.untyped_storage().data_ptr()
            return mine == weight._local_tensor.untyped_storage().data_ptr()

        if not shares():
            problems.append(f"width {width}: state dict does not share the shard's storage")
        x = torch.rand(width, width)
        for _ in range(5):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            if not shares():
                problems.append(f"width {width}: an optimizer step broke the sharing")
        if not torch.equal(state["weight"].to_local(), weight.to_local()):
            problems.append(f"width {width}: the cached state dict holds stale values")
    return problems


def test_a_state_dict_taken_once_follows_training() -> None:
    for problems in run_on_ranks(2, _cached_state_dict_body):
        assert not problems, problems


class _Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        self.non_float = nn.Parameter(torch.ones(16, dtype=torch.int64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _frozen_first_forward_body() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """plait's gradients, and those of a bf16 copy of the model cast to fp32: the same casts
    (every rank sees the same input, so the fp32 average over ranks changes nothing).
    torch 2.13's own fully_shard fails this case on CPU: it assigns the bf16 gradient to
    the fp32 parameter ("attempting to assign a gradient with dtype BFloat16")."""
    torch.manual_seed(0)
    model = _Frozen()
    reference = copy.deepcopy(model.layers).to(torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mp_policy=policy)
    model.requires_grad_(False)
    x = torch.randn(4, 16)
    with torch.no_grad():
        model(x)
    model.layers.requires_grad_(True)
    model(x).sum().backward()
    reference(x.to(torch.bfloat16)).sum().backward()
    ours = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert p.grad.dtype == torch.float32, (name, p.grad.dtype)
            ours[name] = p.grad.full_tensor()  # type: ignore[attr-defined]
    assert model.non_float.grad is None
    theirs = {f"layers.{n}": p.grad.float() for n, p in reference.named_parameters()}  # type: ignore[union-attr]
    return ours, theirs


def test_reduce_dtype_after_a_frozen_first_forward() -> None:
    for ours, theirs in run_on_ranks(2, _frozen_first_forward_body):
        assert ours.keys() == theirs.keys() and len(ours) == 4, ours.keys()
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], atol=0, rtol=0, msg=name)


def _grad_acc_body(reshard_after_forward: bool) -> list[str]:
    """torch's test_grad_acc_with_reduce_dtype: microbatches without gradient sync, bf16
    compute, fp32 reduction. The reference keeps a bf16 compute copy, accumulates its
    gradients in fp32 and averages them over ranks at the last microbatch; losses must be
    equal and parameters equal after every step."""
    world = dist.get_world_size()
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(16, 16) for _ in range(3)])
    reference = copy.deepcopy(model)
    compute = copy.deepcopy(reference).to(torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for mlp in model:
        fully_shard(mlp, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    torch.manual_seed(43 + dist.get_rank())
    inputs = torch.randn(8, 16, dtype=torch.bfloat16)
    problems = []
    for step in range(4):
        for i, micro in enumerate(inputs.chunk(4)):
            last = i == 3
            model.set_requires_gradient_sync(last)  # type: ignore[operator]
            model.set_reshard_after_backward(last or reshard_after_forward)  # type: ignore[operator]
            ours, theirs = model(micro).sum(), compute(micro).sum()
            ours.backward()
            theirs.backward()
            if not torch.equal(ours, theirs):
                problems.append(f"step {step} microbatch {i}: loss {ours} != {theirs}")
            for p, c in zip(reference.parameters(), compute.parameters(), strict=True):
                assert c.grad is not None
                p.grad = c.grad.float() if p.grad is None else p.grad + c.grad
                c.grad = None
        for p in reference.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        with torch.no_grad():
            for p, c in zip(reference.parameters(), compute.parameters(), strict=True):
                c.copy_(p)
        for (name, p), want in zip(model.named_parameters(), reference.parameters(), strict=True):
            if not torch.allclose(p.full_tensor(), want, atol=1e-5, rtol=1.3e-6):  # type: ignore[attr-defined]
                problems.append(f"step {step}: parameter {name} differs")
    return problems


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_gradient_accumulation_in_the_reduce_dtype(reshard_after_forward: bool) -> None:
    for problems in run_on_ranks(2, _grad_acc_body, reshard_after_forward):
        assert not problems, problems


class _Recording(nn.Module):
    """A linear layer that records the dtype of the input its forward receives (after any
    cast fully_shard applies: the record is inside ``forward``)."""

    def __init__(self, seen: dict[str, torch.dtype], name: str) -> None:
        super().__init__()
        self.seen, self.name = seen, name
        self.linear = nn.Linear(100, 100)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        self.seen[self.name] = x.dtype
        if extra is not None:
            self.seen[self.name + " extra"] = extra.dtype
        return self.linear(x)


class _TwoChildren(nn.Module):
    def __init__(self, seen: dict[str, torch.dtype], external: bool = False) -> None:
        super().__init__()
        self.seen, self.external = seen, external
        self.c1, self.c2 = _Recording(seen, "c1"), _Recording(seen, "c2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["model"] = x.dtype
        # ``external``: c2 also gets a tensor made here, not derived from the model input
        extra = torch.ones(2, 100) if self.external else None
        return self.c2(self.c1(x), extra)


def _casts_body() -> list[dict[str, torch.dtype]]:
    fp16 = torch.float16
    results = []
    # torch's test_float16_on_one_submodule, subtests 1 and 3
    for child, policy in (
        ("c2", MixedPrecisionPolicy(param_dtype=fp16)),
        ("c1", MixedPrecisionPolicy(param_dtype=fp16, output_dtype=torch.float32)),
    ):
        seen: dict[str, torch.dtype] = {}
        model = _TwoChildren(seen)
        fully_shard(getattr(model, child), mp_policy=policy)
        fully_shard(model)
        model(torch.zeros(2, 100)).float().sum().backward()
        results.append(seen)
    # torch's test_submodules_with_external_inputs, with and without the submodule's cast
    for cast in (False, True):
        seen = {}
        model = _TwoChildren(seen, external=True)
        fully_shard(model.c2, mp_policy=MixedPrecisionPolicy(fp16, cast_forward_inputs=cast))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=fp16))
        model(torch.zeros(2, 100)).float().sum().backward()
        results.append(seen)
    return results


def test_forward_input_casts_per_submodule() -> None:
    f16, f32 = torch.float16, torch.float32
    fp16_c2, fp16_c1_fp32_out, external_kept, external_cast = run_on_ranks(2, _casts_body)[0]
    assert fp16_c2 == {"model": f32, "c1": f32, "c2": f16}
    assert fp16_c1_fp32_out == {"model": f32, "c1": f16, "c2": f32}
    # the root casts its own input; c2 casts the tensor made inside the model only if asked
    assert external_kept == {"model": f16, "c1": f16, "c2": f16, "c2 extra": f32}
    assert external_cast == {"model": f16, "c1": f16, "c2": f16, "c2 extra": f16}


def _offload_assign_body() -> float:
    """torch's test_dp_state_dict_cpu_offload: a meta-device model with CPU offload loads
    its shards one parameter at a time (``assign=True, strict=False``, the others still on
    meta), then runs, and its state dict is on the CPU holding exactly what was loaded."""
    from torch.distributed.tensor import distribute_tensor

    from plait.fsdp import CPUOffloadPolicy

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    offload = CPUOffloadPolicy(pin_memory=False)
    for layer in model:
        fully_shard(layer, offload_policy=offload)
    fully_shard(model, offload_policy=offload)
    torch.manual_seed(42)  # the same full tensors on every rank
    full = {name: torch.randn(p.shape) for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        piece = distribute_tensor(full[name], p.device_mesh, p.placements)
        model.load_state_dict({name: piece}, assign=True, strict=False)
    x = torch.rand(4, 4)
    model(x).sum().backward()
    want = x @ full["0.weight"].T @ full["1.weight"].T
    diff = (model(x) - want).abs().max().item()
    for name, value in model.state_dict().items():
        assert value.device.type == "cpu", name
        assert torch.equal(value.full_tensor(), full[name]), name
    return diff


def test_offloaded_meta_model_loads_one_parameter_at_a_time() -> None:
    for diff in run_on_ranks(2, _offload_assign_body):
        assert diff < 1e-6, diff


def _assign_shards_body(on_meta: bool) -> tuple[float, bool]:
    """What transformers' ``from_pretrained(distributed_config=...)`` does: ``fully_shard``
    a model (built on meta, or not), then before its first forward assign each parameter a
    DTensor in the unit's layout holding this rank's real shard (``setattr`` of a new
    ``nn.Parameter``). plait takes them in: on meta their storage becomes the shard;
    otherwise their values go into the existing shards, which an optimizer may hold."""
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))  # 3 rows: uneven over 2 ranks
    with torch.device("meta" if on_meta else "cpu"):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    held = list(model.parameters())
    for (name, p), want in zip(model.named_parameters(), full.parameters(), strict=True):
        module_name, _, leaf = name.rpartition(".")
        local = want.detach().chunk(2)[dist.get_rank()].clone()
        shard = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )  # type: ignore[attr-defined]
        setattr(model.get_submodule(module_name), leaf, nn.Parameter(shard))
    x = torch.randn(5, 4)
    diff = (model(x) - full(x)).abs().max().item()
    return diff, all(a is b for a, b in zip(held, model.parameters(), strict=True))


@pytest.mark.parametrize("on_meta", [True, False], ids=["meta", "materialised"])
def test_shards_assigned_in_the_units_layout_are_taken_in(on_meta: bool) -> None:
    for diff, same_objects in run_on_ranks(2, _assign_shards_body, on_meta):
        assert diff < 1e-6, diff
        assert same_objects or on_meta  # on meta the new storage is the shard


def _functorch_body(reshard_after_forward: bool) -> list[str]:
    # torch.func's transforms over sharded units, beside the same model unsharded: a
    # forward-mode derivative (jvp) and a vmap through the units, then an ordinary training
    # step, whose gradients must be the reference's (the units gathered under the transforms
    # must free and reduce as usual).
    problems = []
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model = copy.deepcopy(ref)
    for module in (model[0], model[2], model):
        fully_shard(module, reshard_after_forward=reshard_after_forward)
    torch.manual_seed(1 + dist.get_rank())
    x, tangent = torch.randn(3, 8), torch.randn(3, 8)
    want = torch.func.jvp(ref, (x,), (tangent,))
    got = torch.func.jvp(model, (x,), (tangent,))
    if not all(torch.allclose(g, w) for g, w in zip(got, want, strict=True)):
        problems.append("jvp through the units differs from the unsharded model's")
    if not torch.allclose(torch.func.vmap(model)(x), ref(x)):
        problems.append("vmap through the units differs from the unsharded model's")
    ref(x).square().sum().backward()
    model(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert isinstance(p, DTensor) and q.grad is not None
        dist.all_reduce(q.grad)  # fully_shard averages over ranks: the reference's sum / 2
        if p.grad is None or not torch.allclose(p.grad.full_tensor(), q.grad / 2):
            problems.append(f"{name}: gradient after the transforms differs")
    return problems


def _jvp_without_warmup_body() -> tuple[tuple[int, ...], torch.dtype, bool]:
    # Upstream's test_no_warmup_jvp_reshard_after_forward_false: a unit's first forward
    # runs inside torch.func.jvp, over an input that does not depend on the primal.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with torch.device("meta"):
        enc, dec = nn.Linear(128, 256, bias=False), nn.Linear(256, 320, bias=False)
    for module in (enc, dec):
        fully_shard(module, mp_policy=mp, reshard_after_forward=False)
    for seed, module in enumerate((enc, dec)):
        module.to_empty(device="cpu")
        with torch.no_grad():
            module.weight.normal_(
                std=module.in_features**-0.5, generator=torch.Generator().manual_seed(seed)
            )
    encoded = enc(torch.randn(128, dtype=torch.bfloat16))
    primal = torch.randn(320, dtype=torch.bfloat16, requires_grad=True)
    out, tangent_out = torch.func.jvp(
        lambda _: dec(encoded), (primal,), (torch.randn(320, dtype=torch.bfloat16),)
    )
    return tuple(out.shape), out.dtype, bool(torch.equal(tangent_out, torch.zeros_like(out)))


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_functorch_transforms_run_through_sharded_units(reshard_after_forward: bool) -> None:
    assert run_on_ranks(2, _functorch_body, reshard_after_forward) == [[], []]


def test_a_first_forward_under_jvp() -> None:
    assert run_on_ranks(2, _jvp_without_warmup_body) == [((320,), torch.bfloat16, True)] * 2
