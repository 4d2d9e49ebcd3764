"""Packed rows through a variable-length attention kernel (:mod:`plait.train.varlen`).

The real kernel (flash's ``varlen_attn``) runs on CUDA only. On the CPU a reference of the
same semantics, written here (each document on its own, causal SDPA), stands in for it
(substituted where :mod:`plait.train.packing` looks the kernel up), so plait's plumbing is
checked without it: the document boundaries computed on the host, the rows flattened,
grouped key/value heads, the layout transposed back, the gradients, activation
checkpointing's recompute, autocast, ``torch.compile``. The oracle is the dense-mask SDPA
path the CPU keeps. The CUDA test runs the real kernel against the dense mask.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import test_train_packed as packed_step_module
import torch
from torch.nn import functional as F

from plait.checkpoint import checkpoint
from plait.train import packing as packing_module
from plait.train import varlen as varlen_module
from plait.train.compiled import CompileCounters
from plait.train.gpt_config import GPTConfig
from plait.train.llama import Llama, LlamaConfig
from plait.train.model import GPT
from plait.train.packing import (
    Packing,
    causal_attention,
    document_bounds,
    document_mask,
    packing,
)
from plait.train.step import _rows as microbatches
from plait.train.step import step_batch
from plait.train.varlen import VarlenKernel, _flash_varlen, flash_call, varlen_kernel

from train_helpers import TINY, documents_of

T = 12
#: Per row, where each document starts: uneven lengths, one-token documents (row 0 ends
#: with one, row 2 is nothing but), a row that is a single document (row 1).
STARTS = ((0, 3, 4, 9, 11), (0,), tuple(range(T)), (0, 1, 7))


def _documents(starts: tuple[tuple[int, ...], ...] = STARTS, t: int = T) -> torch.Tensor:
    return documents_of(starts, t)


def reference_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    longest: int,
    gqa: bool,
) -> torch.Tensor:
    """The kernel's semantics, one document at a time: ``(tokens, heads, d)`` in and out,
    causal attention inside each document of ``cu_seqlens``."""
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1
    bounds = cu_seqlens.tolist()
    assert bounds[0] == 0 and bounds[-1] == q.shape[0] and bounds == sorted(bounds)
    pieces = []
    for s, e in itertools.pairwise(bounds):
        assert e - s <= longest, "longest must bound every document"
        if e == s:  # padding: an empty document
            continue
        qd, kd, vd = (x[s:e].transpose(0, 1)[None] for x in (q, k, v))  # (1, heads, L, d)
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=gqa)
        pieces.append(out[0].transpose(0, 1))
    return torch.cat(pieces)


class Calls:
    """A kernel's run wrapped to count its calls and the key/value heads it is given."""

    def __init__(self, run: Callable[..., torch.Tensor]) -> None:
        self.run, self.n = run, 0
        self.kv_heads: set[int] = set()

    def __call__(self, *args: Any) -> torch.Tensor:
        self.n += 1
        self.kv_heads.add(args[1].shape[1])  # k: (tokens, kv heads, d)
        return self.run(*args)


def _substitute(monkeypatch: pytest.MonkeyPatch, dtypes: tuple[torch.dtype, ...]) -> Calls:
    """Make the CPU run the reference as packed rows' varlen kernel, for ``dtypes``;
    returns its call counter."""
    calls = Calls(reference_varlen)
    kernel = VarlenKernel(calls, device_type="cpu", dtypes=dtypes)
    monkeypatch.setattr(packing_module, "varlen_kernel", lambda device: kernel)
    return calls


