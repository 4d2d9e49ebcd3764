"""The planner's torch.compile and Float8 models (plait.plan.roofline, "torch.compile and
Float8"): defaults unchanged, what each changes in a block, fp8 all-gathers, refusals,
and plait train's flags mapped onto them."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from plait.plan.candidate import evaluate
from plait.plan.cli import _software
from plait.plan.comm import communication, fsdp_dim
from plait.plan.compute_time import kernel_times
from plait.plan.devices import device
from plait.plan.flags import add_flags
from plait.plan.models import preset
from plait.plan.roofline import (
    BlockKernels,
    block_kernels,
    elementwise_seconds,
    head_kernels,
    profile,
)
from plait.plan.schedule import layout_shape
from plait.plan.spec import DeviceSpec, Layout, Software, Workload
from plait.plan.stacks import FP8_GEMM, STACKS, Float8, compiled, float8
from plait.plan.train_plan import plan_of_config, software_of_config
from plait.train.config import TrainConfig

MODEL = preset("llama3-8b")
H100 = device("h100")
WORK = Workload(8192, 64)


def plan_software(*flags: str) -> Software:
    """The :class:`Software` ``plait plan FLAGS --gpus 8`` prices (its own parser)."""
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return _software(parser.parse_args([*flags, "--gpus", "8"]))


def _block(software: Software, dev: DeviceSpec = H100, tokens: float = 16384.0) -> BlockKernels:
    prof = profile(dev)
    assert prof is not None
    kernels = STACKS["torchtitan"]
    if software.compiled:
        kernels = compiled(kernels)
    fp8 = float8(dev, software, prof.gemm, prof.k_half)
    return block_kernels(
        MODEL, 1, tokens, 8192, 1, 2, False, prof, dev.flops, kernels, False, dev.name, 1, fp8
    )


def _tokens(sw: Software) -> float:
    layout = Layout(dp_shard=64, ac="selective")
    return evaluate(MODEL, layout, WORK, H100, software=sw).timing.tokens_per_s_per_device


def test_defaults_unchanged() -> None:
    """The new fields' defaults are the old Software: the same predictions exactly."""
    default = Software("torchtitan")
    explicit = Software("torchtitan", compiled=False, float8="none", float8_all_gather=False)
    assert default == explicit
    assert _block(default) == _block(explicit)
    prof = profile(H100)
    assert prof is not None
    assert float8(H100, default, prof.gemm, prof.k_half) is None
    layout = Layout(dp_shard=64, ac="selective")
    a = evaluate(MODEL, layout, WORK, H100, software=default)
    b = evaluate(MODEL, layout, WORK, H100, software=explicit)
    assert a.timing == b.timing and a.memory == b.memory


def test_compile_fuses_memory_bound_work_only() -> None:
    eager, fused = _block(Software("torchtitan")), _block(Software("torchtitan", compiled=True))
    assert fused.elementwise < 0.6 * eager.elementwise  # norms, rope, SwiGLU, residual
    assert fused.launches < eager.launches
    assert fused.gemm == eager.gemm
    assert fused.attention_fwd == eager.attention_fwd
    assert fused.attention_bwd == eager.attention_bwd
    assert fused.cast == 0.0
    assert _tokens(Software("torchtitan", compiled=True)) > _tokens(Software("torchtitan"))


