"""``plait.context``: attention over a sequence split across cp ranks equals one process.

Single-process tests pin the layouts (which tokens each rank holds, the round trip), the
block merge and block gradients of the ring, and the refusals that need no peers.
Multi-process tests run every method (allgather, ring, alltoall), plain and load-balanced,
causal or not, with and without packed documents (and grouped-query heads), at cp 2 and
4: outputs and q/k/v gradients, unsharded, equal single-process SDPA over the whole
sequence. Then a two-layer causal transformer under torch's ``context_parallel`` (inputs,
labels and positions sharded as buffers) and under ``apply_context_parallel`` with
activation-checkpointed blocks gives the single-process loss, logits and parameter
gradients (summed over cp).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from plait.checkpoint import checkpoint
from plait.context import (
    SequenceLayout,
    UnsupportedAttention,
    apply_context_parallel,
    context_parallel,
    context_parallel_attention,
    context_parallel_unshard,
    packed_documents,
    sequence_positions,
    set_rotate_method,
    shard_sequence,
    unshard_sequence,
)
from plait.context.blocks import (
    ChunkDocs,
    block_attention,
    block_grads,
    blocked_attention,
    merge,
    plan_blocks,
)
from plait.context.masks import allowed
from plait.plan.live import LiveTensors

from harness import run_on_ranks
from in_order_p2p import in_order_p2p

TIMEOUT = 60.0
ATOL, RTOL = 1e-6, 1e-5


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _documents(batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """Packed sequences: document ids rising at random boundaries, per row."""
    return torch.cumsum((torch.rand(batch, seq, generator=gen) < 0.25).long(), dim=1)


def _reference_mask(seq: int, causal: bool, docs: torch.Tensor | None) -> torch.Tensor:
    mask = torch.ones(seq, seq, dtype=torch.bool)
    mask = (mask.tril() if causal else mask)[None, None]
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])[:, None]
    return mask


# -- one process -----------------------------------------------------------------------


def test_layouts_hold_the_right_tokens_and_round_trip() -> None:
    balanced, plain = SequenceLayout(2, True), SequenceLayout(2, False)
    assert balanced.positions(0, 4).tolist() == [0, 1, 6, 7]
    assert balanced.positions(1, 4).tolist() == [2, 3, 4, 5]
    assert plain.positions(1, 4).tolist() == [4, 5, 6, 7]
    for cp, lb in itertools.product((2, 4), (True, False)):
        layout = SequenceLayout(cp, lb)
        x = torch.arange(3 * 16).view(3, 16)
        parts = [layout.shard(x, 1, r) for r in range(cp)]
        for r, part in enumerate(parts):
            assert torch.equal(part, x[:, layout.positions(r, 16 // cp)])
        assert torch.equal(layout.restore(torch.cat(parts, 1), 1), x)


def test_uneven_sequences_are_refused_with_the_sizes_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"12 tokens.*2 \* cp = 8.*load_balance=False"):
        SequenceLayout(4, True).check_global(12)
    with pytest.raises(ValueError, match=r"10 tokens.*cp = 4.*Pad"):
        SequenceLayout(4, False).check_global(10)
    with pytest.raises(ValueError, match=r"3 tokens per rank \(6 over cp=2\)"):
        SequenceLayout(2, True).positions(0, 3)
    with pytest.raises(NotImplementedError, match="'zigzag'"):
        set_rotate_method("zigzag")


def test_block_merge_and_block_gradients_equal_whole_attention() -> None:
    """The ring's arithmetic: key blocks (one fully masked for some queries) merged by
    log-sum-exp give SDPA, and the block gradients sum to autograd's."""
    q, k, v = (torch.randn(2, 3, 6, 4, requires_grad=True) for _ in range(3))
    docs = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]])
    pos = torch.arange(6)
    mask = allowed(pos, pos, True, docs, docs)
    assert mask is not None
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    out = lse = None
    pieces = ((slice(0, 2), slice(2, 6)), (slice(2, 6), slice(0, 2)))
    for keys, _ in pieces:
        out, lse = merge(
            out, lse, *block_attention(q, k[:, :, keys], v[:, :, keys], mask[..., keys], 0.5)
        )
    assert out is not None and lse is not None
    _close(out, want, "merged output")
    delta = (dout * out).sum(-1)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for keys, _ in pieces:
        bq, bk, bv = block_grads(
            q, k[:, :, keys], v[:, :, keys], mask[..., keys], 0.5, dout, lse, delta
        )
        dq += bq
        dk[:, :, keys] += bk
        dv[:, :, keys] += bv
    for got, grad, name in zip((dq, dk, dv), want_grads, "qkv", strict=True):
        _close(got.detach(), grad, f"d{name}")