@pytest.fixture
def masks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the dense masks built (one entry per build)."""
    built: list[int] = []

    def counted(documents: torch.Tensor) -> torch.Tensor:
        built.append(1)
        return document_mask(documents)

    monkeypatch.setattr(packing_module, "document_mask", counted)
    return built


# ----------------------------------------------------------------------------------------
# Boundaries on the host
# ----------------------------------------------------------------------------------------


def _brute_bounds(documents: torch.Tensor) -> tuple[list[list[int]], int]:
    rows = []
    for row in documents.tolist():
        starts = [i for i in range(len(row)) if i == 0 or row[i] != row[i - 1]]
        rows.append([*starts, len(row)])
    width = max(len(r) for r in rows)
    padded = [r + [len(documents[0])] * (width - len(r)) for r in rows]
    longest = max(b - a for r in rows for a, b in itertools.pairwise(r))
    return padded, longest


def test_document_bounds_match_a_brute_force_count() -> None:
    generator = torch.Generator().manual_seed(0)
    cases = [_documents(), _documents(((0,),)), _documents((tuple(range(T)),))]
    for _ in range(20):
        b, t = (int(x) for x in torch.randint(1, 9, (2,), generator=generator))
        # Non-decreasing ids: a document starts where the increment is positive.
        steps = (torch.rand(b, t, generator=generator) < 0.3).long()
        steps[:, 0] = 0
        cases.append(steps.cumsum(dim=1))
    for documents in cases:
        bounds, longest = document_bounds(documents)
        expected, expected_longest = _brute_bounds(documents)
        assert bounds.dtype == torch.int32
        assert bounds.tolist() == expected, documents
        assert longest == expected_longest


def test_packing_flattens_the_rows_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """cu_seqlens: each row's documents offset by the row, padding as empty documents."""
    _substitute(monkeypatch, (torch.float32,))
    documents = _documents()
    bounds, longest = document_bounds(documents)
    pack = packing(documents, None, False, bounds, longest)
    assert pack is not None and pack.spans is not None and pack.mask is None
    expected = [0]
    for row, starts in enumerate(STARTS):
        row_bounds = [*starts[1:], T] + [T] * (bounds.shape[1] - 1 - len(starts))
        expected += [row * T + s for s in row_bounds]
    assert pack.spans.cu_seqlens.tolist() == expected
    assert pack.spans.longest == longest == T  # row 1 is one document


# ----------------------------------------------------------------------------------------
# The attention: the kernel's path equals the dense mask's
# ----------------------------------------------------------------------------------------


def _qkv(dtype: torch.dtype, kv_heads: int, heads: int = 4, d: int = 8) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    b = len(STARTS)
    shapes = ((b, heads, T, d), (b, kv_heads, T, d), (b, kv_heads, T, d))
    return [torch.randn(s, generator=generator).to(dtype).requires_grad_() for s in shapes]


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