def test_float8_speeds_block_gemms_by_the_peak_and_fraction_ratio() -> None:
    bf16 = _block(Software("torchtitan", compiled=True))
    fp8 = _block(Software("torchtitan", compiled=True, float8="tensorwise"))
    prof = profile(H100)
    assert prof is not None
    expected = (H100.flops_fp8 / H100.flops) * (FP8_GEMM["h100"] / prof.gemm)  # 1.75
    # Large GEMMs: the ratio up to the small-K loss at the fp8 rate (K_half doubles)
    assert 0.85 * expected < bf16.gemm / fp8.gemm <= expected
    assert fp8.attention_fwd == bf16.attention_fwd
    assert fp8.attention_bwd == bf16.attention_bwd
    assert fp8.elementwise == bf16.elementwise
    assert fp8.cast > 0 and fp8.cast_bwd > fp8.cast  # the casts are priced
    assert fp8.launches > bf16.launches
    # the head is not converted: its kernels take no float8 argument at all
    prof_h = profile(H100)
    assert prof_h is not None
    head = head_kernels(MODEL, 1, 16384.0, 2, prof_h, H100.flops)
    sw8 = Software("torchtitan", compiled=True, float8="tensorwise")
    sw16 = Software("torchtitan", compiled=True)
    layout = Layout(dp_shard=64, ac="selective")
    load = layout_shape(MODEL, layout).ranks[0]
    k8 = kernel_times(MODEL, layout, WORK, H100, load, 0.8, sw8, 3e-6)
    k16 = kernel_times(MODEL, layout, WORK, H100, load, 0.8, sw16, 3e-6)
    assert k8.head_fwd == k16.head_fwd and k8.head_bwd == k16.head_bwd
    assert head[0] > 0
    assert k8.fwd < k16.fwd


def test_eager_casts_cost_more_than_compiled_ones() -> None:
    eager = _block(Software("torchtitan", float8="tensorwise"))
    fused = _block(Software("torchtitan", compiled=True, float8="tensorwise"))
    rowwise = _block(Software("torchtitan", compiled=True, float8="rowwise"))
    assert eager.cast > fused.cast > rowwise.cast > 0


def test_float8_all_gather_halves_the_blocks_all_gather_bytes() -> None:
    layout = Layout(dp_shard=64)
    load = layout_shape(MODEL, layout).ranks[0]

    def gathered(sw: Software) -> float:
        out = communication(MODEL, layout, WORK, H100, load, sw)
        return sum(c.bytes for c in out if c.op == "all_gather" and c.dim == fsdp_dim(layout))

    plain = gathered(Software("torchtitan", float8="tensorwise"))
    fp8 = gathered(Software("torchtitan", float8="tensorwise", float8_all_gather=True))
    root = communication(MODEL, Layout(dp_shard=64), WORK, H100, load)
    assert plain == sum(c.bytes for c in root if c.op == "all_gather")
    # blocks at 1 byte instead of 2; the root unit (embedding, head) stays bf16
    assert 0.5 * plain < fp8 < 0.6 * plain
    # and the gathered blocks in memory shrink too
    m_plain = evaluate(MODEL, layout, WORK, H100, software=Software(float8="tensorwise"))
    m_fp8 = evaluate(
        MODEL, layout, WORK, H100, software=Software(float8="tensorwise", float8_all_gather=True)
    )
    assert m_fp8.memory.unsharded < m_plain.memory.unsharded


def test_float8_values_are_validated() -> None:
    with pytest.raises(ValueError, match="float8 must be one of"):
        Software(float8="delayed")
    with pytest.raises(ValueError, match="tensorwise"):
        Software(float8="rowwise", float8_all_gather=True)


@pytest.mark.parametrize("name", ["a100", "cpu"])
def test_float8_refused_without_an_fp8_peak(name: str) -> None:
    dev = device(name)
    with pytest.raises(ValueError, match=r"no fp8 peak.*float8 none"):
        evaluate(
            MODEL,
            Layout(dp_shard=8),
            Workload(2048, 8),
            dev,
            software=Software(float8="tensorwise"),
        )


def test_fp8_peaks_of_the_presets() -> None:
    assert device("h100").flops_fp8 == 1979e12
    assert device("h200").flops_fp8 == 1979e12
    assert device("b200").flops_fp8 == 4500e12
    assert device("a100").flops_fp8 == 0


def _config(**flags: object) -> TrainConfig:
    base = TrainConfig(
        n_layer=4,
        n_head=8,
        d_model=512,
        seq_len=1024,
        batch_size=16,
        dp_shard=8,
        microbatches=1,
        mp="bf16",
    )
    return dataclasses.replace(base, **flags)  # type: ignore[arg-type]


