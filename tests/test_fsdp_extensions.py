"""All-gather extensions: ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on a parameter.

Ideas of torch's ``test_fully_shard_extensions.py``. The oracle: the hooks are called (the
first post-all-gather builds the unsharded parameter, later ones write into it with
``out=``), and training matches a hand-made one-process reference that applies the same
transform (weights gathered in bf16 and upcast: a straight-through rounding of the weight),
on an FSDP mesh with an unevenly sharded weight (the hook pads) and on an HSDP mesh (the
hook sees the 1-D shard mesh). A subclass with class-level hooks goes through meta-device
init and mixed precision, and matches torch's own ``fully_shard`` with the same subclass.
"""

from __future__ import annotations

import copy
import math
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import distribute_tensor

from plait.fsdp import MixedPrecisionPolicy, fully_shard
from plait.fsdp.state import fsdp_state_of

from harness import run_on_ranks
from models import hsdp_mesh

# --- the hooks: gather the weight in bf16, upcast after -----------------------------------


class _Calls:
    """Per-process counts of hook calls (each rank counts its own)."""

    pre = 0
    post_new = 0
    post_out = 0
    meshes: ClassVar[list[Any]] = []

    @classmethod
    def reset(cls) -> None:
        cls.pre = cls.post_new = cls.post_out = 0
        cls.meshes = []


def _pre_v2(
    self: torch.Tensor, mesh: Any, outer_size: torch.Size, outer_stride: Any, module: Any, mp: Any
) -> tuple[tuple[torch.Tensor, ...], Any]:
    _Calls.pre += 1
    _Calls.meshes.append(mesh)
    assert isinstance(module, nn.Module) and tuple(outer_stride) == (outer_size[1], 1)
    rows = math.ceil(outer_size[0] / mesh.size())
    padded = torch.zeros((rows, *outer_size[1:]), dtype=torch.bfloat16, device=self.device)
    padded[: self.size(0)].copy_(self)
    return (padded,), "meta"


def _pre_v1(self: torch.Tensor, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    _Calls.pre += 1
    _Calls.meshes.append(mesh)
    return (self.to(torch.bfloat16),), "meta"


@torch.no_grad()
def _post(
    self: torch.Tensor,
    outputs: tuple[torch.Tensor, ...],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    (gathered,) = outputs
    assert metadata == "meta" and gathered.dtype == torch.bfloat16
    if out is not None:
        _Calls.post_out += 1
        with _unsafe_preserve_version_counter(out):
            out.copy_(gathered[: out.size(0)])
        return None
    _Calls.post_new += 1
    upcast = gathered.to(param_dtype)
    return upcast, (gathered, upcast)


def _patch_weights(model: nn.Module, pre: Any) -> int:
    """Patch the hooks onto every sharded weight's local tensor (no subclass needed)."""
    count = 0
    for name, param in model.named_parameters():
        if name.endswith("weight"):
            local = param._local_tensor
            local.fsdp_pre_all_gather = pre.__get__(local)
            local.fsdp_post_all_gather = _post.__get__(local)
            count += 1
    return count


# --- model and reference ------------------------------------------------------------------


def _mlp() -> nn.Sequential:
    # 5 output rows: unevenly sharded over 2 ranks, so the v2 hook pads.
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 8))


def _rounded(w: torch.Tensor) -> torch.Tensor:
    """``w`` rounded to bf16, gradient passed straight through: what the hooks compute."""
    return w + (w.to(torch.bfloat16).to(w.dtype) - w).detach()


