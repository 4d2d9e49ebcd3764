"""The cost model's roofline, per-stage pipeline times, TP overlap and calibration
(:mod:`plait.plan.roofline`, :mod:`plait.plan.timing`, :mod:`plait.plan.schedule`)."""

from __future__ import annotations

import dataclasses

import pytest

from plait.plan import Layout, Workload, device, preset, roofline, stacks, timing
from plait.plan.calibration import (
    CALIBRATION_RUNS,
    DEVICE_RUNS,
    HOST_RUNS,
    PublishedRun,
    calibrate,
    calibrate_devices,
    calibrate_host,
    calibrate_stacks,
)
from plait.plan.calibration import predicted as calibration_predicted
from plait.plan.compute_time import DEVICE_SCALE, STACK_HOST
from plait.plan.devices import memory_bandwidth
from plait.plan.models import gpt
from plait.plan.roofline import (
    elementwise_seconds,
    gemm_fraction,
    gemm_seconds,
    k_half,
    profile,
)
from plait.plan.schedule import layout_shape, pipeline_stages, stage_makespan
from plait.plan.spec import ModelSpec, PlanLayout, Software
from plait.plan.timing import EFFICIENCY, STACK_SCALE, predict_time

H100 = device("h100")


def test_gemm_fraction_grows_with_size_and_saturates() -> None:
    sizes = [128, 512, 1024, 4096, 16384, 65536]
    fractions = [gemm_fraction(s, s, s, 0.8) for s in sizes]
    assert fractions == sorted(fractions)
    assert fractions[0] < 0.2 < 0.7 < fractions[-2]
    assert fractions[-1] <= 0.8 and fractions[-1] - fractions[-2] < 0.02  # saturates
    # A small dimension alone holds a large GEMM back.
    assert gemm_fraction(16384, 64, 16384, 0.8) < 0.5 * gemm_fraction(16384, 16384, 16384, 0.8)


def test_reduction_half_scales_with_the_per_sm_rate() -> None:
    # K_half = GEMM_HALF x (peak / SMs) / the A100's: the tile's fixed prologue and
    # epilogue cost 2.6x more main-loop steps on the H100 (989 / 132 vs 312 / 108).
    assert k_half(device("a100")) == roofline.GEMM_HALF
    assert k_half(device("a100-40gb")) == roofline.GEMM_HALF
    assert k_half(device("h100")) == pytest.approx(128 * (989 / 132) / (312 / 108))
    assert k_half(device("h200")) == k_half(device("h100"))
    assert k_half(device("h100")) == pytest.approx(332, abs=1)
    a100, h100 = profile(device("a100")), profile(device("h100"))
    assert a100 is not None and h100 is not None
    assert h100.k_half == k_half(device("h100"))
    # Only K is priced per device: M and N keep one tile edge.
    assert gemm_fraction(4096, 4096, 16384, 1.0, h100.k_half) == pytest.approx(
        gemm_fraction(4096, 4096, 16384, 1.0) * (16384 / 16512) ** -1 * (16384 / 16716), rel=1e-3
    )

    def short_k_loss(prof: roofline.KernelProfile) -> float:
        # the rate of a K = 2,048 GEMM (d 2,048) relative to a K = 16,384 one
        short = gemm_fraction(8192, 8192, 2048, prof.gemm, prof.k_half)
        return short / gemm_fraction(8192, 8192, 16384, prof.gemm, prof.k_half)

    assert short_k_loss(a100) == pytest.approx(0.94, abs=0.01)
    assert short_k_loss(h100) == pytest.approx(0.88, abs=0.01)
    # Seconds follow: a short-K GEMM costs relatively more on the H100.
    peak_a, peak_h = device("a100").flops, H100.flops

    def seconds_ratio(prof: roofline.KernelProfile, peak: float) -> float:
        short = gemm_seconds(8192, 8192, 2048, peak, prof, 2) * 8
        return short / gemm_seconds(8192, 8192, 16384, peak, prof, 2)

    assert seconds_ratio(h100, peak_h) > 1.05 * seconds_ratio(a100, peak_a)


