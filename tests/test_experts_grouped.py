"""Grouped expert GEMMs (``plait.experts.grouped``): the same numbers as the loop, one
``torch._grouped_mm`` per matrix, the loop wherever torch cannot run them, and ``plait
train``'s expert-parallel layouts on the grouped path equal to one process.

Why two bitwise oracles: the grouped GEMM multiplies each expert's rows with the very
``mm`` the loop calls, but the SwiGLU between the matmuls (``silu``, ``*``) then runs once
over all rows instead of once per expert, and ATen's CPU kernels compute the tail of a
tensor that does not fill their vectors with scalar code (``silu`` differs by an ulp
there). So the grouped path is bitwise the loop where the hidden width is a multiple of
32 floats (no tail in either path, on any CPU vector width), and bitwise a loop of
per-expert ``mm`` around whole-tensor elementwise ops at any width.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import plait.experts.swiglu as swiglu
from plait.experts import GroupedExperts, MoE, grouped_mm_supported, set_grouped_mm
from plait.experts.grouped import autocast_weights, grouped_swiglu
from plait.train.metrics import read_metrics

from harness import run_on_ranks
from train_helpers import TINY, assert_losses_close, run_train, train_on_rank

DIM = 8
#: Routings of 10 rows over 4 experts: spread with an empty expert, all on one expert,
#: one row each (and a spare expert), no rows at all.
COUNTS = {
    "spread": [3, 0, 5, 2],
    "all_on_one": [0, 0, 10, 0],
    "single_rows": [1, 1, 1, 0],
    "no_rows": [0, 0, 0, 0],
}

GROUPED = torch.ops.aten._grouped_mm.default
MM = torch.ops.aten.mm.default


class _Ops(TorchDispatchMode):
    """Counts the aten ops that run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[Any] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen[func] += 1
        return func(*args, **(kwargs or {}))


def _experts(hidden: int, dtype: torch.dtype = torch.float32) -> GroupedExperts:
    torch.manual_seed(0)
    return GroupedExperts(DIM, hidden, 4).to(dtype)