def _reference_forward(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for layer in model:
        x = (
            F.linear(x, _rounded(layer.weight), layer.bias)
            if isinstance(layer, nn.Linear)
            else layer(x)
        )
    return x


def _train_parity(reshard_after_forward: bool, version: int, hsdp: bool) -> dict[str, int]:
    _Calls.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _mlp()
    ref = _mlp()
    ref.load_state_dict(model.state_dict())
    mesh = hsdp_mesh() if hsdp else None
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    assert _patch_weights(model, _pre_v2 if version == 2 else _pre_v1) == 3
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(3):
        batch = torch.randn(world * 2, 8, generator=torch.Generator().manual_seed(step))
        loss = model(batch[rank * 2 : rank * 2 + 2]).sum()
        loss.backward()
        ref_loss = _reference_forward(ref, batch).sum() / world
        ref_loss.backward()
        losses = torch.stack([loss.detach()])
        dist.all_reduce(losses)
        torch.testing.assert_close(losses[0] / world, ref_loss.detach(), rtol=1e-5, atol=1e-5)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        ref_opt.zero_grad()
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(param.full_tensor(), ref_param.detach(), msg=name)
    for mesh_seen in _Calls.meshes:
        assert mesh_seen.ndim == 1 and mesh_seen.size() == (2 if hsdp else world)
    return {"pre": _Calls.pre, "post_new": _Calls.post_new, "post_out": _Calls.post_out}


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_hooks_called_and_training_matches_reference(reshard_after_forward: bool) -> None:
    # The five-argument hook: it pads the uneven weight (the one-argument form cannot).
    counts = run_on_ranks(2, _train_parity, reshard_after_forward, 2, False)
    for c in counts:
        # Three weights: each builds its unsharded parameter once, then writes into it.
        assert c["post_new"] == 3
        assert c["pre"] == c["post_new"] + c["post_out"]
        # 3 steps: at least one gather per weight per step (more when resharding after
        # forward, which gathers again for backward).
        assert c["post_out"] >= 6 if reshard_after_forward else c["post_out"] == 6


def _even_v1(reshard_after_forward: bool) -> dict[str, int]:
    _Calls.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    fully_shard(model[0], reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    _patch_weights(model, _pre_v1)
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
    return {"pre": _Calls.pre, "post_new": _Calls.post_new, "post_out": _Calls.post_out}


def test_one_argument_pre_all_gather_hook() -> None:
    for c in run_on_ranks(2, _even_v1, True):
        assert c["post_new"] == 2 and c["pre"] == 2 + c["post_out"] and c["post_out"] >= 2


def test_hsdp_mesh_hooks_see_shard_mesh_and_training_matches() -> None:
    counts = run_on_ranks(4, _train_parity, True, 2, True)
    assert all(c["post_new"] == 3 for c in counts)


# --- a subclass with class-level hooks: meta init, mixed precision, torch parity -----------


class BF16GatherWeight(torch.Tensor):
    """A weight whose all-gather travels in bf16 and is upcast to the parameter dtype."""

    calls = 0

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> BF16GatherWeight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[no-any-return]
            cls,
            data.shape,
            data.stride(),
            data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: Any, module: Any, mp: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        BF16GatherWeight.calls += 1
        return (self._data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Any = None,
    ) -> Any:
        (gathered,) = outputs
        if out is not None:
            with torch.no_grad(), _unsafe_preserve_version_counter(out):
                out.copy_(gathered)
            return None
        upcast = gathered.to(param_dtype)
        return upcast, (gathered, upcast)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = lambda x: x._data  # noqa: E731
        out = func(
            *pytree.tree_map_only(cls, unwrap, args),
            **pytree.tree_map_only(cls, unwrap, kwargs or {}),
        )
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], size: Any, stride: Any
    ) -> torch.Tensor:
        return inner["_data"]


def _subclass_model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
    for layer in (model[0], model[2]):
        layer.weight = nn.Parameter(BF16GatherWeight(layer.weight.detach()))
    return model


def _subclass_vs_torch(reshard_after_forward: bool, meta: bool) -> list[float]:
    rank = dist.get_rank()
    losses: dict[str, list[float]] = {}
    for name, shard, policy in (
        ("plait", fully_shard, MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        ("torch", torch_fully_shard, TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16)),
    ):
        torch.manual_seed(0)
        if meta:
            with torch.device("meta"):
                model = _subclass_model()
        else:
            model = _subclass_model()
        shard(model[0], reshard_after_forward=reshard_after_forward, mp_policy=policy)
        shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        if meta:
            model.to_empty(device="cpu")
            torch.manual_seed(1)
            for param in model.parameters():
                with torch.no_grad():
                    full = torch.randn(param.shape)  # the same full values under both
                    param.copy_(distribute_tensor(full, param.device_mesh, param.placements))
        BF16GatherWeight.calls = 0
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses[name] = []
        for step in range(3):
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = model(x).float().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
        assert BF16GatherWeight.calls >= 6, (name, BF16GatherWeight.calls)
    assert losses["plait"] == losses["torch"], losses
    return losses["plait"]


@pytest.mark.parametrize("meta", [False, True])
def test_subclass_matches_torch(meta: bool) -> None:
    run_on_ranks(2, _subclass_vs_torch, True, meta)


def _plain_units_keep_fast_path() -> bool:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(model)
    model(torch.randn(2, 8)).sum().backward()
    state = fsdp_state_of(model)
    assert state is not None and state.unit is not None
    return state.unit._extensions == {} and state.unit.split_copy


