"""``plait.experts``: the reference MoE layer, and expert parallelism equal to one process.

Single-process tests pin the layer (top-k routing, dropless combine, shared experts, the
auxiliary losses and the bias update). Multi-process tests train a two-layer MoE model for
a few AdamW steps on a ``(dp, ep)`` mesh, every rank on its own slice of the global batch,
beside a reference copy that runs the whole batch alone, and compare after every step:
forward outputs, loss, auxiliary loss, token counts, gradients (expert gradients gathered
from their shards), expert biases, and at the end the parameters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from moe_models import DIM, EXPERTS, HIDDEN, TOP_K, MoENet, moe_batches
from moe_models import moe_layer as _moe
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from plait.checkpoint import checkpoint
from plait.experts import (
    ExpertParallel,
    GroupedExperts,
    MoE,
    TopKRouter,
    expert_load,
    expert_parallel,
    set_load_balance_mesh,
    update_expert_bias,
)
from plait.experts.balance import balance_loss, sequence_balance_loss, z_loss
from plait.experts.dispatch import regroup
from plait.replicate import replicate

from collective_spy import spy_collectives
from harness import run_on_ranks

TIMEOUT = 60.0
ATOL, RTOL = 1e-6, 1e-5


# -- the layer, one process ------------------------------------------------------------


def test_router_picks_top_k_and_bias_moves_the_choice_only() -> None:
    router = TopKRouter(DIM, EXPERTS, TOP_K, route_norm=True, route_scale=2.0)
    x = torch.randn(10, DIM)
    route = router(x)
    scores = router.gate(x).softmax(-1)
    assert torch.equal(route.experts, scores.topk(TOP_K, dim=-1).indices)
    torch.testing.assert_close(route.weights.sum(-1), torch.full((10,), 2.0))
    bias = torch.zeros(EXPERTS)
    bias[3] = 10.0  # wins for every token
    biased = router(x, bias)
    assert (biased.experts == 3).any(dim=-1).all()
    raw = scores.gather(-1, biased.experts)
    torch.testing.assert_close(biased.weights, 2.0 * raw / raw.sum(-1, keepdim=True))
    sig = TopKRouter(DIM, EXPERTS, TOP_K, score_func="sigmoid")(x)
    torch.testing.assert_close(sig.probs.sum(-1), torch.ones(10))
    with pytest.raises(ValueError, match="top_k=9"):
        TopKRouter(DIM, EXPERTS, 9)


@pytest.mark.parametrize("shared", [0, 1])
def test_moe_is_dropless_top_k_plus_shared_experts(shared: int) -> None:
    moe = _moe(num_shared_experts=shared, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    x = torch.randn(2, 5, DIM)
    out = moe(x)
    tokens = x.reshape(-1, DIM)
    route = moe.router(tokens, moe.expert_bias)
    e = moe.experts
    want = moe.shared_experts(tokens) if shared else torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):  # every token reaches each of its k experts
        for j in range(TOP_K):
            i = int(route.experts[t, j])
            h = F.silu(tokens[t] @ e.w1[i]) * (tokens[t] @ e.w3[i])
            want[t] = want[t] + route.weights[t, j] * (h @ e.w2[i])
    torch.testing.assert_close(out.reshape(-1, DIM), want, atol=1e-6, rtol=1e-5)
    assert int(moe.tokens_per_expert.sum()) == tokens.shape[0] * TOP_K


def test_aux_losses_join_the_backward_of_the_output() -> None:
    moe = _moe(bias_update_speed=None)
    x = torch.randn(3, 4, DIM)
    grads = []
    for scale in (1.0, 0.0):
        moe.zero_grad()
        moe.aux_loss_scale = scale
        moe(x).sum().backward()
        grads.append(moe.router.gate.weight.grad.clone())
    route = moe.router(x.reshape(-1, DIM))
    counts = torch.bincount(route.experts.flatten(), minlength=EXPERTS)
    aux = balance_loss(route.probs, counts, 0.01) + z_loss(route.logits, 1e-3)
    assert moe.aux_loss is not None
    torch.testing.assert_close(moe.aux_loss, aux.detach())
    (want,) = torch.autograd.grad(aux, moe.router.gate.weight)
    torch.testing.assert_close(grads[0] - grads[1], want, atol=1e-7, rtol=1e-5)
    # perfectly balanced routing gives a balance loss of exactly coeff
    uniform = torch.full((6, EXPERTS), 1.0 / EXPERTS)
    assert balance_loss(uniform, torch.full((EXPERTS,), 3), 0.5).item() == pytest.approx(0.5)


def test_sequence_balance_loss_is_per_sequence() -> None:
    """DeepSeek-V3's sequence-wise loss: each sequence's f and P (checked by a loop), their
    mean; the same whatever the batch is cut into; exactly coeff at perfect balance; and
    what ``MoE(aux_loss_type="sequence")`` attaches to its output."""
    seqs, seq_len = 3, 4
    probs = torch.rand(seqs * seq_len, EXPERTS).softmax(-1)
    picks = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(seqs * seq_len)])
    want = 0.0
    for s in range(seqs):
        rows = slice(s * seq_len, (s + 1) * seq_len)
        counts = torch.bincount(picks[rows].flatten(), minlength=EXPERTS).float()
        f = counts * EXPERTS / (TOP_K * seq_len)
        want += float((f * probs[rows].mean(0)).sum()) * 0.1 / seqs
    got = sequence_balance_loss(probs, picks, seq_len, 0.1)
    assert got.item() == pytest.approx(want, rel=1e-6)
    halves = [sequence_balance_loss(probs[i::2], picks[i::2], 1, 0.1) for i in range(2)]
    whole = sequence_balance_loss(probs, picks, 1, 0.1)
    torch.testing.assert_close((halves[0] + halves[1]) / 2, whole)  # any split: the mean
    uniform = torch.full((EXPERTS, EXPERTS), 1.0 / EXPERTS)
    one_each = torch.arange(EXPERTS).view(EXPERTS // TOP_K, TOP_K).repeat_interleave(TOP_K, 0)
    balanced = sequence_balance_loss(uniform, one_each, EXPERTS, 0.5)
    assert balanced.item() == pytest.approx(0.5)
    moe = _moe(aux_loss_coeff=0.01, aux_loss_type="sequence", z_loss_coeff=0.0)
    x = torch.randn(seqs, seq_len, DIM)
    moe(x)
    route = moe.router(x.reshape(-1, DIM))
    expected = sequence_balance_loss(route.probs, route.experts, seq_len, 0.01)
    torch.testing.assert_close(moe.aux_loss, expected.detach())
    with pytest.raises(ValueError, match="aux_loss_type 'token'"):
        _moe(aux_loss_type="token")


def test_expert_bias_step_and_load_counting() -> None:
    moe = _moe()
    x = torch.randn(4, 3, DIM)
    moe(x)
    load = expert_load(moe)[""]
    assert torch.equal(load, moe.tokens_per_expert) and int(load.sum()) == 12 * TOP_K
    moe.eval()
    moe(x)  # evaluation forwards are not training load
    assert torch.equal(moe.tokens_per_expert, load)
    update_expert_bias(moe)
    assert moe.expert_bias is not None
    want = 1e-2 * torch.sign(load.float().mean() - load.float())
    assert torch.equal(moe.expert_bias, want)
    assert int(moe.tokens_per_expert.sum()) == 0
    moe.train()
    checkpoint(moe)  # the recompute in backward must not count the tokens again
    moe(x).sum().backward()
    assert int(moe.tokens_per_expert.sum()) == 12 * TOP_K
    update_expert_bias(moe, move=False)  # a dropped step: its counts go, the bias stays
    assert torch.equal(moe.expert_bias, want) and int(moe.tokens_per_expert.sum()) == 0


def test_regroup_transposes_the_block_grid() -> None:
    blocks = [[2, 0, 1], [1, 3, 0]]  # rows from rank i for local expert j
    rows = torch.arange(7.0).unsqueeze(-1)
    grouped = regroup(rows, blocks)
    assert grouped.flatten().tolist() == [0, 1, 3, 4, 5, 6, 2]
    back = regroup(grouped, [list(c) for c in zip(*blocks, strict=True)])
    assert torch.equal(back, rows)


# -- expert parallelism == one process -------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(what: str, got: torch.Tensor, want: torch.Tensor, diffs: dict[str, float]) -> None:
    got, want = _full(got.detach()), want.detach()
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    diffs[what] = max(diffs.get(what, 0.0), diff)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _experts_of(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def _sync_dense_by_hand(model: nn.Module, mesh: DeviceMesh) -> None:
    """Average over every rank the gradients of what is not an expert (ep ranks are data
    parallel for it), and the experts' over dp; what ``replicate`` does in the 2x2 case."""
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        if isinstance(p, DTensor):
            if mesh["dp"].size() > 1:
                dist.all_reduce(p.grad._local_tensor, group=mesh["dp"].get_group())
                p.grad._local_tensor.div_(mesh["dp"].size())
        else:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def _parity(
    dp: int, ep: int, sync: str, ac: bool = False, skew: bool = False, style: bool = False
) -> dict[str, Any]:
    """Train ``MoENet`` on a ``(dp, ep)`` mesh beside one process; raise on any difference.

    ``sync``: how the non-expert gradients are averaged (``"manual"`` or ``"replicate"``);
    ``style``: apply ``ExpertParallel`` through torch's ``parallelize_module``.
    """
    mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
    rank, world = dist.get_rank(), dist.get_world_size()  # data slice = rank: (dp, ep) row-major
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(MoENet())
    ref, par = models
    if skew:  # every token picks experts 5 and 6: one ep rank gets no rows at all
        for model in models:
            for block in model.blocks:
                block.moe.expert_bias[5:7] = 10.0
    if style:
        parallelize_module(par, mesh["ep"], {"blocks.*.moe.experts": ExpertParallel()})
        if dp > 1:  # alone, the MoE balances over the experts' (ep) ranks
            set_load_balance_mesh(par, mesh)
    else:
        expert_parallel(par, mesh["ep"], load_balance_mesh=mesh)
    if ac:
        for block in par.blocks:
            checkpoint(block)
    if sync == "replicate":
        experts = _experts_of(par)
        if dp > 1:
            for module in experts:
                replicate(module, device_mesh=mesh["dp"])
        replicate(
            par,
            device_mesh=init_device_mesh("cpu", (world,)),
            ignored_modules=experts if dp == 1 else None,
        )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    par_opt = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.01)
    diffs: dict[str, float] = {}
    empty_local_expert = False
    calls: dict[str, int] = {}  # all-to-alls of a step: in forward, and in all
    for step, (x, y) in enumerate(moe_batches()):
        ref_out = ref(x)
        F.mse_loss(ref_out, y).backward()
        with spy_collectives("all_to_all_single") as spied:
            out = par(x.chunk(world)[rank])
            calls["forward"] = len(spied["all_to_all_single"])
            F.mse_loss(out, y.chunk(world)[rank]).backward()
            calls["all"] = len(spied["all_to_all_single"])
        if sync == "manual":
            _sync_dense_by_hand(par, mesh)
        gathered = out.new_empty(ref_out.shape)
        dist.all_gather_into_tensor(gathered, out.detach().contiguous())
        _close(f"step {step} output", gathered, ref_out, diffs)
        for i, (rb, pb) in enumerate(zip(ref.blocks, par.blocks, strict=True)):
            aux = pb.moe.aux_loss.clone()
            dist.all_reduce(aux)
            _close(f"step {step} aux loss {i}", aux / world, rb.moe.aux_loss, diffs)
            assert torch.equal(pb.moe.tokens_per_expert, rb.moe.tokens_per_expert), step
        for (name, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
            _close(f"grad {name}", p.grad, q.grad, diffs)
        for model, opt in ((ref, ref_opt), (par, par_opt)):
            opt.step()
            opt.zero_grad()
            update_expert_bias(model)
        for rb, pb in zip(ref.blocks, par.blocks, strict=True):
            assert torch.equal(pb.moe.expert_bias, rb.moe.expert_bias), f"bias, step {step}"
        empty_local_expert |= _some_local_expert_empty(par, x.chunk(world)[rank])
    for (name, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
        _close(f"param {name}", p, q, diffs)
    w1 = par.blocks[0].moe.experts.w1
    assert isinstance(w1, DTensor) and w1.placements == (Shard(0),)
    assert w1.to_local().shape[0] == EXPERTS // ep
    state = par.state_dict()  # names unchanged; experts as DTensors; the bias persists
    assert state.keys() == ref.state_dict().keys()
    assert isinstance(state["blocks.1.moe.experts.w2"], DTensor)
    assert "blocks.0.moe.expert_bias" in state
    return {"diffs": diffs, "empty": empty_local_expert, "calls": calls}


def _some_local_expert_empty(model: MoENet, x: torch.Tensor) -> bool:
    """Whether some expert got no token from this rank in the first layer."""
    with torch.no_grad():
        block = model.blocks[0]
        route = block.moe.router(block.inp(x).reshape(-1, DIM), block.moe.expert_bias)
    return bool((torch.bincount(route.experts.flatten(), minlength=EXPERTS) == 0).any())


@pytest.mark.parametrize(
    ("dp", "ep", "sync", "style"),
    [
        (1, 2, "manual", True),
        (1, 4, "manual", False),
        (2, 2, "replicate", False),
        (2, 1, "replicate", True),
    ],
    ids=["ep2-style", "ep4", "dp2xep2-replicate", "dp2xep1-style-replicate"],
)
def test_expert_parallel_trains_like_one_process(dp: int, ep: int, sync: str, style: bool) -> None:
    results = run_on_ranks(dp * ep, _parity, dp, ep, sync, style=style, timeout=TIMEOUT)
    assert any(r["empty"] for r in results), "no rank had an expert without tokens"


def test_expert_parallel_with_all_tokens_on_one_ranks_experts() -> None:
    run_on_ranks(2, _parity, 1, 2, "manual", skew=True, timeout=TIMEOUT)


def test_checkpointed_moe_blocks_redispatch_and_stay_exact() -> None:
    plain, ac = (
        run_on_ranks(2, _parity, 1, 2, "manual", ac=flag, timeout=TIMEOUT)[0]
        for flag in (False, True)
    )
    # per layer and pass: counts, dispatch, combine; backward reverses the latter two
    assert plain["calls"] == {"forward": 6, "all": 10}
    assert ac["calls"] == {"forward": 6, "all": 16}  # the recompute re-dispatches
    assert ac["diffs"] == plain["diffs"]  # the same numbers, to the last bit


# -- refusals ----------------------------------------------------------------------------


def _refusals() -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    model = nn.Sequential(MoE(DIM, HIDDEN, 3, 1))
    with pytest.raises(ValueError, match=r"'0.experts' \(GroupedExperts\): its 3 experts") as info:
        expert_parallel(model, mesh)
    assert "ep=2" in str(info.value) and "Fix: an ep size that divides 3 (1, 3)" in str(info.value)
    assert not isinstance(model[0].experts.w1, DTensor)  # refused before changing anything
    with pytest.raises(ValueError, match="GroupedExperts: its 3 experts"):
        parallelize_module(model, mesh, {"0.experts": ExpertParallel()})
    grid = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))
    with pytest.raises(ValueError, match=r'1-D mesh.*mesh\["ep"\]'):
        expert_parallel(_moe(), grid)
    moe = _moe()
    parallelize_module(moe, mesh, {"experts": ExpertParallel()})
    with pytest.raises(AssertionError, match="shard_experts"):
        ExpertParallel()._apply(moe.experts, mesh)