def test_short_k_slows_small_h100_models_more_than_large() -> None:
    # Megatron-Core's 1.7B (d 2,048, tp 1) against its 462B (d 18,432, tp 8) on the H100:
    # the per-device K_half takes more from the small model's block than the large one's.
    small = gpt(24, 16, 2048, 4096, vocab=131072)
    large = gpt(106, 128, 18432, 4096, vocab=131072)
    prof = profile(H100)
    assert prof is not None
    flat = dataclasses.replace(prof, k_half=roofline.GEMM_HALF)

    def slowdown(model: ModelSpec, tp: int) -> float:
        args = (model, tp, 4096.0, 4096, 1, 2, False)
        return (
            roofline.block_kernels(*args, prof, H100.flops).gemm
            / roofline.block_kernels(*args, flat, H100.flops).gemm
        )

    assert slowdown(small, 1) > 1.05
    assert slowdown(small, 1) > slowdown(large, 8) + 0.03


def test_memory_bound_op_is_priced_by_bandwidth() -> None:
    prof = profile(H100)
    assert prof is not None and prof.bandwidth == memory_bandwidth(H100) == 3.35e12
    assert elementwise_seconds(2e9, prof) == pytest.approx(2 * elementwise_seconds(1e9, prof))
    # A matrix-vector product (M = 1) is bound by its bytes, not its FLOPs.
    mv = gemm_seconds(1, 8192, 8192, H100.flops, prof, 2)
    assert mv == pytest.approx(elementwise_seconds(2 * (8192 * 8192 + 2 * 8192), prof))
    assert profile(device("cpu")) is None  # no roofline: the flat fraction


def _stage_times(model_layers: int, layout: Layout) -> tuple[float, ...]:
    """Per-stage durations as the cost model computes them (forward plus backward)."""
    from plait.plan import timing

    model = dataclasses.replace(preset("llama3-8b"), layers=model_layers)
    work = Workload(8192, 64)
    out = []
    stages = pipeline_stages(model.layers, layout.pp, layout.schedule, layout.stages_per_rank)
    for s, (size, rank) in enumerate(stages):
        load = timing.RankLoad(rank, size, size, s == 0, s == len(stages) - 1, 1, 1)
        t = timing._rank_times(model, layout, work, H100, load, EFFICIENCY)
        out.append(t.per_microbatch(size))
    return tuple(out)


def test_first_and_last_stages_carry_embedding_and_head() -> None:
    d = _stage_times(32, Layout(dp_shard=2, pp=4, microbatches=8))
    assert d[0] > d[1] == pytest.approx(d[2]) and d[3] > d[0]  # head + loss > embedding


def test_uneven_split_heavier_stage_bounds_makespan() -> None:
    # 4 stages of 3, 3, 2, 2 blocks (plait's split gives the first stages the extra).
    durations = (3.0, 3.0, 2.0, 2.0)
    owners = (0, 1, 2, 3)
    m = 16
    uniform = layout_shape(
        dataclasses.replace(preset("llama3-8b"), layers=10), Layout(pp=4, microbatches=m)
    ).makespan
    got = stage_makespan(durations, owners, 4, m, uniform)
    assert got == pytest.approx(sum(durations) + (m - 1) * max(durations))
    assert got >= m * max(durations)
    # Uniform stages: exactly the schedule's makespan.
    assert stage_makespan((1.0,) * 4, owners, 4, m, uniform) == pytest.approx(uniform)


def test_interleaving_lowers_the_bubble() -> None:
    model, work = preset("llama3-70b"), Workload(8192, 64)
    plain = Layout(dp_shard=2, tp=8, pp=8, microbatches=16, ac="full")
    looped = dataclasses.replace(plain, schedule="Interleaved1F1B", stages_per_rank=2)
    a = predict_time(model, plain, work, H100, layout_shape(model, plain))
    b = predict_time(model, looped, work, H100, layout_shape(model, looped))
    # 1F1B's bubble (p - 1) / (m + p - 1) halves with 2 stages per rank.
    assert a.bubble == pytest.approx(7 / 23)
    assert b.bubble == pytest.approx(7 / (2 * 16 + 7))
    assert b.step_time < a.step_time