def _run(
    experts: GroupedExperts,
    counts: list[int],
    how: str,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> list[torch.Tensor]:
    """Output and the gradients of input and weights, the rows on ``device``; ``how``:
    ``"sum"`` (an expanded gradient reaches the output) or ``"grad"`` (a random, dense
    one)."""
    gen = torch.Generator().manual_seed(1)
    n = sum(counts)
    x = torch.randn(n, DIM, generator=gen).to(device, dtype).requires_grad_(True)
    experts.zero_grad(set_to_none=True)
    out = experts(x, torch.tensor(counts, device=device))
    if how == "sum":
        out.sum().backward()
    else:
        out.backward(torch.randn(n, DIM, generator=gen).to(device, dtype))
    grads = [x.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad]
    return [out.detach(), *(g for g in grads if g is not None)]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    names = ["output", "x.grad", "w1.grad", "w2.grad", "w3.grad"]
    assert len(got) == len(want) == len(names)
    for name, g, w in zip(names, got, want, strict=True):
        assert torch.equal(g, w), f"{name}: max diff {(g - w).abs().max().item()}"


# -- the same numbers as the loop ---------------------------------------------------------


@pytest.mark.parametrize("how", ["sum", "grad"])
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_equals_the_loop_bitwise(routing: str, how: str, dtype: torch.dtype) -> None:
    """hidden 64: no elementwise tail (module docstring), so every number is the loop's."""
    experts = _experts(64, dtype)
    with _Ops() as ops:
        grouped = _run(experts, COUNTS[routing], how, dtype)
    assert ops.seen[GROUPED] == 9 and ops.seen[MM] == 0  # 3 forward, 6 backward
    set_grouped_mm(experts, False)
    with _Ops() as ops:
        loop = _run(experts, COUNTS[routing], how, dtype)
    assert ops.seen[GROUPED] == 0
    _assert_equal(grouped, loop)


@pytest.mark.parametrize("routing", ["spread", "no_rows"])
def test_grouped_under_autocast_equals_the_autocast_loop_bitwise(routing: str) -> None:
    """``plait train --mp bf16`` on one process: fp32 parameters under autocast. The
    grouped path casts rows and weights to bf16 itself (autocast does not cast
    ``_grouped_mm``), so it runs, and every number is the loop's, whose matmuls autocast
    casts: the same bf16 products, the gradients back in fp32."""
    experts = _experts(64)
    with torch.autocast("cpu", dtype=torch.bfloat16), _Ops() as ops:
        grouped = _run(experts, COUNTS[routing], "grad")
    assert ops.seen[GROUPED] == 9 and ops.seen[MM] == 0
    assert grouped[0].dtype == torch.bfloat16 and grouped[2].dtype == torch.float32
    set_grouped_mm(experts, False)
    with torch.autocast("cpu", dtype=torch.bfloat16), _Ops() as ops:
        loop = _run(experts, COUNTS[routing], "grad")
    assert ops.seen[GROUPED] == 0
    _assert_equal(grouped, loop)


def _per_expert_mm(
    x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """The grouped path's maths written out: a loop of ``mm`` per matrix, the elementwise
    SwiGLU once over all rows."""

    def matmul(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.cat([b @ m for b, m in zip(rows.split(counts), w.unbind(0), strict=True)])

    return matmul(F.silu(matmul(x, w1)) * matmul(x, w3), w2)


@pytest.mark.parametrize("routing", list(COUNTS))
def test_grouped_gemms_equal_per_expert_matmuls_bitwise(routing: str) -> None:
    """hidden 12 (elementwise tails): the GEMMs, forward and backward, are still each
    expert's ``mm`` bit for bit; against the loop, an ulp of ``silu`` at most."""
    counts = COUNTS[routing]
    experts = _experts(12)
    grouped = _run(experts, counts, "sum")
    reference = GroupedExperts(DIM, 12, 4)
    reference.load_state_dict(experts.state_dict())
    reference.forward = lambda x, c: _per_expert_mm(  # type: ignore[method-assign]
        x, counts, reference.w1, reference.w2, reference.w3
    )
    _assert_equal(grouped, _run(reference, counts, "sum"))
    set_grouped_mm(experts, False)
    for got, want in zip(grouped, _run(experts, counts, "sum"), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_grouped_path_reads_no_counts_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> list[int]:
        raise AssertionError("the grouped path must not read the counts on the host")

    monkeypatch.setattr(swiglu, "host_counts", refuse)
    experts = _experts(16)
    experts(torch.randn(10, DIM), torch.tensor(COUNTS["spread"])).sum().backward()
    experts.grouped_mm = False
    with pytest.raises(AssertionError, match="must not read"):
        experts(torch.randn(10, DIM), torch.tensor(COUNTS["spread"]))


def test_an_expanded_gradient_of_no_rows_reaches_the_grouped_gemms() -> None:
    """``_grouped_mm``'s own backward refuses a gradient with strides ``(0, 0)``, which
    ``.sum().backward()`` hands an empty output: the experts pass on a dense one."""
    w1, w2, w3 = (torch.randn(4, a, b, requires_grad=True) for a, b in ((8, 16), (16, 8), (8, 16)))
    x = torch.randn(0, DIM, requires_grad=True)
    grouped_swiglu(x, torch.zeros(4, dtype=torch.int64), w1, w2, w3).sum().backward()
    assert w1.grad is not None and not w1.grad.any()


def _fused_kernel_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)


@pytest.mark.skipif(
    not _fused_kernel_gpu(),
    reason="the fused grouped GEMM runs on CUDA GPUs of compute capability 9.x or 10.x "
    "(H100, H200, B200) only: benchmarks/gpu_check.py runs this test there",
)
@pytest.mark.parametrize("routing", list(COUNTS))
def test_fused_cuda_kernel_matches_the_loop(routing: str) -> None:
    """torch's fused CUDA kernel, every routing: an expert-parallel rank may be sent no
    rows at all (``no_rows``) or some experts none. It rounds unlike cuBLAS's ``mm``, so
    the comparison is to bf16 tolerance, against the loop in fp32 on the same device."""
    experts = _experts(64).cuda().to(torch.bfloat16)
    counts = COUNTS[routing]
    assert grouped_mm_supported(
        torch.zeros(1, DIM, dtype=torch.bfloat16, device="cuda"),
        [experts.w1, experts.w2, experts.w3],
    )
    with _Ops() as ops:
        grouped = [t.float() for t in _run(experts, counts, "grad", torch.bfloat16, "cuda")]
    assert ops.seen[GROUPED] == 9
    set_grouped_mm(experts, False)
    experts.float()
    loop = _run(experts, counts, "grad", torch.float32, "cuda")
    for g, w in zip(grouped, loop, strict=True):
        assert g.shape == w.shape and torch.isfinite(g).all()
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)


# -- when torch can run them ---------------------------------------------------------------


def _tensors(dim: int, hidden: int, dtype: torch.dtype, device: str = "cpu") -> list[Any]:
    x = torch.zeros(5, dim, dtype=dtype, device=device)
    w1 = torch.zeros(4, dim, hidden, dtype=dtype, device=device)
    w2 = torch.zeros(4, hidden, dim, dtype=dtype, device=device)
    return [x, (w1, w2, w1)]


@pytest.mark.parametrize(
    ("dim", "hidden", "dtype", "runs"),
    [
        (8, 12, torch.float32, True),  # rows of 32 and 48 bytes
        (8, 16, torch.float16, True),  # rows of 16 and 32 bytes
        (8, 16, torch.bfloat16, True),
        (6, 12, torch.float32, False),  # 24-byte rows: _grouped_mm refuses the strides
        (8, 10, torch.float32, False),
        (8, 12, torch.bfloat16, False),  # 24-byte hidden rows
        (8, 12, torch.float64, False),  # a dtype _grouped_mm does not take
    ],
)
def test_when_grouped_gemm_runs_on_cpu(
    dim: int, hidden: int, dtype: torch.dtype, runs: bool
) -> None:
    x, weights = _tensors(dim, hidden, dtype)
    assert grouped_mm_supported(x, weights) is runs
    experts = GroupedExperts(dim, hidden, 4).to(dtype)
    with _Ops() as ops:
        out = experts(torch.randn(10, dim, dtype=dtype), torch.tensor(COUNTS["spread"]))
    assert (ops.seen[GROUPED] == 3) is runs and out.shape == (10, dim)


def test_grouped_gemm_is_refused_where_it_would_change_or_break_the_run() -> None:
    x, weights = _tensors(8, 16, torch.float32)
    assert not grouped_mm_supported(x.to(torch.bfloat16), weights)  # mixed dtypes
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts mm, not _grouped_mm
        assert not grouped_mm_supported(x, weights)  # fp32 weights autocast would cast
        cast = autocast_weights(x, weights)
        assert all(w.dtype == torch.bfloat16 for w in cast)
        assert grouped_mm_supported(x, cast)  # the rows are cast per GEMM
        narrow = autocast_weights(x, _tensors(8, 12, torch.float32)[1])
        assert not grouped_mm_supported(x, narrow)  # hidden 12: 24-byte bf16 rows
    assert autocast_weights(x, weights) == tuple(weights)  # no autocast: as they are
    with FakeTensorMode():  # tracing: torch's meta kernel takes bfloat16 only
        fake, fake_weights = _tensors(8, 16, torch.float32)
        assert not grouped_mm_supported(fake, fake_weights)
        fake, fake_weights = _tensors(8, 16, torch.bfloat16)
        assert grouped_mm_supported(fake, fake_weights)
    for dtype, runs in ((torch.float32, False), (torch.bfloat16, True)):
        meta, meta_weights = _tensors(8, 16, dtype, "meta")
        assert grouped_mm_supported(meta, meta_weights) is runs


def test_the_switch_reaches_every_moe() -> None:
    moe = MoE(DIM, 16, 4, 2, grouped_mm=False)
    assert not moe.experts.grouped_mm
    model = torch.nn.Sequential(moe, MoE(DIM, 16, 4, 2))
    set_grouped_mm(model, False)
    assert not any(m.experts.grouped_mm for m in model)
    set_grouped_mm(model, True)
    assert all(m.experts.grouped_mm for m in model)


# -- plait train's expert-parallel layouts on the grouped path == one process -------------

#: 4 experts (top-2) and a shared one per block; expert width 40 (160-byte fp32 rows:
#: grouped GEMM runs; the automatic 42 would take the loop).
GROUPED_TINY = TINY.replace(
    experts=4, top_k=2, shared_experts=1, expert_hidden=40, bias_update_speed=0.01, grad_clip=0.5
)


def _train_counting(cfg: Any, run_dir: str) -> tuple[Any, int, int]:
    """Train on this worker; also count the experts' grouped GEMMs (forward calls) and
    their loop's host reads of the counts."""
    original, original_host = torch._grouped_mm, swiglu.host_counts
    calls = Counter[str]()

    def grouped(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["grouped"] += 1
        return original(*args, **kwargs)

    def host(*args: Any) -> list[int]:
        calls["loop"] += 1
        return original_host(*args)

    torch._grouped_mm, swiglu.host_counts = grouped, host
    try:
        result = train_on_rank(cfg, run_dir)
    finally:
        torch._grouped_mm, swiglu.host_counts = original, original_host
    return result, calls["grouped"], calls["loop"]


def _loads(run_dir: Path) -> list[Any]:
    return [r["expert_load"] for r in read_metrics(run_dir) if "expert_load" in r]


@pytest.mark.parametrize(
    ("world", "layout"),
    [(2, {"ep": 2, "dp_shard": 2}), (4, {"ep": 2, "dp_shard": 2, "tp": 2})],
    ids=["ep2_dp_shard2", "ep2_tp2"],
)
def test_grouped_experts_train_like_one_process(
    world: int, layout: dict[str, int], tmp_path: Path
) -> None:
    reference = run_train(GROUPED_TINY, 1, tmp_path / "reference")
    cfg = GROUPED_TINY.replace(**layout)
    for result, grouped, loop in run_on_ranks(world, _train_counting, cfg, str(tmp_path / "run")):
        assert grouped > 0 and loop == 0, (grouped, loop)
        assert_losses_close(result.losses, reference.losses, 5e-6)
        assert_losses_close(list(result.val_losses.values()), list(reference.val_losses.values()))
    assert _loads(tmp_path / "run") == _loads(tmp_path / "reference")