def _attend(
    qkv: list[torch.Tensor], pack: Packing | None, gqa: bool, fn: Attention | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and the q, k, v gradients of a weighted sum of it, through ``fn`` (default:
    :func:`causal_attention`)."""
    q, k, v = (x.detach().requires_grad_() for x in qkv)
    out = causal_attention(q, k, v, pack, enable_gqa=gqa) if fn is None else fn(q, k, v, pack)
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out).to(out.dtype)
    (out * weights).sum().backward()
    return out.detach(), [x.grad for x in (q, k, v) if x.grad is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_kernel_path_equals_the_dense_mask(
    dtype: torch.dtype, kv_heads: int, masks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    documents = _documents()
    qkv = _qkv(dtype, kv_heads)
    gqa = kv_heads != 4
    dense = packing(documents, None, False)  # no bounds: the dense mask, as before
    assert dense is not None and dense.mask is not None and dense.spans is None
    expected, expected_grads = _attend(qkv, dense, gqa)

    calls = _substitute(monkeypatch, (dtype,))
    masks.clear()
    pack = packing(documents, None, False, *document_bounds(documents))
    assert pack is not None and pack.spans is not None and pack.mask is None
    out, grads = _attend(qkv, pack, gqa)
    assert calls.n == 1 and masks == [], "the kernel runs, and no dense mask is built"
    assert out.dtype == dtype and out.shape == expected.shape
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, expected, **tol)
    assert len(grads) == 3
    for got, want, name in zip(grads, expected_grads, "qkv", strict=True):
        assert got.shape == want.shape  # grouped k, v keep their own heads
        torch.testing.assert_close(got, want, **tol, msg=name)


def test_a_call_the_kernel_does_not_take_falls_back_to_one_mask(
    masks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 into a bf16-only kernel, and dropout: the dense mask, built once per forward."""
    documents = _documents()
    qkv = _qkv(torch.float32, 4)
    expected, expected_grads = _attend(qkv, packing(documents, None, False), False)
    calls = _substitute(monkeypatch, (torch.bfloat16,))
    masks.clear()
    pack = packing(documents, None, False, *document_bounds(documents))
    assert pack is not None and pack.spans is not None
    for _ in range(3):  # three blocks of one forward share one mask
        out, grads = _attend(qkv, pack, False)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert calls.n == 0 and masks == [1]
    q, k, v = qkv
    kernel = VarlenKernel(reference_varlen, device_type="cpu", dtypes=(torch.float32,))
    assert kernel.takes(q, k, v, 0.0) and not kernel.takes(q, k, v, 0.1)  # no dropout
    assert not VarlenKernel(reference_varlen).takes(q, k, v, 0.0)  # a CUDA kernel


def test_autocast_computes_in_its_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 inputs under bf16 autocast: the kernel takes them, in bf16, as SDPA would."""
    documents = _documents()
    qkv = _qkv(torch.float32, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_grads = _attend(qkv, packing(documents, None, False), False)
        calls = _substitute(monkeypatch, (torch.bfloat16,))
        pack = packing(documents, None, False, *document_bounds(documents))
        out, grads = _attend(qkv, pack, False)
    assert calls.n == 1 and out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_cpu_run_keeps_the_dense_mask() -> None:
    """No kernel substituted: the CPU builds the mask as before, bounds or not."""
    documents = _documents()
    pack = packing(documents, None, False, *document_bounds(documents))
    assert pack is not None and pack.spans is None and pack.mask is not None
    qkv = _qkv(torch.float32, 2)
    out, grads = _attend(qkv, pack, True)
    expected, expected_grads = _attend(qkv, packing(documents, None, False), True)
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))


# ----------------------------------------------------------------------------------------
# Through the models, with activation checkpointing
# ----------------------------------------------------------------------------------------

#: test_train_packed's tiny Llama (grouped key/value heads) with a 64-token vocabulary.
HF: dict[str, Any] = packed_step_module.HF | {"vocab_size": 64}


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=T, n_layer=2, n_head=2, d_model=16, vocab_size=64))


def _llama(repeat_kv: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_hf(HF), seq_len=T)
    for block in model.blocks:
        block.attn.repeat_kv = repeat_kv  # False: grouped heads into the kernel
    return model


MODELS = {
    "gpt": _gpt,
    "llama_repeated_kv": functools.partial(_llama, True),
    "llama_grouped_kv": functools.partial(_llama, False),
}


def _step(model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    inputs = torch.randint(0, 64, (len(STARTS), T), generator=torch.Generator().manual_seed(2))
    logits = model(inputs, **kwargs)
    logits.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "checkpointed"])
def test_model_through_the_kernel_equals_the_dense_mask(
    name: str, recompute: bool, masks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    documents = _documents()
    bounds, longest = document_bounds(documents)
    expected, expected_grads = _step(MODELS[name](), {"documents": documents})
    model = MODELS[name]()
    if recompute:
        for block in model.blocks:
            checkpoint(block)
    calls = _substitute(monkeypatch, (torch.float32,))
    masks.clear()
    kwargs = {"documents": documents, "bounds": bounds, "longest": longest}
    logits, grads = _step(model, kwargs)
    blocks = len(model.blocks)
    assert calls.n == blocks * (2 if recompute else 1), "every block, and its recompute"
    assert masks == []
    if name.startswith("llama"):  # grouped heads go in as they are, repeat_kv or not
        attn = model.blocks[0].attn
        assert (
            calls.kv_heads == {attn.k.out_features // attn.head_dim} != {HF["num_attention_heads"]}
        )
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, expected_grads[n], rtol=1e-5, atol=1e-6, msg=n)


# ----------------------------------------------------------------------------------------
# The step's batch carries the boundaries
# ----------------------------------------------------------------------------------------


def test_step_batch_carries_the_bounds_cut_into_microbatches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a kernel runs; elsewhere (this CPU, nothing substituted) nothing computes
    boundaries no attention would read."""
    documents = _documents()
    inputs = torch.zeros_like(documents)
    assert step_batch(inputs, inputs, documents, TINY, None).bounds is None
    _substitute(monkeypatch, (torch.float32,))
    batch = step_batch(inputs, inputs, documents, TINY, None)
    bounds, longest = document_bounds(documents)
    assert batch.bounds is not None and torch.equal(batch.bounds, bounds)
    assert batch.longest == longest
    kwargs = batch.model_kwargs()
    assert kwargs["longest"] == longest and kwargs["bounds"] is batch.bounds
    for i, mb in enumerate(microbatches(batch, 2)):
        assert mb.bounds is not None and torch.equal(mb.bounds, bounds[2 * i : 2 * i + 2])
        assert mb.longest == longest  # the batch's bounds each microbatch's
    plain = step_batch(inputs, inputs, torch.zeros_like(documents), TINY, None)
    assert plain.bounds is None and plain.model_kwargs() == {}


@pytest.mark.parametrize("model_config", ["", "llama"])
def test_a_training_step_through_the_kernel_equals_the_dense_mask(
    model_config: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``plait train``'s step (2 microbatches, full activation checkpointing): the loss,
    the validation loss and every gradient as with the dense mask."""
    if model_config:
        model_config = str(tmp_path / "config.json")
        Path(model_config).write_text(json.dumps(packed_step_module.HF))
    fields = {"dp_shard": 1, "microbatches": 2, "ac": "full"}
    loss, val, grads = packed_step_module._step_on_rank(fields, model_config)
    calls = _substitute(monkeypatch, (torch.float32,))
    got_loss, got_val, got_grads = packed_step_module._step_on_rank(fields, model_config)
    assert calls.n > 0
    assert abs(got_loss - loss) < 1e-6 and abs(got_val - val) < 1e-6
    assert got_grads.keys() == grads.keys()
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------------------
# torch.compile: no graph break, no recompile from batch to batch
# ----------------------------------------------------------------------------------------


def _backward_math(
    g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention's gradients per document (softmax's, by hand)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    bounds = cu.tolist()
    scale = q.shape[-1] ** -0.5
    for s, e in itertools.pairwise(bounds):
        if e == s:
            continue
        qd, kd, vd, gd = (x[s:e].transpose(0, 1) for x in (q, k, v, g))  # (heads, L, d)
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        p = (qd @ kd.transpose(1, 2) * scale).masked_fill(~causal, float("-inf")).softmax(-1)
        dp = gd @ vd.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[s:e] = (ds @ kd * scale).transpose(0, 1)
        dk[s:e] = (ds.transpose(1, 2) @ qd * scale).transpose(0, 1)
        dv[s:e] = (p.transpose(1, 2) @ gd).transpose(0, 1)
    return dq, dk, dv


@functools.cache
def _reference_op() -> Callable[..., torch.Tensor]:
    """The reference as a custom op with an int ``longest`` (as ``varlen_attn``'s), so a
    compiled graph holds it as one node."""

    @torch.library.custom_op("plait_test::varlen_reference", mutates_args=())
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int
    ) -> torch.Tensor:
        return reference_varlen(q, k, v, cu, longest, False)

    @torch.library.custom_op("plait_test::varlen_reference_backward", mutates_args=())
    def backward(
        g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward_math(g, q, k, v, cu)

    @forward.register_fake
    def _(q: torch.Tensor, k: Any, v: Any, cu: Any, longest: int) -> torch.Tensor:
        return torch.empty_like(q)

    @backward.register_fake
    def _(g: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: Any) -> Any:
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs[:4])

    def grads(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return (*torch.ops.plait_test.varlen_reference_backward(g, *ctx.saved_tensors), None, None)

    forward.register_autograd(grads, setup_context=setup)

    def run(q: Any, k: Any, v: Any, cu: Any, longest: int, gqa: bool) -> torch.Tensor:
        out: torch.Tensor = torch.ops.plait_test.varlen_reference(q, k, v, cu, longest)
        return out

    return run


def _batches() -> Iterator[torch.Tensor]:
    """Batches of different document counts and longest documents."""
    yield _documents()
    yield _documents(((0, 6), (0, 2, 3), (0,), (0, 11)))
    yield _documents(((0, 1, 2, 3), (0, 4, 8), (0, 5), (0, 1)))


def test_compiled_attention_keeps_one_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    # The op itself, uncounted: a counter's mutation would be a guard of the graph.
    kernel = VarlenKernel(_reference_op(), device_type="cpu", dtypes=(torch.float32,))
    monkeypatch.setattr(packing_module, "varlen_kernel", lambda device: kernel)

    def attention(q: Any, k: Any, v: Any, pack: Packing) -> torch.Tensor:
        return causal_attention(q * 2, k, v, pack).sin()

    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    before = CompileCounters.read()
    for documents in _batches():
        pack = packing(documents, None, False, *document_bounds(documents))
        assert pack is not None and pack.spans is not None
        qkv = _qkv(torch.float32, 4)
        out, grads = _attend(qkv, pack, False, compiled)
        expected, expected_grads = _attend(qkv, packing(documents, None, False), False, attention)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    done = CompileCounters.read().since(before)
    assert (done.graphs, done.graph_breaks) == (1, 0)


# ----------------------------------------------------------------------------------------
# torch's varlen_attn, across its versions
# ----------------------------------------------------------------------------------------


def _signature_2_10(
    q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, *, is_causal: bool = False
) -> Any:
    return {"max": (max_q, max_k), "is_causal": is_causal}


def _signature_2_11(
    q: Any,
    k: Any,
    v: Any,
    cu_q: Any,
    cu_k: Any,
    max_q: int,
    max_k: int,
    *,
    window_size: tuple[int, int] = (-1, -1),
) -> Any:
    return {"max": (max_q, max_k), "window_size": window_size}


def _signature_2_13(
    q: Any,
    k: Any,
    v: Any,
    cu_q: Any,
    cu_k: Any,
    max_q: int,
    max_k: int,
    *,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> Any:
    return {"max": (max_q, max_k), "window_size": window_size, "enable_gqa": enable_gqa}


def test_flash_call_spells_causality_as_the_installed_torch_does() -> None:
    x, cu = torch.zeros(1), torch.zeros(1)
    calls = {f.__name__: flash_call(f) for f in (_signature_2_10, _signature_2_11, _signature_2_13)}
    assert all(c is not None for c in calls.values())
    got = {name: c(x, x, x, cu, 7, True) for name, c in calls.items() if c is not None}
    assert got["_signature_2_10"] == {"max": (7, 7), "is_causal": True}
    # Without enable_gqa the grouped heads go as they are: flash takes them natively.
    assert got["_signature_2_11"] == {"max": (7, 7), "window_size": (-1, 0)}
    assert got["_signature_2_13"] == {"max": (7, 7), "window_size": (-1, 0), "enable_gqa": True}
    assert flash_call(lambda q, k, v, cu_q, cu_k, max_q, max_k: None) is None


def test_the_installed_varlen_attn_takes_the_arguments() -> None:
    """This torch's kernel binds plait's arguments; on the CPU it then has no kernel."""
    flash = _flash_varlen()
    assert flash is not None, f"torch {torch.__version__} has no usable varlen_attn"
    q, kv = torch.randn(5, 4, 8), torch.randn(5, 2, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(NotImplementedError):  # not TypeError: the signature fits
        flash(q, kv, kv, cu, 3, True)
    assert varlen_kernel(torch.device("cpu")) is None


def test_the_environment_can_keep_the_dense_mask_on_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PLAIT_VARLEN=0``: a way around a torch whose kernel fails, keeping packing. Asked
    as a CUDA GPU that runs flash (stood in here: no GPU needed)."""
    monkeypatch.setattr(varlen_module, "_runs_flash", lambda device: True)
    flash = flash_call(reference_varlen_signature)
    monkeypatch.setattr(varlen_module, "_flash_varlen", lambda: flash)
    cuda = torch.device("cuda")
    kernel = varlen_kernel(cuda)
    assert kernel is not None and kernel.run is flash
    monkeypatch.setenv(varlen_module.DISABLE, "0")
    assert varlen_kernel(cuda) is None
    monkeypatch.setenv(varlen_module.DISABLE, "1")
    assert varlen_kernel(cuda) is kernel


def reference_varlen_signature(
    q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, *, window_size: Any
) -> Any:
    """A ``varlen_attn`` signature (never called)."""
    raise AssertionError("not called")


# ----------------------------------------------------------------------------------------
# CUDA: the real kernel
# ----------------------------------------------------------------------------------------


def _grouped(q: Any, k: Any, v: Any, pack: Packing, gqa: bool) -> torch.Tensor:
    return causal_attention(q, k, v, pack, enable_gqa=gqa)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: flash's variable-length kernel (varlen_attn) runs on CUDA GPUs only",
)
def test_flash_varlen_on_cuda_matches_the_dense_mask(
    masks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16, heads and grouped heads, eager and compiled, then a Llama under bf16
    autocast: the real kernel runs (no mask is built) and gives the dense mask's outputs
    and gradients within bf16's tolerance."""
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) < (8, 0):
        pytest.skip("flash attention needs compute capability 8.0 or later")
    real = varlen_kernel(device)
    assert real is not None, f"no variable-length kernel in torch {torch.__version__}"
    calls = Calls(real.run)  # the real kernel, counted
    kernel = dataclasses.replace(real, run=calls)
    monkeypatch.setattr(packing_module, "varlen_kernel", lambda device: kernel)
    t = 256
    starts = ((0, 17, 18, 100, 255), (0,), (0, 1, 2, 3, 130), (0, 64, 192))
    documents = _documents(starts, t).to(device)
    bounds, longest = document_bounds(documents.cpu())  # on the host, as step_batch does
    dense = packing(documents, None, False)
    pack = packing(documents, None, False, bounds.to(device), longest)
    assert pack is not None and pack.mask is None and pack.spans is not None
    generator = torch.Generator(device).manual_seed(0)
    for kv_heads in (8, 2):
        shapes = ((4, 8, t, 64), (4, kv_heads, t, 64), (4, kv_heads, t, 64))
        qkv = [
            torch.randn(s, device=device, generator=generator, dtype=torch.bfloat16) for s in shapes
        ]
        gqa = kv_heads != 8
        expected, expected_grads = _attend(qkv, dense, gqa)
        attend = functools.partial(_grouped, gqa=gqa)
        compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
        for fn in (attend, compiled):
            before = calls.n
            masks.clear()
            out, grads = _attend(qkv, pack, gqa, fn)
            assert calls.n == before + 1 and masks == [], "the kernel ran, no mask was built"
            torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
            for got, want, name in zip(grads, expected_grads, "qkv", strict=True):
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2, msg=name)

    # The models' path: fp32 weights under bf16 autocast, grouped heads into the kernel.
    torch.manual_seed(0)
    hf = HF | {"hidden_size": 256, "max_position_embeddings": t}
    model = Llama(LlamaConfig.from_hf(hf), seq_len=t).to(device)
    for block in model.blocks:
        block.attn.repeat_kv = False
    inputs = torch.randint(0, 64, (4, t), device=device, generator=generator)

    def step(**kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(inputs, documents, **kwargs).float()
        logits.square().mean().backward()
        return logits.detach(), {
            n: p.grad for n, p in model.named_parameters() if p.grad is not None
        }

    expected, expected_grads = step()
    before = calls.n
    masks.clear()
    logits, grads = step(bounds=bounds.to(device), longest=longest)
    assert calls.n == before + len(model.blocks) and masks == []
    torch.testing.assert_close(logits, expected, rtol=2e-2, atol=2e-2)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        error = (grad - expected_grads[name]).norm() / expected_grads[name].norm().clamp(min=1e-12)
        assert error < 3e-2, (name, float(error))