def test_tp_overlap_reduces_exposed_time() -> None:
    model, work = preset("llama3-70b"), Workload(8192, 32)
    layout = Layout(dp_shard=4, tp=8, ac="full")
    shape = layout_shape(model, layout)
    sync = predict_time(model, layout, work, H100, shape)
    overlapped = predict_time(model, layout, work, H100, shape, tp_overlap="async")
    assert overlapped.step_time < sync.step_time
    with pytest.raises(ValueError, match="tp_overlap"):
        predict_time(model, layout, work, H100, shape, tp_overlap="sometimes")


def test_sustained_fraction_is_fitted_to_the_calibration_runs() -> None:
    assert calibrate() == pytest.approx(EFFICIENCY, rel=0.01)


def test_stack_scales_are_fitted_one_run_per_stack() -> None:
    stacks = [r.software.kernels for r in CALIBRATION_RUNS]
    assert len(stacks) == len(set(stacks))  # at most one calibration run per stack
    fitted = calibrate_stacks()
    assert set(fitted) == set(STACK_SCALE)
    for name, scale in fitted.items():
        assert scale == pytest.approx(STACK_SCALE[name], rel=0.01), name


def test_generation_scales_are_fitted_on_a_stack_fitted_on_the_a100() -> None:
    fitted = calibrate_devices()
    assert set(fitted) == set(DEVICE_SCALE)
    for name, scale in fitted.items():
        assert scale == pytest.approx(DEVICE_SCALE[name], rel=0.01), name
    stacks = {r.software.kernels: r.device for r in CALIBRATION_RUNS}
    for run in DEVICE_RUNS:  # its stack's own scale was fitted on the A100
        assert stacks[run.software.kernels] == "a100" and run.device != "a100"
    # A generation's scale moves its devices' compute only: the same run on the A100 is
    # priced as before, on the H100 at that scale less throughput.
    run = DEVICE_RUNS[0]
    half = calibration_predicted(run, EFFICIENCY, generation=DEVICE_SCALE["hopper"] / 2)
    assert half < calibration_predicted(run, EFFICIENCY)


def test_host_seconds_are_fitted_on_one_run_of_their_stack() -> None:
    fitted = calibrate_host()
    assert set(fitted) == set(STACK_HOST) == {r.software.kernels for r in HOST_RUNS}
    for name, host in fitted.items():
        assert host == pytest.approx(STACK_HOST[name], rel=0.01), name
    # The fit leaves the table as it was.
    assert calibrate_host() == fitted


def test_megatron_deepspeed_is_megatron_2021_plus_host_time_per_block_and_microbatch() -> None:
    run = HOST_RUNS[0]
    dev = device("a100")

    def step(kernels: str, microbatches: int) -> float:
        layout = dataclasses.replace(run.layout, microbatches=microbatches)
        work = dataclasses.replace(run.work, global_batch=microbatches * 16)
        shape = layout_shape(run.model, layout)
        sw = Software(kernels, grad_reduce_fp32=True)
        return predict_time(run.model, layout, work, dev, shape, software=sw).step_time

    # Same kernels and scale: the difference is the host time alone, growing by the same
    # amount with each micro-batch (forward, full recompute, backward: 4 x per block on the
    # busiest stage's blocks).
    extra = [step("megatron-deepspeed", m) - step("megatron-2021", m) for m in (64, 128)]
    blocks = max(r.layers for r in layout_shape(run.model, run.layout).ranks)
    per_microbatch = 4 * STACK_HOST["megatron-deepspeed"] * blocks
    assert extra[1] - extra[0] == pytest.approx(64 * per_microbatch, rel=0.05)
    assert stacks.stack("megatron-deepspeed").scale_of == "megatron-2021"


def test_calibration_runs_match_the_published_table() -> None:
    published = pytest.importorskip("benchmarks.published_runs")
    fresh = pytest.importorskip("benchmarks.published_fresh")
    tables = (
        (published.CALIBRATION, CALIBRATION_RUNS + DEVICE_RUNS),
        (tuple(r for r in fresh.FRESH if r.role == "calibration"), HOST_RUNS),
    )
    for table, runs in tables:
        rows = {r.name: r for r in table}
        assert set(rows) == {r.name for r in runs}
        for run in runs:
            row = rows[run.name]
            assert (row.model, row.layout, row.work, row.device, row.software, row.zero) == (
                run.model,
                run.layout,
                run.work,
                run.device,
                run.software,
                run.zero,
            )
            assert row.node_network_gbps == run.node_network_gbps, run.name
            assert published.tokens_per_s(row) == pytest.approx(run.tokens_per_s_per_device)