def test_plan_of_config_maps_compile_and_float8() -> None:
    assert software_of_config(_config()) == Software()
    sw = software_of_config(_config(compile=True, float8=True))
    assert sw == Software(compiled=True, float8="tensorwise", float8_all_gather=True)
    no_fsdp = dataclasses.replace(_config(float8=True), dp_shard=1, dp_replicate=8)
    assert not software_of_config(no_fsdp).float8_all_gather
    plain = plan_of_config(_config(), H100).timing
    fast = plan_of_config(_config(compile=True, float8=True), H100).timing
    assert fast.step_time < plain.step_time
    with pytest.raises(ValueError, match="fp8"):
        plan_of_config(_config(float8=True), device("a100"))


def test_printed_commands_carry_compile_and_float8(capsys: pytest.CaptureFixture[str]) -> None:
    """The best layout's plait train / torchrun commands run what was priced."""
    from plait.plan.cli import main

    base = ["--preset", "llama3-8b", "--gpus", "8", "--device", "h100", "--dp-shard", "8"]
    assert main([*base, "--top", "1", "--json"]) in (0, None)
    plain = json.loads(capsys.readouterr().out)[0]
    assert "--compile" not in plain["command"] and "--float8" not in plain["torchrun"]
    flags = ["--compile", "--float8", "tensorwise", "--float8-all-gather"]
    assert main([*base, *flags, "--top", "1", "--json"]) in (0, None)
    fast = json.loads(capsys.readouterr().out)[0]
    for command in (fast["command"], fast["torchrun"]):
        assert "--compile --float8 " in command
    assert fast["step_time_s"] < plain["step_time_s"]


def test_compiled_loss_keeps_no_fp32_logits_and_moves_fewer_bytes() -> None:
    """torchtitan's compiled cross-entropy (``Software.compiled_loss``): the logits part of
    memory is the fused cross-entropy's (compute-dtype logits and their gradient), the
    loss's time is its ``3 e`` bytes per element; the blocks are untouched; and it needs
    the blocks compiled."""
    with pytest.raises(ValueError, match="compiled_loss needs compiled=True"):
        Software("torchtitan", compiled_loss=True)
    layout = Layout(dp_shard=64, ac="selective")
    blocks = Software("torchtitan", compiled=True)
    both = dataclasses.replace(blocks, compiled_loss=True)
    a = evaluate(MODEL, layout, WORK, H100, software=blocks)
    b = evaluate(MODEL, layout, WORK, H100, software=both)
    n, v = 8192, MODEL.vocab  # the rank's tokens (global 64 sequences over 64), vocabulary
    # eager: fp32 log-probabilities (4) and, at the loss, two fp32 gradients (8); compiled:
    # the bf16 logits (2) and their bf16 gradient (2)
    assert a.memory.extra["logits"] - b.memory.extra["logits"] == pytest.approx(n * v * 8)
    assert a.memory.activations == b.memory.activations
    shape = layout_shape(MODEL, layout)
    ref = kernel_times(MODEL, layout, WORK, H100, shape.ranks[0], 1.0, blocks, 0.0)
    got = kernel_times(MODEL, layout, WORK, H100, shape.ranks[0], 1.0, both, 0.0)
    assert (got.fwd, got.bwd, got.recompute) == (ref.fwd, ref.bwd, ref.recompute)
    prof = profile(H100)
    assert prof is not None
    eager = head_kernels(MODEL, 1, n, 2, prof, H100.flops, "eager-fp32")
    fused = head_kernels(MODEL, 1, n, 2, prof, H100.flops, "fused")
    saved = (ref.head_fwd - got.head_fwd, ref.head_bwd - got.head_bwd)
    assert saved[0] > 0 and saved[1] > 0  # the loss's bytes, scaled as every kernel is
    assert saved[0] / (eager[0] - fused[0]) == pytest.approx(saved[1] / (eager[1] - fused[1]))
    assert b.timing.step_time < a.timing.step_time


@pytest.mark.parametrize(("kernels", "loss"), [("torchtitan", True), ("plait", False)])
def test_plan_compile_flag_compiles_torchtitans_loss_only(kernels: str, loss: bool) -> None:
    """``plait plan --compile``: torchtitan compiles its loss with the blocks, plait train
    the blocks only."""
    assert plan_software("--kernels", kernels, "--compile").compiled_loss is loss
    assert plan_software("--kernels", kernels).compiled_loss is False