def test_units_without_extensions_keep_single_buffer_path() -> None:
    assert run_on_ranks(2, _plain_units_keep_fast_path) == [True, True]


# --- torch's own example: TwoTensor, hooks patched onto the class --------------------------


def _two_tensor_pre(self: Any, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    _Calls.pre += 1
    return (self.a, self.b), None


def _two_tensor_post(
    self: Any,
    outputs: tuple[torch.Tensor, ...],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: Any = None,
) -> Any:
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = outputs
    if out is not None:
        _Calls.post_out += 1
        # No cast: the unsharded parameter aliases the gathered buffers (torch's contract).
        assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
        return None
    _Calls.post_new += 1
    return TwoTensor(a, b).to(param_dtype), (a, b)


def _two_tensor_parity(reshard_after_forward: bool) -> dict[str, int]:
    from torch.testing._internal.two_tensor import TwoTensor

    _Calls.reset()
    world = dist.get_world_size()
    TwoTensor.fsdp_pre_all_gather = _two_tensor_pre  # type: ignore[attr-defined]
    TwoTensor.fsdp_post_all_gather = _two_tensor_post  # type: ignore[attr-defined]
    try:
        torch.manual_seed(42)
        model = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
                for _ in range(2)
            ]
        )
        for block in model:
            for i in (0, 2):
                w = block[i].weight.detach()
                block[i].weight = nn.Parameter(TwoTensor(w, w.clone()))
        ref = copy.deepcopy(model)
        for block in model:
            fully_shard(block, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        torch.manual_seed(43 + dist.get_rank())
        x = torch.randn(2, 8)
        for _ in range(3):
            loss, ref_loss = model(x).sum(), ref(x).sum()
            loss.backward()
            ref_loss.backward()
            for param in ref.parameters():
                dist.all_reduce(param.grad)
                param.grad.div_(world)
            torch.testing.assert_close(loss, ref_loss)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(param.full_tensor(), ref_param.detach())
    finally:
        del TwoTensor.fsdp_pre_all_gather  # type: ignore[attr-defined]
        del TwoTensor.fsdp_post_all_gather  # type: ignore[attr-defined]
    return {"pre": _Calls.pre, "post_new": _Calls.post_new, "post_out": _Calls.post_out}


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_two_tensor_train_parity(reshard_after_forward: bool) -> None:
    for c in run_on_ranks(2, _two_tensor_parity, reshard_after_forward):
        assert c["post_new"] == 4 and c["post_out"] >= 8


def _hpz_falls_back() -> dict[str, int]:
    _Calls.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    fully_shard(model[0], reshard_after_forward=2)  # groups of 2 of the 4 ranks
    fully_shard(model)
    _patch_weights(model, _pre_v1)
    ref = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    x = torch.randn(2, 8)
    model(x).sum().backward()
    _reference_forward(ref, x).sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    world = dist.get_world_size()
    for ref_param in ref.parameters():
        dist.all_reduce(ref_param.grad)
        ref_param.grad.div_(world)
    for grad, ref_param in zip(grads, ref.parameters(), strict=True):
        torch.testing.assert_close(grad, ref_param.grad)
    return {"pre": _Calls.pre, "post_new": _Calls.post_new, "post_out": _Calls.post_out}


def test_int_reshard_after_forward_reshards_fully_with_extensions() -> None:
    # hpZ keeps gathered rows, which for an extension are the hooks' inputs, not the
    # parameter: the unit reshards fully and backward gathers through the hooks again.
    for c in run_on_ranks(4, _hpz_falls_back):
        assert c["post_new"] == 2 and c["post_out"] == 1


def _bad_hooks(kind: str) -> str:
    model = nn.Linear(8, 8)
    fully_shard(model)
    local = model.weight._local_tensor
    if kind == "only_pre":
        local.fsdp_pre_all_gather = _pre_v1.__get__(local)
    else:
        local.fsdp_pre_all_gather = (lambda self, mesh, extra: ((self,), None)).__get__(local)
        local.fsdp_post_all_gather = _post.__get__(local)
    try:
        model(torch.randn(2, 8))
    except TypeError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    ("kind", "message"),
    [("only_pre", "defines only one of"), ("arity", "expected (mesh) or (mesh, outer_size")],
)
def test_malformed_hooks_raise_naming_the_parameter(kind: str, message: str) -> None:
    for text in run_on_ranks(2, _bad_hooks, kind):
        assert message in text and "'weight'" in text, text