def _zero_layout(zero: int, microbatches: int = 4) -> PlanLayout:
    return PlanLayout(dp_replicate=48, tp=8, microbatches=microbatches, ac="none", zero=zero)


def test_zero_reductions_overlap_backward_unless_communication_shares_the_cores() -> None:
    model, work = preset("llama3-70b"), Workload(4096, 192)
    layout = _zero_layout(1)
    shape = layout_shape(model, layout)
    overlapped = predict_time(model, layout, work, H100, shape)
    serial = predict_time(model, layout, work, dataclasses.replace(H100, overlap=False), shape)
    assert overlapped.exposed_comm < serial.exposed_comm
    # ZeRO-2 reduce-scatters every microbatch: never less exposed than ZeRO-1.
    two = predict_time(model, _zero_layout(2), work, H100, shape)
    assert two.exposed_comm >= overlapped.exposed_comm
    # Reducing in bf16 halves the bytes of the gradient reduce-scatter.
    bf16 = predict_time(model, layout, work, H100, shape, software=Software(grad_reduce_fp32=False))
    assert bf16.exposed_comm < overlapped.exposed_comm


def test_param_gather_overlap_hides_zeros_all_gather() -> None:
    model, work = preset("llama3-70b"), Workload(4096, 192)
    layout = _zero_layout(1)
    shape = layout_shape(model, layout)
    after = predict_time(model, layout, work, H100, shape)
    beside = predict_time(
        model, layout, work, H100, shape, software=Software(param_gather_overlap=True)
    )
    assert beside.step_time < after.step_time
    # Without ZeRO there is nothing to gather: the option changes nothing.
    plain = Layout(dp_replicate=48, tp=8, microbatches=4, ac="none")
    a = predict_time(model, plain, work, H100, layout_shape(model, plain))
    b = predict_time(
        model,
        plain,
        work,
        H100,
        layout_shape(model, plain),
        software=Software(param_gather_overlap=True),
    )
    assert a.step_time == b.step_time


def _mfu(model_name: str, gap: float, monkeypatch: pytest.MonkeyPatch) -> float:
    from plait.plan import timing

    monkeypatch.setattr(timing, "KERNEL_GAP", gap)
    model = preset(model_name)
    layout, work = Layout(dp_shard=8, ac="none"), Workload(4096, 8)
    return predict_time(model, layout, work, H100, layout_shape(model, layout)).mfu


def test_kernel_gaps_cost_small_models_more(monkeypatch: pytest.MonkeyPatch) -> None:
    small = _mfu("llama3-8b", 0.0, monkeypatch) / _mfu("llama3-8b", 3e-6, monkeypatch)
    large = _mfu("llama3-70b", 0.0, monkeypatch) / _mfu("llama3-70b", 3e-6, monkeypatch)
    assert small > large > 1.0


def test_optimizer_step_is_priced_on_roofline_devices() -> None:
    model, work = preset("llama3-8b"), Workload(8192, 16)
    eight, one = Layout(dp_shard=8), Layout(dp_replicate=8)
    sharded = predict_time(model, eight, work, H100, layout_shape(model, eight))
    whole = predict_time(model, one, work, H100, layout_shape(model, one))
    assert 0 < sharded.host < whole.host
    assert whole.host / sharded.host == pytest.approx(8, rel=0.01)


def _attention(stack: str, dev: str, seq: int) -> float:
    d = device(dev)
    prof = profile(d)
    assert prof is not None
    model = preset("llama3-8b")
    k = roofline.block_kernels(
        model, 1, seq, seq, 1, 2, False, prof, d.flops, stacks.stack(stack), False, dev
    )
    return (k.attention_fwd + k.attention_bwd) / (k.forward + k.backward)


def test_attention_is_priced_by_the_stacks_kernel() -> None:
    # Megatron 2021's scores are materialized (memory-bound softmax and dropout, score
    # GEMMs with a head-dimension inner loop): a larger share than a flash kernel's.
    assert _attention("megatron-2021", "a100", 2048) > 1.5 * _attention("llm-foundry", "a100", 2048)
    # cuDNN's fused attention (Transformer Engine) runs faster than FA2 on H100.
    assert _attention("megatron-core", "h100", 8192) < _attention("plait", "h100", 8192)
    with pytest.raises(ValueError, match="kernels"):
        stacks.stack("jax")