def _blocked_case(
    q_chunks: list[int], causal: bool, docs: torch.Tensor | None, kinds: set[str]
) -> None:
    """Local query chunks ``q_chunks`` (of 4 chunks of 16 tokens) over all keys in natural
    order as planned fused blocks: output and gradients equal SDPA's rows of them."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 64, 8, generator=gen) for _ in range(3))
    dout = torch.randn(2, 3, 64, 8, generator=gen)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*whole, attn_mask=_reference_mask(64, causal, docs))
    rows = torch.cat([torch.arange(16 * c, 16 * (c + 1)) for c in q_chunks])
    want.backward(torch.zeros_like(dout).index_copy(2, rows, dout[:, :, rows]))
    chunk_docs = None if docs is None else ChunkDocs.of(docs, 16)
    plan = plan_blocks(q_chunks, range(4), 16, causal, chunk_docs, q.device)
    assert {b.kind for b in plan} == kinds, [b.kind for b in plan]
    local = [q[:, :, rows].clone().requires_grad_(), k.clone().requires_grad_(),
             v.clone().requires_grad_()]  # fmt: skip
    out = blocked_attention(*local, plan, 8**-0.5)  # SDPA's default scale
    out.backward(dout[:, :, rows])
    _close(out.detach(), want.detach()[:, :, rows], "output")
    assert local[0].grad is not None and whole[0].grad is not None
    _close(local[0].grad, whole[0].grad[:, :, rows], "dq")
    for part, ref, name in zip(local[1:], whole[1:], "kv", strict=True):
        assert part.grad is not None and ref.grad is not None
        _close(part.grad, ref.grad, f"d{name}")


def test_fused_blocks_equal_sdpa_with_gradients() -> None:
    """The fused kernels merged by log-sum-exp, and their backward from the merged output
    and log-sum-exp: a causal diagonal block plus an unmasked prefix, whole unmasked
    blocks, and with documents the masked / skipped / fused mix; equal SDPA to 1e-6."""
    _blocked_case([2], True, None, {"full", "causal"})  # prefix (chunks 0-1) + diagonal
    _blocked_case([0, 3], True, None, {"full", "causal"})  # a load-balanced rank's rows
    _blocked_case([1, 2], False, None, {"full"})  # one unmasked block for both chunks
    docs = torch.tensor([[0] * 32 + [1] * 16 + [2] * 16, [0] * 36 + [1] * 28])
    _blocked_case([3, 1], True, docs, {"full", "causal", "masked"})
    _blocked_case([0, 2], False, docs, {"full", "masked"})


# -- the methods, on ranks -------------------------------------------------------------


def _attention_case(
    method: str, lb: bool, causal: bool, docs_on: bool, gqa: bool, group: dist.ProcessGroup
) -> None:
    batch, heads, seq, dim = 2, 4, 16, 8
    kv_heads = 2 if gqa else heads
    gen = torch.Generator().manual_seed(1)  # the same whole tensors on every rank
    q = torch.randn(batch, heads, seq, dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=gen) for _ in range(2))
    dout = torch.randn(batch, heads, seq, dim, generator=gen)
    docs = _documents(batch, seq, gen) if docs_on else None
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = _reference_mask(seq, causal, docs)
    want = F.scaled_dot_product_attention(*whole, attn_mask=mask, enable_gqa=gqa)
    want.backward(dout)

    local = [shard_sequence(t, group, 2, load_balance=lb).requires_grad_() for t in (q, k, v)]
    local_docs = None if docs is None else shard_sequence(docs, group, 1, load_balance=lb)
    out = context_parallel_attention(
        *local,
        group,
        method=method,  # type: ignore[arg-type]
        load_balance=lb,
        is_causal=causal,
        document_ids=local_docs,
        enable_gqa=gqa,
    )
    out.backward(shard_sequence(dout, group, 2, load_balance=lb))
    case = f"{method}, load_balance={lb}, causal={causal}, documents={docs_on}, gqa={gqa}"
    _close(unshard_sequence(out, group, 2, load_balance=lb), want.detach(), f"{case}: output")
    for part, ref, name in zip(local, whole, "qkv", strict=True):
        assert part.grad is not None and ref.grad is not None
        _close(unshard_sequence(part.grad, group, 2, load_balance=lb), ref.grad, f"{case}: d{name}")


def _every_method_is_exact() -> None:
    group = dist.group.WORLD
    assert group is not None
    for method, lb, causal, docs_on in itertools.product(
        ("allgather", "ring", "alltoall"), (True, False), (True, False), (False, True)
    ):
        _attention_case(method, lb, causal, docs_on, False, group)
    for method in ("allgather", "ring", "alltoall"):  # grouped-query heads
        _attention_case(method, True, True, True, True, group)


@pytest.mark.parametrize("cp", [2, 4])
def test_every_method_equals_one_process(cp: int) -> None:
    run_on_ranks(cp, _every_method_is_exact, timeout=TIMEOUT)


MEMORY_SEQ, MEMORY_HEADS, MEMORY_DIM = 2048, 2, 16


def _attention_peak(method: str, causal: bool, documents: bool) -> int:
    """Bytes of the live-tensor peak of one attention forward and backward on this rank
    (beyond the inputs and the incoming gradient), load-balanced layout."""
    group = dist.group.WORLD
    assert group is not None
    shape = (1, MEMORY_HEADS, MEMORY_SEQ // dist.get_world_size(), MEMORY_DIM)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape)
    docs = None
    if documents:  # documents of 300 tokens: blocks of one, of none, and cut ones
        whole = torch.arange(MEMORY_SEQ)[None] // 300
        docs = shard_sequence(whole, group, 1)
    with LiveTensors() as live:
        out = context_parallel_attention(
            q,
            k,
            v,
            group,
            method=method,
            is_causal=causal,
            document_ids=docs,  # type: ignore[arg-type]
        )
        out.backward(dout)
        del out
    return live.peak


def _attention_memory() -> dict[str, int]:
    return {
        f"{method} causal={causal} documents={docs}": _attention_peak(method, causal, docs)
        for method in ("allgather", "ring", "alltoall")
        for causal, docs in ((True, False), (False, False), (True, True))
    }


def test_attention_memory_per_rank_is_linear_in_the_sequence() -> None:
    """cp 2, 2048 tokens, 2 heads of 16: the live-tensor peak of one attention forward +
    backward is a few times one local q (128 KiB; the gathered keys and values are 4 of
    them), never score-sized. The masked SDPA / explicit ring that fused blocks replaced
    peaked at 10.7 MiB (allgather, causal: its float mask), 20.7 MiB (alltoall, causal) and
    42 MiB (ring: fp32 score blocks); now 1.4-2.3 MiB, 3.5-4.7 MiB with documents (their
    cut 256-token tiles take the masked path)."""
    peaks = run_on_ranks(2, _attention_memory, timeout=TIMEOUT)
    local = MEMORY_HEADS * MEMORY_SEQ // 2 * MEMORY_DIM * 4  # one local q, k or v: 128 KiB
    scores = MEMORY_HEADS * (MEMORY_SEQ // 2) * MEMORY_SEQ * 4  # one (T/cp x T) fp32: 16 MiB
    for rank_peaks in peaks:
        for case, peak in rank_peaks.items():
            bound = (48 if "documents=True" in case else 24) * local
            assert peak <= bound, f"{case}: peak {peak / 2**20:.2f} MiB > {bound / 2**20} MiB"
            assert peak < scores / 2, case


def _refusals() -> None:
    group = dist.group.WORLD
    assert group is not None
    q = torch.randn(1, 3, 4, 8)  # 3 heads over cp=2
    with pytest.raises(ValueError, match=r"3 attention heads over cp=2"):
        context_parallel_attention(q, q, q, group, method="alltoall")
    odd = torch.randn(1, 2, 3, 8)  # 3 local tokens cannot be two balanced chunks
    with pytest.raises(ValueError, match=r"3 tokens per rank \(6 over cp=2\)"):
        context_parallel_attention(odd, odd, odd, group, method="ring")
    with pytest.raises(ValueError, match=r"10 tokens.*2 \* cp = 4"):
        shard_sequence(torch.zeros(2, 10), group, 1)
    with pytest.raises(ValueError, match="unknown attention method 'flash'"):
        context_parallel_attention(q, q, q, group, method="flash")  # type: ignore[arg-type]
    x = torch.randn(1, 2, 4, 8)
    with context_parallel(group):
        with pytest.raises(UnsupportedAttention, match="attn_mask.*is_causal=True"):
            F.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(4, 4, dtype=torch.bool))
        with pytest.raises(UnsupportedAttention, match="dropout_p=0.1"):
            F.scaled_dot_product_attention(x, x, x, dropout_p=0.1)
    tokens = torch.zeros(2, 6)
    with (
        pytest.raises(ValueError, match=r"6 tokens.*2 \* cp = 4"),
        context_parallel(group, buffers=[tokens], buffer_seq_dims=[1]),
    ):
        pass
    assert tokens.shape == (2, 6)  # refused before anything was sharded


def test_refusals_name_the_sizes_and_the_fix() -> None:
    run_on_ranks(2, _refusals, timeout=TIMEOUT)


# -- a model -----------------------------------------------------------------------------

VOCAB, DIM, HEADS, SEQ, BATCH = 32, 16, 4, 16, 2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(
            qkv[0], qkv[1], qkv[2], attn_mask=mask, is_causal=mask is None
        )  # (B, H, T, D)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: Any = None) -> Any:
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)  # (B, T, V)


def _batch(documents: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    positions = torch.arange(SEQ).repeat(BATCH, 1)
    docs = _documents(BATCH, SEQ, gen) if documents else torch.zeros(BATCH, SEQ, dtype=torch.long)
    return tokens, labels, positions, docs


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Summed over this rank's tokens, divided by the whole batch's count: the cp ranks'
    # losses (and gradients) then add up to the single-process mean.
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / (BATCH * SEQ)


def _reference(
    model: nn.Module, documents: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    tokens, labels, positions, docs = _batch(documents)
    mask = _reference_mask(SEQ, True, docs) if documents else None
    logits = model(tokens, positions, mask)
    loss = _loss(logits, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), logits.detach(), grads


def _check_against(
    model: nn.Module,
    want: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]],
    loss: torch.Tensor,
    logits: torch.Tensor,
    group: dist.ProcessGroup,
    case: str,
) -> None:
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    _close(total, want[0], f"{case}: loss")
    _close(logits, want[1], f"{case}: logits")
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        grad = param.grad.clone()
        dist.all_reduce(grad, group=group)  # each cp rank's loss covers its own tokens
        _close(grad, want[2][name], f"{case}: grad of {name}")


def _model_under_context_parallel() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    group = mesh.get_group()
    net = _Net()
    for method, documents, ckpt in (
        ("allgather", True, False),  # whole document ids, sharded by the context
        ("ring", True, True),  # document ids sharded in place as one of the buffers
        ("alltoall", False, True),
    ):
        want = _reference(copy.deepcopy(net), documents)
        model = copy.deepcopy(net)
        if ckpt:
            checkpoint(model.blocks[0])
        tokens, labels, positions, docs = _batch(documents)
        buffers = [tokens, labels, positions] + ([docs] if method == "ring" else [])
        if method == "alltoall":
            set_rotate_method("alltoall")  # torch's way of choosing the method
        try:
            with context_parallel(
                mesh,
                buffers=buffers,
                buffer_seq_dims=[1] * len(buffers),
                no_restore_buffers={labels},
                method=None if method == "alltoall" else method,  # type: ignore[arg-type]
                document_ids=docs if documents else None,
            ):
                assert tokens.shape == (BATCH, SEQ // dist.get_world_size())
                logits = model(tokens, positions)
                loss = _loss(logits, labels)
                loss.backward()
                (whole,) = context_parallel_unshard(mesh, [logits.detach()], [1])
        finally:
            set_rotate_method("allgather")
        assert tokens.shape == (BATCH, SEQ) and torch.equal(tokens, _batch(documents)[0])
        assert labels.shape == (BATCH, SEQ // dist.get_world_size())  # not restored
        _check_against(model, want, loss, whole, group, f"context_parallel {method}")


def _plans_once_per_forward() -> dict[str, int]:
    """How many times each method planned its blocks of packed documents over one forward
    and backward of a 2-block model (one block checkpointed: its recompute attends again)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    plans: dict[str, int] = {}
    original = ChunkDocs.__dict__["of"]  # the staticmethod itself, to put back
    of = ChunkDocs.of

    def counted(docs: torch.Tensor, chunk_len: int) -> ChunkDocs:
        plans[method] = plans.get(method, 0) + 1
        return of(docs, chunk_len)

    ChunkDocs.of = staticmethod(counted)  # type: ignore[method-assign,assignment]
    try:
        for method in ("allgather", "ring", "alltoall"):
            model = _Net()
            checkpoint(model.blocks[0])
            tokens, labels, positions, docs = _batch(True)
            with context_parallel(
                mesh,
                buffers=[tokens, labels, positions],
                buffer_seq_dims=[1, 1, 1],
                method=method,  # type: ignore[arg-type]
                document_ids=docs,
            ):
                _loss(model(tokens, positions), labels).backward()
    finally:
        ChunkDocs.of = original  # type: ignore[method-assign]
    return plans