def test_bad_ep_is_refused_with_the_fix() -> None:
    run_on_ranks(2, _refusals, timeout=TIMEOUT)


# -- routed rows split over ranks that hold the same tokens -----------------------------


def _row_split_on_rank(skew: bool) -> dict[str, float]:
    """One MoE on the same tokens on both ranks, its routed rows split between them,
    against a copy that computes them all: outputs, input and router gradients alike on
    each rank; the experts' gradients, each rank's covering its chunk times 2, average to
    the copy's."""
    import copy

    from plait.experts import split_routed_rows

    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, num_shared_experts=1, aux_loss_coeff=0.01)
    moe.z_loss_coeff = 1e-3
    if skew:  # every token's first choice is expert 0: one rank's chunk is all expert 0
        with torch.no_grad():
            moe.router.gate.weight[0] += 10.0
    whole = copy.deepcopy(moe)
    x = torch.randn(2, 8, DIM)
    split_routed_rows(moe, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"])
    diffs: dict[str, float] = {}
    inputs = []
    for layer in (whole, moe):
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.square().sum().backward()
        inputs.append((out.detach(), xi.grad))
    diffs["out"] = (inputs[0][0] - inputs[1][0]).abs().max().item()
    diffs["input_grad"] = (inputs[0][1] - inputs[1][1]).abs().max().item()
    diffs["router_grad"] = (
        (whole.router.gate.weight.grad - moe.router.gate.weight.grad).abs().max().item()
    )
    for name, p in moe.experts.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        ref = dict(whole.experts.named_parameters())[name].grad
        diffs[f"experts.{name}"] = (grad / 2 - ref).abs().max().item()
    return diffs


@pytest.mark.parametrize("skew", [False, True], ids=["spread", "all-to-expert-0"])
def test_split_routed_rows_equals_every_rank_computing_them(skew: bool) -> None:
    for diffs in run_on_ranks(2, _row_split_on_rank, skew, timeout=TIMEOUT):
        assert all(d <= ATOL for d in diffs.values()), diffs