def test_fused_stacks_move_fewer_bytes_and_torchtitan_recomputes_matmuls() -> None:
    d = device("h100")
    prof = profile(d)
    assert prof is not None
    model = preset("llama3-8b")

    def kernels(name: str) -> roofline.BlockKernels:
        return roofline.block_kernels(
            model, 1, 8192, 8192, 1, 2, False, prof, d.flops, stacks.stack(name), False, "h100"
        )

    assert kernels("megatron-core").elementwise < kernels("plait").elementwise
    layout, work = Layout(dp_shard=8, ac="selective"), Workload(8192, 16)
    shape = layout_shape(model, layout)
    plait_sac = predict_time(model, layout, work, H100, shape)
    titan_sac = predict_time(model, layout, work, H100, shape, software=Software("torchtitan"))
    scale = STACK_SCALE["torchtitan"]
    # torchtitan's policy recomputes every second matmul, plait's none: more compute even
    # before its stack's sustained fraction.
    assert titan_sac.compute * scale > plait_sac.compute


def test_loss_bytes_follow_the_stacks_loss_kernel() -> None:
    # Megatron's vocab-parallel cross-entropy (logits.float(), max, in-place subtract, exp,
    # sum, divide; backward multiply and the cast back) against torch's eager loss and the
    # fused flash-attn kernel llm-foundry runs (read the logits; backward read, write).
    assert roofline.loss_bytes("megatron-fp32", 2) == 52
    assert roofline.loss_bytes("eager-fp32", 2) == 32
    assert roofline.loss_bytes("fused", 2) == 6
    d = device("h100")
    prof = profile(d)
    assert prof is not None
    model = preset("llama3-8b")

    def head(loss: str) -> float:
        fwd, bwd = roofline.head_kernels(model, 1, 4096, 2, prof, d.flops, loss)
        return fwd + bwd

    assert head("fused") < head("eager-fp32") < head("megatron-fp32")
    assert stacks.stack("megatron-core").loss == "megatron-fp32"
    assert stacks.stack("llm-foundry").loss == "fused"
    # a small model's head weighs more: its throughput moves more with the loss's bytes
    small, large = gpt(24, 16, 2048, 4096, vocab=131072), gpt(48, 56, 7168, 4096, vocab=131072)

    def slowdown(m: ModelSpec) -> float:
        layout, work = Layout(dp_replicate=8), Workload(4096, 8)
        shape = layout_shape(m, layout)
        fused = predict_time(m, layout, work, H100, shape, software=Software("llm-foundry"))
        core = dataclasses.replace(stacks.stack("llm-foundry"), loss="megatron-fp32")
        try:
            stacks.STACKS["llm-foundry"] = core
            slow = predict_time(m, layout, work, H100, shape, software=Software("llm-foundry"))
        finally:
            stacks.STACKS["llm-foundry"] = dataclasses.replace(core, loss="fused")
        return fused.tokens_per_s_per_device / slow.tokens_per_s_per_device

    assert slowdown(small) > slowdown(large) > 1.0


def test_collectives_beside_compute_slow_it_down(monkeypatch: pytest.MonkeyPatch) -> None:
    assert timing.interference(H100) == pytest.approx(24 / 132)
    assert timing.interference(device("a100")) == pytest.approx(24 / 108)
    assert timing.interference(device("cpu")) == 0.0
    assert timing.interference(dataclasses.replace(H100, measured=True)) == 0.0
    # MPT-13B over 64 H100s at two sequences per rank (llm-foundry's run): FSDP's gathers
    # and reductions all hide behind compute, yet take 24 of 132 SMs while they run.
    model = gpt(40, 40, 5120, 2048, vocab=50368, tied=True)
    layout, work = Layout(dp_shard=64), Workload(2048, 128)
    shape = layout_shape(model, layout)
    sw = Software("llm-foundry")
    busy = predict_time(model, layout, work, H100, shape, software=sw)
    monkeypatch.setattr(timing, "COLLECTIVE_CTAS", 0)
    free = predict_time(model, layout, work, H100, shape, software=sw)
    assert busy.step_time > 1.03 * free.step_time
    # at most the SMs' share of every collective's time (the exposed part costs nothing more)
    assert busy.step_time - free.step_time < 24 / 132 * sum(c.seconds for c in free.collectives)
    # one GPU: nothing to run beside compute
    one = Layout()
    lone = predict_time(model, one, Workload(2048, 2), H100, layout_shape(model, one), software=sw)
    monkeypatch.undo()
    again = predict_time(model, one, Workload(2048, 2), H100, layout_shape(model, one), software=sw)
    assert lone.step_time == again.step_time