def test_packed_documents_are_planned_once_per_forward() -> None:
    """Planning gathers the document ids (a collective), reads their spans on the host (a
    device sync on GPUs) and builds masks: once per forward, not once per attention call
    (2 layers, a recompute)."""
    for plans in run_on_ranks(2, _plans_once_per_forward, timeout=TIMEOUT):
        assert plans == {"allgather": 1, "ring": 1, "alltoall": 1}


def test_context_parallel_trains_a_model_like_one_process() -> None:
    run_on_ranks(2, _model_under_context_parallel, timeout=TIMEOUT)


def _with_messages_in_order() -> None:
    with in_order_p2p():  # NCCL's matching and single stream, emulated on gloo
        _every_method_is_exact()
        _model_under_context_parallel()


def test_the_ring_runs_with_messages_in_order() -> None:
    # The ring's sends and receives (one batch per rotation) on NCCL's rules: 4 ranks, so
    # each rank's neighbours differ in each direction.
    run_on_ranks(4, _with_messages_in_order, timeout=TIMEOUT)


def _model_with_module_form() -> None:
    """apply_context_parallel on the root, checkpoint on a block: the recompute runs in
    backward, outside the root's forward, and must still be context-parallel."""
    group = dist.group.WORLD
    assert group is not None
    net = _Net()
    for method, lb, documents in (("ring", True, True), ("allgather", False, False)):
        want = _reference(copy.deepcopy(net), documents)
        model = copy.deepcopy(net)
        checkpoint(model.blocks[1])
        apply_context_parallel(model, group, method=method, load_balance=lb)  # type: ignore[arg-type]
        tokens, labels, positions, docs = (
            shard_sequence(t, group, 1, load_balance=lb) for t in _batch(documents)
        )
        assert torch.equal(positions[0], sequence_positions(SEQ, group, load_balance=lb))
        with packed_documents(docs if documents else None):
            logits = model(tokens, positions)
            loss = _loss(logits, labels)
            loss.backward()
        whole = unshard_sequence(logits.detach(), group, 1, load_balance=lb)
        _check_against(model, want, loss, whole, group, f"apply_context_parallel {method}")
        # Outside the module's forward, SDPA is plain again.
        x = torch.randn(1, 2, 4, 8)
        _close(
            F.scaled_dot_product_attention(x, x, x), F.softmax(x @ x.mT / 8**0.5, -1) @ x, "plain"
        )


def test_apply_context_parallel_with_checkpointed_blocks() -> None:
    run_on_ranks(2, _model_with_module_form, timeout=TIMEOUT)
