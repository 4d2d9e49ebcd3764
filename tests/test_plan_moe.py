"""The planner's model of mixture-of-experts blocks and expert parallelism (``plait plan
--experts``, ``--ep``).

* Parameter counts of plait's MoE GPT against ``GPT(GPTConfig(...))`` itself.
* All-to-all bytes: the formula by hand, and against the rows a real 2-rank gloo run of
  ``plait.experts`` sends to the other rank (routing made exactly balanced).
* Memory: expert parallelism keeps the states' shards and shrinks the gathered working
  set by the experts other ep ranks hold.
* Tensor parallelism under ``fully_shard`` splits the routed rows: each tp rank runs ``1 /
  tp`` of them (activations, all-to-all bytes), the experts' states are sharded over
  ``efsdp x tp``, and the chunks' outputs (backward: the rows' gradients) are all-gathered
  over tp.
* The search proposes only ``ep`` that divide both ``dp_shard`` and the experts; the
  command line takes the MoE flags, prints all-to-all bytes and refuses a bad ``--ep``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_plan_compile_float8 import plan_software
from torch.distributed.device_mesh import init_device_mesh

from plait.checkpoint import checkpoint
from plait.experts import MoE, expert_parallel
from plait.plan import Layout, Workload, evaluate, plan, predict_memory
from plait.plan.cli import main
from plait.plan.comm import all_to_all_bytes, all_to_all_passes, tp_gather_bytes
from plait.plan.devices import device
from plait.plan.memory import routed_elems_per_token
from plait.plan.models import from_hf_config, gpt, param_counts
from plait.plan.schedule import layout_shape
from plait.plan.shards import rank_params
from plait.plan.train_plan import model_of_config, plan_of_config, plan_summary
from plait.train.config import TrainConfig
from plait.train.model import GPT, GPTConfig
from plait.train.resolve import resolve

from harness import run_on_ranks

MOE = {"experts": 4, "top_k": 2}


@pytest.mark.parametrize(
    "moe",
    [MOE, {"experts": 4, "top_k": 1, "shared_experts": 1, "expert_hidden": 48}],
)
def test_moe_parameter_counts_match_the_real_module(moe: dict[str, int]) -> None:
    cfg = TrainConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, **moe)
    spec = model_of_config(cfg)
    model = GPT(GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, **moe))
    counts = param_counts(spec)
    assert counts.total(spec.layers) == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert routed == spec.layers * counts.experts * counts.expert
    # a token goes through top_k of the experts of each block
    unused = spec.layers * (counts.experts - counts.top_k) * counts.expert
    assert counts.active(spec.layers) == counts.total(spec.layers) - unused


def test_hf_config_reads_routed_experts() -> None:
    mixtral = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 100,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    spec = from_hf_config(mixtral)
    assert (spec.experts, spec.top_k, spec.expert_hidden, spec.dense_layers) == (8, 2, 96, 0)
    c = param_counts(spec)
    attn = 2 * 64 * 64 + 2 * 64 * 32  # q, o and the grouped k, v
    block = attn + 2 * 64 + 64 * 8 + 8 * 3 * 64 * 96  # norms, router, experts
    assert c.total(2) == 2 * block + 2 * 100 * 64 + 64


def test_all_to_all_bytes_by_hand() -> None:
    spec = gpt(2, 4, 64, 128, **MOE)  # expert width 4 x 64 / 2
    work = Workload(seq_len=128, global_batch=8, precision="bf16")
    layout = Layout(dp_shard=4, ep=2)
    # 8 / 4 sequences of 128 tokens per rank, each token to 2 experts, half kept locally
    assert all_to_all_bytes(spec, layout, work) == 2 * 128 * 2 * 64 * 2 * (1 / 2)
    assert all_to_all_bytes(spec, Layout(dp_shard=4, ep=4), work) == 2 * 128 * 2 * 64 * 2 * 3 / 4
    assert all_to_all_bytes(spec, Layout(dp_shard=4), work) == 0.0  # no ep: nothing moves
    assert all_to_all_passes(layout) == 4  # dispatch, combine, and both in backward
    assert all_to_all_passes(Layout(dp_shard=4, ep=2, ac="full")) == 6  # + the recompute


# 8 / 4 sequences of 128 tokens per rank, each token to 2 experts, rows 64 wide, bf16
TP_WORK = Workload(seq_len=128, global_batch=8, precision="bf16")
TP_ROWS = 8 / 4 * 128 * 2


def test_tp_halves_the_routed_experts_states_and_activations() -> None:
    spec = gpt(2, 4, 64, 128, **MOE)  # expert width 4 x 64 / 2 = 128
    c = param_counts(spec)
    routed = spec.layers * c.experts * c.expert  # every routed expert of the model
    states = {}
    for tp in (1, 2):
        layout = Layout(dp_shard=4, tp=tp, ep=2)
        mem = predict_memory(spec, layout, TP_WORK)
        p = rank_params(spec, layout, layout_shape(spec, layout).ranks[0])
        others = (p.sharded_blocks + p.root) / 4  # what the rank stores besides the experts
        # fp32 params, grads and AdamW's two moments; the experts over dp_shard x tp
        assert mem.params + mem.grads + mem.optimizer == pytest.approx(
            16 * (others + routed / (4 * tp))
        )
        states[tp] = mem.params + mem.grads + mem.optimizer - 16 * others
        # the gathered working set: the rank's E / ep experts, whole on every tp rank
        assert p.experts == c.experts // 2 * c.expert
    assert states[2] == pytest.approx(states[1] / 2)

    # Per token: each routed row's input and SwiGLU for the rank's chunk, 1 / tp of the
    # rows; every row's gathered output (kept for the routing weight).
    d, h, k = 64, 128, 2
    for tp in (1, 2):
        layout = Layout(dp_shard=4, tp=tp, ep=2)
        assert routed_elems_per_token(spec, layout, "none") == k * (d + 4 * h) / tp + k * d
        assert routed_elems_per_token(spec, layout, "selective") == k * (2 * h + d) / tp
        assert routed_elems_per_token(spec, layout, "full") == 0.0
    # Without fully_shard (dp_shard 1) every tp rank computes all the routed rows.
    alone = Layout(tp=2)
    assert routed_elems_per_token(spec, alone, "none") == k * (2 * d + 4 * h)
    assert tp_gather_bytes(spec, alone, TP_WORK) == 0.0

    # End to end: wider experts add saved activations only for the rank's chunk of rows.
    wider = gpt(2, 4, 64, 128, expert_hidden=h + 32, **MOE)
    added = {}
    for tp in (1, 2):
        layout = Layout(dp_shard=4, tp=tp, ep=2)
        one, two = (predict_memory(m, layout, TP_WORK) for m in (spec, wider))
        added[tp] = two.activations - one.activations
        # 2 blocks, 256 tokens, 2 rows each, SwiGLU's 4 x 32 more, bf16
        assert added[tp] == pytest.approx(2 * TP_ROWS * 4 * 32 * 2 / tp)
    assert added[2] == pytest.approx(added[1] / 2)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_tp_all_gather_of_routed_rows_by_hand(ac: str) -> None:
    spec = gpt(2, 4, 64, 128, **MOE)
    layout = Layout(dp_shard=4, tp=2, ep=2, ac=ac)
    # each rank gives half of the 512 rows of 64 and gets the other half, bf16
    one = TP_ROWS * 64 * 2 * (2 - 1) / 2
    assert tp_gather_bytes(spec, layout, TP_WORK) == one
    cand = evaluate(spec, layout, TP_WORK, device("h100"))
    (gather,) = [k for k in cand.timing.collectives if k.op == "all_gather(routed)"]
    passes = 3 if ac == "full" else 2  # forward, backward (the rows' gradients), recompute
    assert gather.dim == "tp"
    assert (gather.bytes, gather.calls) == (one * passes * 2, passes * 2)  # 2 blocks, 1 mb
    untouched = evaluate(spec, Layout(dp_shard=4, ep=2, ac=ac), TP_WORK, device("h100"))
    assert not [k for k in untouched.timing.collectives if k.op == "all_gather(routed)"]


def test_tp_halves_the_all_to_all_and_shards_the_experts_over_efsdp_x_tp() -> None:
    spec = gpt(2, 4, 64, 128, **MOE)
    one, two = (all_to_all_bytes(spec, Layout(dp_shard=4, tp=tp, ep=2), TP_WORK) for tp in (1, 2))
    assert one == TP_ROWS * 64 * 2 * (1 / 2)  # half of the rows stay on the rank
    assert two == one / 2  # the rank's tp chunk of them
    # ep 1, tp 2: the experts are a group of their own, over dp_shard x tp = 8 ranks,
    # gathered whole (all 4 of them) in forward and backward
    cand = evaluate(spec, Layout(dp_shard=4, tp=2), TP_WORK, device("h100"))
    got = {(k.dim, k.op): k.bytes for k in cand.timing.collectives}
    c = param_counts(spec)
    experts = 2 * c.experts * c.expert  # 2 blocks
    assert got[("efsdp", "all_gather")] == pytest.approx(experts * 2 * 2 * 7 / 8)
    assert got[("efsdp", "reduce_scatter")] == pytest.approx(experts * 4 * 7 / 8)


def test_ep_inner_keeps_an_ep_group_in_one_node() -> None:
    """``Software.ep_inner`` (Megatron-Core's expert mesh with ETP 1): an ep group of 8 is
    8 consecutive ranks, one node, where plait's mesh strides it over tp 2 (16 ranks, two
    nodes): the all-to-alls move the same bytes at NVLink's rate instead of the network's,
    in the step time and in the report; ``plait plan --ep-inner`` sets it."""
    from plait.plan.comm_time import moe_exchanges
    from plait.plan.spec import Software

    spec = gpt(2, 4, 64, 128, experts=8, top_k=2)
    h100 = device("h100")
    layout, work = Layout(dp_shard=16, tp=2, ep=8), Workload(128, 32)
    strided, inner = (moe_exchanges(spec, layout, work, h100, flag) for flag in (False, True))
    one = all_to_all_bytes(spec, layout, work)
    # strided: 4 of a group's 8 ranks in each node, 4 NICs' worth of the network
    network = min(h100.intra_node_bw, 4 * h100.inter_node_bw)
    assert strided[0] - inner[0] == pytest.approx(
        2 * one * (1 / network - 1 / h100.intra_node_bw), rel=1e-9
    )
    assert network < h100.intra_node_bw
    plain = evaluate(spec, layout, work, h100)
    folded = evaluate(spec, layout, work, h100, software=Software(ep_inner=True))
    assert folded.timing.step_time < plain.timing.step_time
    a = [c for c in plain.timing.collectives if c.dim == "ep"]
    b = [c for c in folded.timing.collectives if c.dim == "ep"]
    assert [c.bytes for c in a] == [c.bytes for c in b] and a
    assert {c.bandwidth for c in a} == {h100.inter_node_bw}
    assert {c.bandwidth for c in b} == {h100.intra_node_bw}
    # ep x tp inside one node already: nothing changes
    small = Layout(dp_shard=4, tp=2, ep=4)
    assert moe_exchanges(spec, small, work, h100, True) == moe_exchanges(spec, small, work, h100)
    assert plan_software("--kernels", "megatron-core", "--ep-inner").ep_inner
    assert not plan_software("--kernels", "megatron-core").ep_inner


DIM, HIDDEN, TOKENS = 8, 16, 32


def _bytes_sent(ac: bool) -> tuple[float, int]:
    """One forward and backward of a MoE on 2 ep ranks whose routing sends token ``t`` to
    experts ``t % 4`` and ``(t + 1) % 4``: the float bytes each rank sends to the other."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    moe = MoE(DIM, HIDDEN, 4, 2)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[:, :4] = torch.eye(4)
    expert_parallel(moe, mesh["ep"])
    layer = checkpoint(moe) if ac else moe
    t = torch.arange(TOKENS)
    x = torch.zeros(TOKENS, DIM)
    x[t, t % 4] = 2.0
    x[t, (t + 1) % 4] = 1.0
    x.requires_grad_()
    sent: list[float] = []
    original = dist.all_to_all_single

    def spy(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        splits = kwargs.get("input_split_sizes")
        if inp.is_floating_point() and splits is not None:
            me = dist.get_rank(kwargs.get("group"))
            row = math.prod(inp.shape[1:]) * inp.element_size()
            sent.append((sum(splits) - splits[me]) * row)
        return original(out, inp, *args, **kwargs)

    dist.all_to_all_single = spy  # plait looks collectives up at call time
    try:
        layer(x.view(1, TOKENS, DIM)).sum().backward()
    finally:
        dist.all_to_all_single = original
    return sum(sent), len(sent)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_all_to_all_bytes_match_a_real_two_rank_exchange(ac: str) -> None:
    spec = gpt(1, 1, DIM, TOKENS, expert_hidden=HIDDEN, **MOE)
    layout = Layout(dp_shard=2, ep=2, ac=ac)
    work = Workload(seq_len=TOKENS, global_batch=2, precision="fp32")
    passes = all_to_all_passes(layout)
    predicted = all_to_all_bytes(spec, layout, work) * passes
    for nbytes, calls in run_on_ranks(2, _bytes_sent, ac == "full", timeout=60.0):
        assert (nbytes, calls) == (predicted, passes)


def test_ep_shrinks_the_gathered_experts_not_the_states() -> None:
    spec = gpt(2, 4, 64, 32, **MOE)
    work = Workload(seq_len=32, global_batch=2, precision="bf16")
    one, two = (predict_memory(spec, Layout(dp_shard=2, ep=ep), work) for ep in (1, 2))
    assert (two.params, two.grads, two.optimizer) == (one.params, one.grads, one.optimizer)
    c = param_counts(spec)
    half = c.experts // 2 * c.expert  # the experts the other ep rank holds, per block
    # two blocks gathered at once (current and prefetched), bf16
    assert one.unsharded - two.unsharded == pytest.approx(2 * half * 2)
    assert one.buffers - two.buffers == pytest.approx(half * (2 + 4))  # gradient staging
    assert two.extra["dispatch"] == 2 * 32 * 2 * 64 * 2  # send and receive, bf16
    assert two.total < one.total


def test_search_proposes_only_ep_that_divide_the_experts_and_dp_shard() -> None:
    spec = gpt(4, 4, 128, 128, experts=4, top_k=2)
    work = Workload(seq_len=128, global_batch=8, precision="fp32")
    found = plan(spec, work, device("h100"), 8)
    eps = {c.layout.ep for c in found}
    assert eps >= {1, 2, 4}
    for c in found:
        assert c.layout.dp_shard % c.layout.ep == 0 and 4 % c.layout.ep == 0
    fixed = plan(spec, work, device("h100"), 8, ep=2)
    assert {c.layout.ep for c in fixed} == {2}
    dense = plan(gpt(4, 4, 128, 128), work, device("h100"), 8)
    assert {c.layout.ep for c in dense} == {1}


ARGS = ["--n-layer", "2", "--d-model", "64", "--seq-len", "64", "--gpus", "4"]


def test_command_takes_moe_flags_and_prints_all_to_all(
    capsys: pytest.CaptureFixture[str],
) -> None:
    moe = ["--experts", "4", "--top-k", "2", "--shared-experts", "1", "--expert-hidden", "32"]
    assert main([*ARGS, *moe, "--ep", "2", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "all-to-all/step" in out and "ep=2" in out
    assert "--ep 2" in out and "--experts 4 --top-k 2 --shared-experts 1" in out
    fixed = ["--dp-shard", "4", "--ep", "2", "--ac", "none", "--microbatches", "1"]
    assert main([*ARGS, *moe, *fixed, "--no-reshard-after-forward", "--json"]) == 0
    (best,) = json.loads(capsys.readouterr().out)
    # 4 / 4 sequences of 64 tokens, 2 rows each, half sent, bf16, 4 per block, 2 blocks
    assert best["all_to_all_bytes_per_step"] == 64 * 2 * 64 * 2 / 2 * 4 * 2
    ops = {(k["dim"], k["op"]) for k in best["communication"]}
    assert {("ep", "all_to_all"), ("efsdp", "all_gather")} <= ops


def test_command_refuses_an_ep_the_experts_do_not_divide(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*ARGS, "--experts", "4", "--ep", "3"]) == 2
    err = capsys.readouterr().err
    assert "--ep 3" in err and "does not divide 4" in err
    assert main([*ARGS, "--ep", "2"]) == 2
    assert "the model has none" in capsys.readouterr().err
    assert main([*ARGS, "--top-k", "2"]) == 2
    assert "add --experts" in capsys.readouterr().err


def test_plait_train_plan_predicts_the_expert_parallel_layout() -> None:
    cfg = resolve(
        TrainConfig(
            nproc=4, device="cpu", n_layer=2, d_model=64, seq_len=32, batch_size=8, ep=2, **MOE
        )
    )
    c = plan_of_config(cfg)
    assert (c.layout.dp_shard, c.layout.ep) == (4, 2)
    summary = plan_summary(cfg)
    assert "ep=2" in summary and "all-to-all" in summary


# ----------------------------------------------------------------------------------------
# Dry runs of MoE models: plait's own MoE code on fake tensors, routing taken as balanced
# ----------------------------------------------------------------------------------------


#: plait train's GPT with MoE blocks, ep 2 over efsdp 2.
GPT_EP2 = [*ARGS, "--experts", "4", "--top-k", "2", "--device", "cpu", "--ep", "2"]


@pytest.mark.parametrize(
    ("args", "bound"),
    [
        # A few MiB, where the fixed costs the planner rounds weigh most: the bar of real
        # CPU runs.
        ([*GPT_EP2, "--dp-shard", "4"], 0.10),
        # Mixtral 8x7B at 64 ranks, one expert per ep rank: before its weights were sharded
        # on their second dim (fewer experts than efsdp ranks), the dry run's peak was 2x
        # the prediction (128 GiB against 67 GiB).
        (["--preset", "mixtral-8x7b", "--gpus", "64", "--seq-len", "4096", "--ep", "8"], 0.05),
        # The same with tp 2: the tp ranks split the routed rows, the experts sharded over
        # efsdp x tp.
        (
            ["--preset", "mixtral-8x7b", "--gpus", "64", "--seq-len", "4096", "--ep", "8"]
            + ["--tp", "2", "--dp-shard", "32"],
            0.05,
        ),
    ],
)
def test_dry_run_of_a_moe_model_matches_the_prediction(
    args: list[str], bound: float, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*args, "--pp", "1", "--top", "1", "--dry-run"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("dry run of ") and "ep=" in line
    error = float(line.rsplit("(", 1)[1].rstrip("%)")) / 100
    assert abs(error) <= bound, line


def test_balanced_counts_split_totals_and_read_nothing() -> None:
    from plait.experts.counts import balanced_counts, host_counts

    counts = torch.tensor([5, 0, 3])
    assert host_counts(counts, 8) == [5, 0, 3]
    with balanced_counts():
        assert host_counts(counts, 8) == [3, 3, 2]
        assert host_counts(torch.empty(2, 2, device="meta"), 8) == [2, 2, 2, 2]
    assert host_counts(counts, 8) == [5, 0, 3]


def test_counts_read_together_are_read_in_one_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """EP's exchange plan reads what it sends and what it receives with one device-to-host
    read (each read stalls the host on a GPU)."""
    from plait.experts.counts import balanced_counts, host_counts_together

    reads = []
    tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> object:
        reads.append(self.shape)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    sent, received = torch.tensor([5, 0, 3]), torch.tensor([[1, 2], [0, 5]], dtype=torch.int32)
    assert host_counts_together((sent, 8), (received, 8)) == [[5, 0, 3], [1, 2, 0, 5]]
    assert len(reads) == 1
    with balanced_counts():
        assert host_counts_together((sent, 8), (received, 8)) == [[3, 3, 2], [2, 2, 2, 2]]
    assert len(reads) == 1