def _mpt_kernels() -> roofline.BlockKernels:
    d = device("h100")
    prof = profile(d)
    assert prof is not None
    model = gpt(48, 64, 7168, 2048, vocab=50368, tied=True)  # MPT-30B
    return roofline.block_kernels(
        model,
        1,
        6144,
        2048,
        1,
        2,
        False,
        prof,
        d.flops,
        stacks.stack("llm-foundry"),
        False,
        "h100",
    )


def test_early_stop_tail_is_the_mlp_output_gemm_and_last_residual() -> None:
    # torch >= 2.1's non-reentrant checkpoint (and plait.checkpoint) stop recomputing once
    # the last saved tensor, the MLP output GEMM's input, is packed: that GEMM never runs.
    d = device("h100")
    prof = profile(d)
    assert prof is not None
    k = _mpt_kernels()
    down = gemm_seconds(6144, 7168, 4 * 7168, d.flops, prof, 2)
    residual = elementwise_seconds(6144 * 3 * 2 * 7168, prof)  # read two, write one
    assert k.tail == pytest.approx(down + residual)
    assert 0.25 < k.tail / k.forward < 0.4  # a third of the GEMMs, most of the forward
    assert stacks.stack("llm-foundry").early_stop and stacks.stack("plait").early_stop
    assert not stacks.stack("megatron-core").early_stop  # Megatron's own checkpoint
    assert not stacks.stack("megatron-2021").early_stop


def test_full_recompute_skips_the_tail_only_with_early_stop() -> None:
    model = gpt(48, 64, 7168, 2048, vocab=50368, tied=True)
    work = Workload(2048, 24)
    h100 = device("h100")
    lay = Layout(dp_shard=8, microbatches=1, ac="full")
    shape = layout_shape(model, lay)

    def step(layout: Layout, early_stop: bool | None = None) -> float:
        software = Software("llm-foundry", ac_early_stop=early_stop)
        return predict_time(model, layout, work, h100, shape, software=software).step_time

    none = step(dataclasses.replace(lay, ac="none"))
    early, whole = step(lay), step(lay, False)
    assert step(lay, True) == early
    assert none < early < whole
    # the saving: every block's tail (one microbatch of 3 x 2048 tokens per rank)
    s = EFFICIENCY * STACK_SCALE["llm-foundry"] * DEVICE_SCALE["hopper"]
    saved = 48 * _mpt_kernels().tail / s
    assert whole - early == pytest.approx(saved, rel=1e-3)