def test_float8_tp_gathers_move_fp8_in_the_forward_only() -> None:
    """torchtitan's Float8 tensorwise TP (``Software.float8_tp_gather``): the forward's two
    sequence-parallel all-gathers move 1 byte per element, its reduce-scatters and
    backward's exchanges bf16: 3/4 of the forward's bytes; ``plait plan --float8
    tensorwise --kernels torchtitan`` sets it, plait's kernels do not; rowwise refuses it."""
    from plait.plan.comm import tp_bytes_per_block
    from plait.plan.comm_time import tp_exposed

    with pytest.raises(ValueError, match="float8_tp_gather needs float8='tensorwise'"):
        Software("torchtitan", float8="rowwise", float8_tp_gather=True)
    layout = Layout(dp_shard=8, tp=8, ac="full")
    fwd, bwd, _ = tp_exposed(MODEL, layout, WORK, H100, (0.0,) * 4, "none")
    fp8_fwd, fp8_bwd, _ = tp_exposed(
        MODEL, layout, WORK, H100, (0.0,) * 4, "none", fp8_gathers=True
    )
    nbytes = tp_bytes_per_block(MODEL, layout, WORK)
    assert fp8_bwd == bwd
    assert fwd - fp8_fwd == pytest.approx(nbytes / 4 / H100.intra_node_bw)
    base = Software("torchtitan", float8="tensorwise", float8_all_gather=True)
    fp8 = dataclasses.replace(base, float8_tp_gather=True)
    shape = layout_shape(MODEL, layout)

    def tp_sent(software: Software) -> float:
        sent = communication(MODEL, layout, WORK, H100, shape.ranks[0], software)
        return sum(c.bytes for c in sent if c.dim == "tp")

    m, blocks = layout.microbatches, shape.ranks[0].layers
    # Full recompute: two forwards per block and microbatch gather fp8.
    assert tp_sent(base) - tp_sent(fp8) == pytest.approx(m * blocks * 2 * nbytes / 4)
    a = evaluate(MODEL, layout, WORK, H100, software=base)
    b = evaluate(MODEL, layout, WORK, H100, software=fp8)
    assert b.timing.step_time < a.timing.step_time
    flags = ("--compile", "--float8", "tensorwise", "--float8-all-gather")
    assert plan_software("--kernels", "torchtitan", *flags).float8_tp_gather
    assert not plan_software("--kernels", "plait", *flags).float8_tp_gather


def test_float8_tp_casts_each_module_input_once_on_its_shard() -> None:
    """Under Float8 TP the column-parallel linears (q, k, v, the MLP's gate and up) get
    their module's input already in fp8, cast once on the sequence shard before the
    gather and kept fp8 for backward: their own input casts go, two shard casts come;
    without tp nothing changes."""
    prof = profile(H100)
    assert prof is not None
    kernels = compiled(STACKS["torchtitan"])
    software = Software("torchtitan", compiled=True, float8="tensorwise", float8_all_gather=True)
    plain = float8(H100, software, prof.gemm, prof.k_half)
    gathered = float8(
        H100, dataclasses.replace(software, float8_tp_gather=True), prof.gemm, prof.k_half
    )
    assert plain is not None and gathered is not None and gathered.gathered

    def block(tp: int, fp8: Float8) -> BlockKernels:
        return block_kernels(
            MODEL, tp, 16384.0, 8192, 1, 2, False, prof, H100.flops, kernels, True, "h100", 1, fp8
        )

    n, d, tp = 16384.0, MODEL.d_model, 8
    c = plain.per_element * 2 + plain.fixed  # bytes per element cast, bf16
    a, b = block(tp, plain), block(tp, gathered)
    fwd_saved = c * (5 * n * d - 2 * n / tp * d)
    assert a.cast - b.cast == pytest.approx(elementwise_seconds(fwd_saved, prof))
    assert a.cast_bwd - b.cast_bwd == pytest.approx(elementwise_seconds(c * 5 * n * d, prof))
    assert a.gemm == b.gemm and b.launches < a.launches
    one = block(1, plain), block(1, gathered)
    assert (one[0].cast, one[0].cast_bwd) == (one[1].cast, one[1].cast_bwd)