def test_torch_async_tp_fuses_forward_and_backward_gathers_not_backward_reductions() -> None:
    """``tp_overlap="micro-pipeline"`` (torch's async TP): forward as Megatron's overlap,
    backward's two reduce-scatters (of sums of matmuls) whole; its fused reduce-scatters
    add a reduction of the tp partial outputs to every forward; nothing is fused without
    sequence parallelism (all-reduces)."""
    from plait.plan.comm_time import tp_exposed
    from plait.plan.compute_time import kernel_times

    model, work = preset("llama3-8b"), Workload(8192, 64)
    layout = Layout(dp_shard=8, tp=8, ac="full")
    long = (1.0, 1.0, 1.0, 1.0)  # GEMMs after each collective, longer than it

    def exposed(lay: Layout, fused: tuple[float, ...], overlap: str) -> tuple[float, float]:
        fwd, bwd, _ = tp_exposed(model, lay, work, H100, fused, overlap)
        return fwd, bwd

    whole = exposed(layout, long, "none")
    assert exposed(layout, long, "async") == (0.0, 0.0)
    assert exposed(layout, long, "micro-pipeline") == (0.0, whole[1] / 2)
    no_sp = dataclasses.replace(layout, sequence_parallel=False)
    assert exposed(no_sp, long, "micro-pipeline") == exposed(no_sp, long, "none")
    # Each collective hides behind its own GEMMs only: attention's projections shorter
    # than their collectives expose the difference, however long the MLP's GEMMs are.
    one = whole[1] / 4  # one collective
    short = (0.25 * one, 0.5 * one, 1.0, 1.0)
    fwd, bwd = exposed(layout, short, "micro-pipeline")
    assert fwd == pytest.approx(0.75 * one + 0.5 * one)
    assert bwd == pytest.approx(2 * one + 0.5 * one)  # reductions whole, o's gather's rest
    fwd, bwd = exposed(layout, short, "async")
    assert (fwd, bwd) == (pytest.approx(1.25 * one), pytest.approx(1.25 * one))
    # What a recompute that keeps the reduce-scatters' outputs repeats: the gathers alone
    # (without sequence parallelism the all-reduces, whole).
    assert tp_exposed(model, layout, work, H100, short, "micro-pipeline")[2] == pytest.approx(
        0.75 * one
    )
    assert tp_exposed(model, layout, work, H100, long, "none")[2] == pytest.approx(2 * one)
    assert tp_exposed(model, no_sp, work, H100, long, "none")[2] == exposed(no_sp, long, "none")[0]
    rank = layout_shape(model, layout).ranks[0]

    def times(overlap: str) -> tuple[float, float, float]:
        sw = Software("torchtitan", overlap)
        k = kernel_times(model, layout, work, H100, rank, 1.0, sw, 0.0)
        return k.fwd, k.bwd, k.recompute

    base, micro = times("async"), times("micro-pipeline")
    prof = profile(H100)
    assert prof is not None
    n = work.global_batch * work.seq_len / 8  # the rank's tokens
    extra = 2 * elementwise_seconds(n * model.d_model * 2 * (1 + 1 / 8), prof)
    # and its fused GEMMs run one row chunk at a time (test below)
    args = (model, 8, n, 8192, 1, 2, False, prof, H100.flops, stacks.stack("torchtitan"), True)
    whole_k = roofline.block_kernels(*args, "h100")
    chunked = roofline.block_kernels(*args, "h100", pipelined=True)
    scale = STACK_SCALE["torchtitan"] * DEVICE_SCALE["hopper"]
    fwd_extra = extra + chunked.forward - whole_k.forward
    assert micro[0] - base[0] == pytest.approx(fwd_extra / scale)
    # the full recompute's (which stops before the MLP's output GEMM: torchtitan's torch)
    redo_extra = fwd_extra - chunked.tail + whole_k.tail
    assert micro[2] - base[2] == pytest.approx(redo_extra / scale)
    assert micro[1] - base[1] == pytest.approx((chunked.backward - whole_k.backward) / scale)


def test_torch_async_tp_runs_its_fused_gemms_one_row_chunk_at_a_time() -> None:
    """torch's fused all-gather + matmul multiplies each gathered shard as it arrives, and
    its fused matmul + reduce-scatter each destination's chunk: ``tp`` GEMMs of ``n / tp``
    rows (``torch.distributed._symmetric_memory``). Forward: every tp-split GEMM of the
    block; backward: only the input gradients of o and the MLP's output projection (fed by
    the two fused gathers of output gradients)."""
    prof = profile(H100)
    assert prof is not None
    model = preset("llama3-8b")
    d, f, q, kv, tp, n = 4096, model.ffn_hidden, model.q_width, model.kv_width, 8, 8192.0
    titan = stacks.stack("torchtitan")

    def block(pipelined: bool, tp: int = tp) -> roofline.BlockKernels:
        return roofline.block_kernels(
            model,
            tp,
            n,
            8192,
            1,
            2,
            False,
            prof,
            H100.flops,
            titan,
            True,
            "h100",
            pipelined=pipelined,
        )

    def g(m: float, nn: float, kk: float) -> float:
        return gemm_seconds(m, nn, kk, H100.flops, prof, 2)

    shapes = [(q / tp, d), (kv / tp, d), (kv / tp, d), (d, q / tp), (f / tp, d)] + [
        (f / tp, d),
        (d, f / tp),
    ]
    plain, chunked = block(False), block(True)
    assert plain.gemm == pytest.approx(sum(g(n, a, b) for a, b in shapes))
    assert chunked.gemm == pytest.approx(sum(tp * g(n / tp, a, b) for a, b in shapes))
    assert chunked.gemm > 1.05 * plain.gemm  # 1,024-row chunks of an 8,192-token microbatch
    grads = [(q / tp, d), (f / tp, d)]  # o's and the down projection's input gradients
    delta = sum(tp * g(n / tp, a, b) - g(n, a, b) for a, b in grads)
    assert chunked.backward == pytest.approx(plain.backward + delta)
    assert chunked.attention_fwd == plain.attention_fwd
    assert chunked.elementwise == plain.elementwise
    assert block(True, tp=1) == block(False, tp=1)  # nothing to chunk without tp


def test_torchtitan_selective_recompute_repeats_only_tps_gathers() -> None:
    """torchtitan's op-level selective checkpointing saves reduce-scatter outputs
    (``torchtitan/distributed/activation_checkpoint.py``): its recompute reruns TP's two
    all-gathers, plait's and a full checkpoint's the whole forward exchange."""
    from plait.plan.comm_time import tp_exposed
    from plait.plan.compute_time import kernel_times
    from plait.plan.rank_time import _passes
    from plait.plan.shards import rank_params

    model, work = preset("llama3-8b"), Workload(8192, 64)
    layout = Layout(dp_shard=8, tp=8, ac="selective")
    rank = layout_shape(model, layout).ranks[0]
    params = rank_params(model, layout, rank)
    titan, plait_sw = Software("torchtitan"), Software("plait")
    k = kernel_times(model, layout, work, H100, rank, 1.0, titan, 0.0)
    fwd, bwd, gathers = tp_exposed(model, layout, work, H100, k.fused, "none")
    assert 0 < gathers < fwd
    kept = _passes(model, layout, work, H100, k, params, 0, titan, 0.0)
    rerun = _passes(model, layout, work, H100, k, params, 0, plait_sw, 0.0)
    assert kept.fwd == rerun.fwd == pytest.approx(k.fwd + fwd)
    assert kept.bwd == pytest.approx(k.bwd + k.recompute + bwd + gathers)
    assert rerun.bwd == pytest.approx(k.bwd + k.recompute + bwd + fwd)
    full = dataclasses.replace(layout, ac="full")
    whole = _passes(model, full, work, H100, k, params, 0, titan, 0.0)
    assert whole.bwd == pytest.approx(rerun.bwd)


def test_triton_attention_rate_is_the_least_squares_fit_of_llm_foundrys_tables() -> None:
    fit = pytest.importorskip("benchmarks.foundry_attention")
    published = pytest.importorskip("benchmarks.published_runs")
    holdout = pytest.importorskip("benchmarks.published_holdout")
    fresh = pytest.importorskip("benchmarks.published_fresh")
    assert stacks.stack("llm-foundry").attention == "triton"

    # Fitted on rows no validation set counts (nor the calibration rows): none is one of theirs.
    def key(run: PublishedRun) -> tuple[object, ...]:
        return (run.device, run.model, run.layout, run.work)

    others = {key(r) for r in (*published.RUNS, *holdout.HOLDOUT, *fresh.FRESH)}
    for chip, runs in fit.FIT_RUNS.items():
        assert runs and not others & {key(r) for r in runs}, chip
        assert all(r.device == chip and r.role == "calibration" for r in runs)
        stated = stacks.TRITON_SLOWDOWN[chip]
        assert fit.fit(chip) == pytest.approx(stated, abs=0.01), chip
        # The fit is a real minimum: pricing the kernel as FlashAttention-2 is worse.
        assert fit.objective(chip, stated) < fit.objective(chip, 1.0) / 2
    # The fit restores every constant it tried.
    assert stacks.ATTENTION[("triton", "h100")] == (
        0.35 / stacks.TRITON_SLOWDOWN["h100"],
        0.30 / stacks.TRITON_SLOWDOWN["h100"],
    )
    assert calibrate_stacks()["llm-foundry"] == pytest.approx(STACK_SCALE["llm-foundry"], rel=0.01)
