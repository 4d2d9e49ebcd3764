"""Published large training runs, as their sources state them: the data of issue 28.

Each :class:`PublishedRun` is one configuration of one published table: the model's shape,
the layout it ran (as plait's :class:`~plait.plan.spec.Layout`), the workload, the device,
the metric exactly as published and which FLOPs that metric counts. Nothing here predicts:
:mod:`benchmarks.plan_published` evaluates the planner on every row, and the cost model's
calibration reads the rows whose ``role`` is ``"calibration"``. Everything else is
``"validation"``: a prediction that no constant was fitted to.

**MFU, one definition.** Sources count FLOPs differently; every row is converted to
plait's model FLOPs utilisation (:func:`plait_mfu`): the published throughput in tokens/s
per GPU (:func:`tokens_per_s`, from the metric and the source's FLOP count) times
:func:`plait.plan.models.flops_per_token` (``6 N + 12 L d T``: matrix multiplications of
the blocks and the head, attention scores and values without the causal discount, no
recomputation) over the device's dense bf16 peak (989 TFLOP/s H100 SXM, 312 A100). The
FLOP counts (:data:`FLOP_COUNTS`):

* ``"megatron-2021"``: Narayanan et al. 2021 (arXiv 2104.04473, section 5.1, eq. 3),
  ``96 B s l h^2 (1 + s/6h + V/16lh)`` per step: with full activation recomputation (a
  second forward of every block, not of the head), so its TFLOP/s is a hardware count.
* ``"megatron-core"``: Megatron-Core's ``num_floating_point_operations``
  (``megatron/training/training.py`` at ``core_v0.8.0``): ``12 s l h^2 ((1 + g/a + s/h) q/h
  + (f/h) k + V/2lh)`` per sequence, model FLOPs without recomputation: plait's count up
  to the biases.
* ``"mosaic"``: llm-foundry's MFU (``scripts/train/benchmarking/README.md``): ``6 x
  NumParams`` (every parameter, the learned positions included) plus ``12 L d T`` per
  token; rows carry its tokens/s per GPU, which need no FLOP count.
* ``"plait"``: the source's TFLOP/s is taken as plait's count (its convention is not
  stated: the Llama 3 rows).

Rows whose run used what the planner does not model (Float8, ``torch.compile``, async
tensor parallelism) carry the reason in ``excluded``: they are listed, not counted in the
statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plait.plan.devices import compute_peak, device
from plait.plan.models import flops_per_token, gpt, preset
from plait.plan.spec import Layout, ModelSpec, Software, Workload

__all__ = [
    "CALIBRATION",
    "CODE_BASES",
    "FLOP_COUNTS",
    "FOUNDRY",
    "FOUNDRY_A100_40",
    "FOUNDRY_A100_80",
    "FOUNDRY_H100",
    "FOUNDRY_H100_SCALE",
    "GRAND_TETON_NETWORK_GBPS",
    "LLAMA3",
    "MEGATRON",
    "RUNS",
    "TORCHTITAN",
    "VALIDATION",
    "PublishedRun",
    "foundry_run",
    "grand_teton_run",
    "plait_mfu",
    "published_flops_per_token",
    "titan_software",
    "tokens_per_s",
]

#: How a published FLOP figure was counted (module docstring).
FLOP_COUNTS = ("megatron-2021", "megatron-core", "mosaic", "plait")
METRICS = ("tflops", "tokens", "mfu")
ROLES = ("calibration", "validation")

MEGATRON = "Megatron-LM"
TORCHTITAN = "torchtitan"
FOUNDRY = "llm-foundry"
LLAMA3 = "Meta Llama 3"
# Code bases of the held-out rows (benchmarks/published_holdout.py).
NEMO = "NeMo"  # NeMo (Megatron-Core underneath), NVIDIA's DGX Cloud benchmarking recipes
FMS_FSDP = "fms-fsdp"  # IBM's foundation-model-stack FSDP trainer
AUTOMODEL = "NeMo AutoModel"  # NeMo's PyTorch (FSDP2) backend
MAXTEXT = "MaxText"  # JAX / XLA
# Code bases of the fresh held-out rows (benchmarks/published_fresh.py).
MEGATRON_DEEPSPEED = "Megatron-DeepSpeed"  # DeepSpeed pipeline + ZeRO-1 with Megatron-LM's TP
LIT_GPT = "lit-gpt"  # Lightning Fabric FSDP (TinyLlama's fork of lit-gpt)
CODE_BASES = (
    MEGATRON,
    TORCHTITAN,
    FOUNDRY,
    LLAMA3,
    NEMO,
    FMS_FSDP,
    AUTOMODEL,
    MAXTEXT,
    MEGATRON_DEEPSPEED,
    LIT_GPT,
)


@dataclass(frozen=True)
class PublishedRun:
    """One published configuration and what it measured (per GPU).

    ``metric`` / ``value``: the figure as the source prints it: ``"tflops"`` (achieved
    TFLOP/s per GPU, counted as ``flops``), ``"tokens"`` (tokens/s per GPU) or ``"mfu"``
    (a fraction, counted as ``flops`` against the source's peak). ``stated_mfu``: the MFU
    (or % of peak) the source prints beside it, in its own count (0: none). ``zero``:
    ZeRO stage of the data parallelism (Megatron-LM's distributed optimizer is 1); the
    layout's ``dp_replicate`` holds those ranks. ``series``: rows of one source that vary
    the model size (the trend check), "" for none. ``software``: what the run's code did
    beside the layout (its kernels, TP communication overlap, ZeRO's parameter-gather
    overlap: :class:`plait.plan.spec.Software`), as its source states it or, where it
    does not, the code base's defaults of the time (said in ``notes``); never chosen to
    improve the fit. ``node_network_gbps``: the inter-node network per node the source
    states, in Gb/s (shared by the node's GPUs); 0 where it states none (the preset's).
    """

    name: str
    code_base: str
    source: str
    role: str
    series: str
    size: str  # the model size as the source names it
    device: str  # a plait.plan.devices preset
    memory_gib: float  # the published GPU's memory
    model: ModelSpec
    layout: Layout
    work: Workload
    metric: str
    value: float
    flops: str
    dp_flavour: str  # "DDP", "ZeRO-1" or "FSDP"
    stated_mfu: float = 0.0
    zero: int = 0
    params: int = 0  # the source's parameter count, where its FLOP count uses it (mosaic)
    notes: tuple[str, ...] = ()
    excluded: str = ""  # why the planner cannot model the run (kept out of statistics)
    software: Software = field(default_factory=Software)
    node_network_gbps: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"{self.name}: role {self.role!r} not in {ROLES}")
        if self.metric not in METRICS:
            raise ValueError(f"{self.name}: metric {self.metric!r} not in {METRICS}")
        if self.flops not in FLOP_COUNTS:
            raise ValueError(f"{self.name}: FLOP count {self.flops!r} not in {FLOP_COUNTS}")
        if self.code_base not in CODE_BASES:
            raise ValueError(f"{self.name}: code base {self.code_base!r} not in {CODE_BASES}")

    @property
    def gpus(self) -> int:
        return self.layout.world

    @property
    def pipelined(self) -> bool:
        return self.layout.pp > 1


def published_flops_per_token(run: PublishedRun) -> float:
    """Training FLOPs per token as ``run``'s source counts them (module docstring)."""
    m, s = run.model, run.work.seq_len
    n, h, v = m.layers, m.d_model, m.vocab
    if run.flops == "megatron-2021":
        return 96.0 * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    if run.flops == "megatron-core":
        q_ratio = m.heads * (h // m.heads) / h
        gated = 1.5 if m.gated else 1.0
        attention = (1 + m.kv_heads / m.heads + s / h) * q_ratio
        return 12.0 * n * h * h * (attention + m.ffn_hidden / h * gated + v / (2 * n * h))
    if run.flops == "mosaic":
        return 6.0 * run.params + 12.0 * n * h * s
    return flops_per_token(m, s)


def tokens_per_s(run: PublishedRun) -> float:
    """``run``'s published throughput in tokens/s per GPU."""
    if run.metric == "tokens":
        return run.value
    if run.metric == "tflops":
        return run.value * 1e12 / published_flops_per_token(run)
    peak = compute_peak(device(run.device), run.work.precision)
    return run.value * peak / published_flops_per_token(run)


def plait_mfu(run: PublishedRun) -> float:
    """The MFU ``run``'s throughput is under plait's definition (module docstring)."""
    peak = compute_peak(device(run.device), run.work.precision)
    return tokens_per_s(run) * flops_per_token(run.model, run.work.seq_len) / peak


# --- Megatron-LM on A100 (2021) ----------------------------------------------------------

_MLM_2021 = (
    "NVIDIA/Megatron-LM README.md at 50a4b5fa (Apr 2021), images/cases_april2021.png "
    "(= Narayanan et al. 2021, arXiv 2104.04473, Table 1); heads and the TP x PP split of "
    "its model-parallel size from Table 1 as transcribed in SotaroKaneda/MLCarbon "
    "data/megatron_table.csv"
)
_MLM_2021_NOTES = (
    "vocab 51,200, seq 2,048, GELU 4h, tied embeddings, learned positions (source)",
    "DDP (no distributed optimizer in 2021), full recomputation, no sequence parallelism",
    "micro-batch 1 and the plain 1F1B schedule assumed (the source states neither)",
    "kernels: Megatron-LM 2021's fused LayerNorm, bias-GELU, bias-dropout-add and "
    "scale-mask-softmax, attention scores materialized (no flash attention, which was "
    "published in 2022), dropout 0.1 (its GPT defaults); TP all-reduces synchronous",
)


def _megatron_2021(
    size: str,
    heads: int,
    hidden: int,
    layers: int,
    tp: int,
    pp: int,
    gpus: int,
    batch: int,
    tflops: float,
    percent: float,
    role: str = "validation",
) -> PublishedRun:
    dp = gpus // (tp * pp)
    layout = Layout(
        dp_replicate=dp,
        tp=tp,
        pp=pp,
        microbatches=batch // dp,
        ac="full",
        sequence_parallel=False,
    )
    return PublishedRun(
        name=f"Megatron-LM A100 {size}",
        code_base=MEGATRON,
        source=_MLM_2021,
        role=role,
        series="Megatron-LM A100 2021",
        size=size,
        device="a100",
        memory_gib=80,
        model=gpt(layers, heads, hidden, 2048, vocab=51200, tied=True),
        layout=layout,
        work=Workload(2048, batch),
        metric="tflops",
        value=tflops,
        flops="megatron-2021",
        dp_flavour="DDP",
        stated_mfu=percent / 100,
        notes=_MLM_2021_NOTES,
        software=Software("megatron-2021"),
    )


MEGATRON_A100 = (
    _megatron_2021("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    _megatron_2021("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    _megatron_2021("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    _megatron_2021("18B", 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    _megatron_2021("39B", 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    _megatron_2021("76B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    _megatron_2021("145B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, role="calibration"),
    _megatron_2021("310B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    _megatron_2021("530B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    _megatron_2021("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
)

# --- Megatron-Core on H100 (2024) --------------------------------------------------------

_MCORE = (
    "NVIDIA/Megatron-LM README.md, images/model_table.png (added f2e5db40, Jul 2024, "
    "Megatron-Core r0.8.0 weak scaling)"
)
_MCORE_NOTES = (
    "vocab 131,072, seq 4,096, GELU 4h, untied embeddings (parameter counts match)",
    "overlapped DP (--overlap-grad-reduce/--overlap-param-gather: distributed optimizer, "
    "ZeRO-1) and TP (--tp-comm-overlap) communication (source)",
    "micro-batch 1, 1F1B, sequence parallelism and no recomputation assumed (not stated)",
    "kernels: Transformer Engine (fused LayerNorm-linear, bias-GELU, cuDNN fused "
    "attention), Megatron-Core's default on H100; TP overlap and the DP param-gather "
    "overlap as the source states (README: --tp-comm-overlap, --overlap-grad-reduce "
    "--overlap-param-gather); gradients reduced in bf16 (Megatron-Core's "
    "grad_reduce_in_fp32=False default)",
)


def _megatron_core(
    size: str,
    heads: int,
    hidden: int,
    layers: int,
    tp: int,
    pp: int,
    gpus: int,
    batch: int,
    tflops: float,
    percent: float,
    role: str = "validation",
) -> PublishedRun:
    dp = gpus // (tp * pp)
    layout = Layout(dp_replicate=dp, tp=tp, pp=pp, microbatches=batch // dp, ac="none")
    return PublishedRun(
        name=f"Megatron-Core H100 {size}",
        code_base=MEGATRON,
        source=_MCORE,
        role=role,
        series="Megatron-Core H100 2024",
        size=size,
        device="h100",
        memory_gib=80,
        model=gpt(layers, heads, hidden, 4096, vocab=131072, tied=False),
        layout=layout,
        work=Workload(4096, batch),
        metric="tflops",
        value=tflops,
        flops="megatron-core",
        dp_flavour="ZeRO-1",
        stated_mfu=percent / 100,
        zero=1,
        notes=_MCORE_NOTES,
        software=Software(
            "megatron-core", "async", param_gather_overlap=True, grad_reduce_fp32=False
        ),
    )


MEGATRON_H100 = (
    _megatron_core("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, 41),
    _megatron_core("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9, 47),
    _megatron_core("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1, 49),
    _megatron_core("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6, 46, role="calibration"),
    _megatron_core("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7, 42),
    _megatron_core("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5, 43),
    _megatron_core("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8, 44),
    _megatron_core("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4, 48),
    _megatron_core("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9, 47),
)

# --- llm-foundry (MosaicML MPT) with FSDP ------------------------------------------------

_FOUNDRY_SOURCE = (
    "mosaicml/llm-foundry scripts/train/benchmarking/README.md at 061f2c7c, table '{table}'"
)
_FOUNDRY_NOTES = (
    "MPT: GELU 4h, biases, LayerNorm, tied embeddings, vocab 50,368, learned positions "
    "(shape checked against the table's NumParams)",
    "FSDP; activation checkpointing True = full",
    "kernels: flash attention (flash-attn 2 / triton), low-precision LayerNorm, eager GELU "
    "and residual additions (llm-foundry's MPT defaults)",
)
#: MPT shapes (layers, d_model, heads) by the table's model name.
_MPT = {
    "1b": (24, 2048, 16),
    "3b": (32, 2560, 20),
    "7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    "30b": (48, 7168, 56),
    "70b": (80, 8192, 64),
}
#: The README's tables' titles.
FOUNDRY_H100 = "H100 80GB BF16"
FOUNDRY_H100_SCALE = "H100 80GB BF16 (Large Scale, >= 128 GPUs)"
FOUNDRY_A100_80 = "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
FOUNDRY_A100_40 = "A100 40GB with 1600 Gbps node-node interconnect (RoCE)"
#: By title: device preset, memory (GB), bf16 PURE (the A100 40 GB table's runs gather and
#: reduce in bf16), inter-node network per node in Gb/s as the title states it (0: none).
_FOUNDRY_TABLES = {
    FOUNDRY_H100: ("h100", 80, False, 0),
    FOUNDRY_H100_SCALE: ("h100", 80, False, 0),
    FOUNDRY_A100_80: ("a100", 80, False, 1600),
    FOUNDRY_A100_40: ("a100-40gb", 40, True, 1600),
}


def foundry_run(
    table: str,
    size: str,
    seq: int,
    gpus: int,
    mfu: float,
    micro: int,
    accum: int,
    batch: int,
    tokens: float,
    ac: bool,
    params: int,
    *,
    source: str = _FOUNDRY_SOURCE,
    sharding: str = "FULL_SHARD",
    name: str = "",
    role: str = "validation",
    series: str = "",
) -> PublishedRun:
    """One row of llm-foundry's benchmark README (``source``, formatted with the table's
    title ``table``): its columns as the table lists them; ``sharding``: FSDP's strategy
    (``SHARD_GRAD_OP`` keeps the gathered parameters from forward to backward); ``name``
    (default: device, size, sequence and GPUs), ``role`` and ``series`` as
    :class:`PublishedRun`'s."""
    layers, d, heads = _MPT[size]
    dev, mem, pure, network = _FOUNDRY_TABLES[table]
    if gpus * micro * accum != batch:
        raise ValueError(f"MPT-{size} seq {seq}: {gpus} x {micro} x {accum} != {batch}")
    notes: tuple[str, ...] = (
        *_FOUNDRY_NOTES,
        f"learned positions of seq {seq} (NumParams {params:,} matches)",
        f"{network:,} Gb/s per node RoCE (source): {network / 64:g} GB/s per GPU"
        if network
        else "inter-node network not stated (preset 50 GB/s per GPU)",
    )
    if pure:
        notes += ("bf16 PURE: FSDP gathers and reduces in bf16 (fp32 sharded parameters kept)",)
    if sharding == "SHARD_GRAD_OP":
        notes += ("SHARD_GRAD_OP: parameters stay gathered from forward to backward",)
    elif sharding != "FULL_SHARD":
        raise ValueError(f"MPT-{size}: sharding strategy {sharding!r} is not modelled")
    if ac:  # the runs' images: scripts/train/benchmarking/h100new.md at beb8dee6
        notes += (
            (
                "torch 1.13 (bf16 PURE table, in the README since May 2023, before torch "
                "2.1): the non-reentrant checkpoint reruns the whole block"
            )
            if pure
            else (
                "image mosaicml/pytorch:2.1.0_cu121-nightly20230827 (h100new.md): the "
                "non-reentrant checkpoint stops its recompute early, before the MLP's output GEMM"
            ),
        )
    return PublishedRun(
        name=name or f"llm-foundry {dev} MPT-{size.upper()} seq {seq:,}, {gpus} GPUs",
        code_base=FOUNDRY,
        source=source.format(table=table),
        role=role,
        series=series,
        size=size.upper(),
        device=dev,
        memory_gib=mem,
        model=gpt(layers, heads, d, seq, vocab=50368, tied=True),
        layout=Layout(
            dp_shard=gpus,
            microbatches=accum,
            ac="full" if ac else "none",
            reshard_after_forward=sharding == "FULL_SHARD",
        ),
        work=Workload(seq, batch),
        metric="tokens",
        value=tokens,
        flops="mosaic",
        dp_flavour="FSDP",
        stated_mfu=mfu / 100,
        params=params,
        notes=notes,
        software=Software("llm-foundry", ac_early_stop=False if pure else None),
        node_network_gbps=network,
    )


def _fitting(table: str, size: str, *columns: Any, role: str = "validation") -> PublishedRun:
    """A row of issue 28's set: sequence 2,048, named by the table's GPU and memory;
    ``columns`` as :func:`foundry_run`'s after the sequence."""
    gpu = table[:9]  # "H100 80GB", "A100 80GB", "A100 40GB"
    name, series = f"llm-foundry {gpu} MPT-{size.upper()}", f"llm-foundry {gpu} seq 2048"
    return foundry_run(table, size, 2048, *columns, name=name, role=role, series=series)


_H, _A80, _A40 = FOUNDRY_H100, FOUNDRY_A100_80, FOUNDRY_A100_40
FOUNDRY_RUNS = (
    _fitting(_H, "1b", 64, 40.85, 20, 1, 1280, 44402, False, 1315950592),
    _fitting(_H, "3b", 64, 40.8, 6, 3, 1152, 22525, False, 2651837440),
    _fitting(_H, "7b", 8, 46.44, 6, 1, 48, 10643, False, 6658859008, role="calibration"),
    _fitting(_H, "13b", 64, 39.86, 2, 1, 128, 4800, False, 12853954560),
    _fitting(_H, "30b", 32, 43.92, 14, 3, 1344, 2308, True, 29975214080),
    _fitting(_H, "70b", 64, 42.57, 8, 4, 2048, 1039, True, 64862437376),
    _fitting(_A80, "1b", 8, 59.86, 14, 4, 448, 20513, False, 1315950592),
    _fitting(_A80, "3b", 8, 62.11, 10, 2, 160, 10811, False, 2651837440),
    _fitting(_A80, "7b", 8, 64.23, 6, 2, 96, 4641, False, 6658859008),
    _fitting(_A80, "13b", 8, 59.57, 2, 3, 48, 2262, False, 12853954560, role="calibration"),
    _fitting(_A80, "30b", 8, 55.3, 3, 21, 504, 916, True, 29975214080),
    _fitting(_A40, "7b", 128, 50.14, 18, 1, 2304, 3623, True, 6658859008),
    _fitting(_A40, "13b", 128, 51.93, 16, 1, 2048, 1972, True, 12853954560),
    _fitting(_A40, "30b", 128, 52.25, 6, 1, 768, 865, True, 29975214080),
    _fitting(_A40, "70b", 128, 48.91, 4, 1, 512, 376, True, 64862437376),
)

# --- torchtitan, Llama 3.1 on H100 (96 GB) -----------------------------------------------

_TITAN = (
    "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024), table {t}, "
    "as copied in shared/reference/published_runs.md"
)
_TITAN_NOTES = (
    "H100 96 GB HBM2e (500 W); seq 8,192 assumed (torchtitan's default)",
    "kernels: eager PyTorch, SDPA flash attention; selective AC = torchtitan's 'op' policy "
    "(saves attention and every second matmul: torchtitan parallelize_llama.py); TP "
    "collectives synchronous except the async TP rows",
)
_COMPILE = "torch.compile"
_FLOAT8 = "Float8"
_ASYNC_TP = "async TP"
_PP_DEFAULTS = (
    "microbatches and stages per rank not stated: torchtitan's defaults at the benchmark's "
    "commit 9dec370, 8 microbatches (pipelining_utils.build_pipeline_schedule: the pp "
    "degree, for every schedule; the option's help says the number of stages) and 2 stages "
    "per rank for interleaved schedules (generate_split_points)"
)


_TITAN_SPEED = (
    "torch.compile of the blocks (the loss was compiled from 2025-04 on) and Float8 as "
    "torchtitan's docs/float8.md at 9dec370 runs it: tensorwise, with Float8 all-gathers "
    "(assumed: the table names Float8 only), and under TP its inputs gathered in fp8 "
    "(Float8ColwiseParallel / PrepareFloat8ModuleInput in parallelize_llama.py at 9dec370); "
    "priced by the planner's compile and Float8 models, nothing fitted to these rows"
)


#: Grand Teton's network as torchtitan's benchmark pages state it: 400 Gb/s RDMA per GPU, 8
#: GPUs per host.
GRAND_TETON_NETWORK_GBPS = 8 * 400


def titan_software(tp: int, *, compiled: bool, float8: bool, async_tp: bool) -> Software:
    """What a torchtitan run of 2024-2025 does beside its layout (``tp``: its tensor
    parallelism): torch.compile of the blocks, Float8 as torchtitan's docs/float8.md runs
    it (tensorwise, Float8 all-gathers, under TP its inputs gathered in fp8) and async TP
    (:data:`_TITAN_SPEED`), each where the run turned it on."""
    return Software(
        "torchtitan",
        "micro-pipeline" if async_tp else "none",
        compiled=compiled,
        float8="tensorwise" if float8 else "none",
        float8_all_gather=float8,
        float8_tp_gather=float8 and tp > 1,
    )


def grand_teton_run(
    name: str,
    source: str,
    size: str,
    layout: Layout,
    work: Workload,
    tokens: float,
    software: Software,
    notes: tuple[str, ...],
    role: str = "validation",
    excluded: str = "",
    stated_mfu: float = 0.0,
    node_network_gbps: float = GRAND_TETON_NETWORK_GBPS,
) -> PublishedRun:
    """A torchtitan run of Llama 3 ``size`` on Meta's Grand Teton H100s (the ``h100-hbm2e``
    preset, 96 GB), under ``fully_shard``, published in tokens/s per GPU: what every
    torchtitan table of this project shares (this file's, the held-out and fresh sets');
    ``node_network_gbps``: 0 for a source that does not state the network."""
    return PublishedRun(
        name=name,
        code_base=TORCHTITAN,
        source=source,
        role=role,
        series="",
        size=size,
        device="h100-hbm2e",
        memory_gib=96,
        model=preset(f"llama3-{size.lower()}"),
        layout=layout,
        work=work,
        metric="tokens",
        value=tokens,
        flops="plait",
        dp_flavour="FSDP",
        stated_mfu=stated_mfu,
        notes=notes,
        excluded=excluded,
        software=software,
        node_network_gbps=node_network_gbps,
    )


def _titan(
    name: str,
    table: int,
    size: str,
    layout: Layout,
    work: Workload,
    tokens: float,
    speed: tuple[str, ...] = (),
    notes: tuple[str, ...] = (),
    role: str = "validation",
) -> PublishedRun:
    """A row of torchtitan's Dec 2024 table; ``speed``: which of torch.compile, Float8 and
    async TP it ran (all priced: :data:`_TITAN_SPEED`)."""
    software = titan_software(
        layout.tp, compiled=_COMPILE in speed, float8=_FLOAT8 in speed, async_tp=_ASYNC_TP in speed
    )
    return grand_teton_run(
        f"torchtitan {name}",
        _TITAN.format(t=table),
        size,
        layout,
        work,
        tokens,
        software,
        _TITAN_NOTES + ((_TITAN_SPEED,) if speed else ()) + notes,
        role,
    )


_FSDP8 = Layout(dp_shard=8, ac="selective")
_FSDP128 = Layout(dp_shard=128, ac="selective")
_FSDP_TP = Layout(dp_shard=32, tp=8, ac="full")
_PP_1F1B = Layout(dp_shard=8, tp=8, pp=8, schedule="1F1B", microbatches=8, ac="full")
_PP_INTERLEAVED = Layout(
    dp_shard=8,
    tp=8,
    pp=8,
    schedule="Interleaved1F1B",
    stages_per_rank=2,
    microbatches=8,
    ac="full",
)
_W8K16 = Workload(8192, 16)
_W8K256 = Workload(8192, 256)
TORCHTITAN_RUNS = (
    _titan(
        "T1 8B FSDP 8",
        1,
        "8B",
        _FSDP8,
        _W8K16,
        5762,
        notes=("selective AC keeps attention's output (plait's recomputes it)",),
        role="calibration",
    ),
    _titan("T1 8B FSDP 8 + compile", 1, "8B", _FSDP8, _W8K16, 6667, (_COMPILE,)),
    _titan("T1 8B FSDP 8 + compile + Float8", 1, "8B", _FSDP8, _W8K16, 8532, (_COMPILE, _FLOAT8)),
    _titan(
        "T2 8B FSDP 8, CP 1",
        2,
        "8B",
        Layout(dp_shard=8, ac="full"),
        Workload(32768, 8),
        3890,
        (_COMPILE, _FLOAT8),
        notes=("CP 1 of a CP run at seq 32k",),
    ),
    _titan("T3 8B FSDP 128", 3, "8B", _FSDP128, _W8K256, 5605),
    _titan("T3 8B FSDP 128 + compile", 3, "8B", _FSDP128, _W8K256, 6514, (_COMPILE,)),
    _titan(
        "T3 8B FSDP 128 + compile + Float8",
        3,
        "8B",
        _FSDP128,
        _W8K256,
        8380,
        (_COMPILE, _FLOAT8),
    ),
    _titan(
        "T4 70B FSDP 32 x TP 8",
        4,
        "70B",
        _FSDP_TP,
        Workload(8192, 512),
        829,
        (_COMPILE, _FLOAT8),
    ),
    _titan(
        "T4 70B FSDP 32 x TP 8 + async TP",
        4,
        "70B",
        _FSDP_TP,
        Workload(8192, 512),
        876,
        (_COMPILE, _FLOAT8, _ASYNC_TP),
    ),
    _titan(
        "T5 405B PP 8 x FSDP 8 x TP 8, 1F1B",
        5,
        "405B",
        _PP_1F1B,
        _W8K256,
        100,
        (_COMPILE, _FLOAT8, _ASYNC_TP),
        notes=(_PP_DEFAULTS,),
    ),
    _titan(
        "T5 405B PP 8 x FSDP 8 x TP 8, interleaved 1F1B",
        5,
        "405B",
        _PP_INTERLEAVED,
        _W8K256,
        128,
        (_COMPILE, _FLOAT8, _ASYNC_TP),
        notes=(_PP_DEFAULTS,),
    ),
)

# --- Llama 3 405B pre-training (Meta) ----------------------------------------------------

_LLAMA3 = "Llama 3 paper (arXiv 2407.21783), Table 4 and section 3.3.2"
_LLAMA3_NOTES = (
    "H100 80 GB (700 W), 400 Gb/s RoCE per GPU (section 3.3.1)",
    "FSDP without resharding after forward, no activation checkpointing at 8K, "
    "all-gather context parallelism, interleaved schedule (section 3.3.2)",
    "batch per DP rank from the table, micro-batch 1 assumed (not stated); 8 stages per rank, "
    "one block each, the first stage's first chunk the embedding alone and the last's last "
    "chunk the head alone ('one Transformer layer is reduced each from the first and the last "
    "stages ... the first model chunk on the first stage has only the embedding', section "
    "3.3.2: chunks of one block, 126 + 2 = 16 x 8; V is not stated otherwise): end_blocks 1; "
    "MFU is PaLM's (section 3.3.2): plait's count",
    "kernels and TP overlap not stated: plait's defaults (eager, synchronous TP), but the "
    "context-parallel all-gather moves K and V at their GQA size ('the communicated K and V "
    "tensors are much smaller than Q tensor due to the use of GQA', section 3.3.2): "
    "kv_repeated=False",
)


def _llama3(
    gpus: int,
    tp: int,
    cp: int,
    pp: int,
    seq: int,
    per_dp: int,
    tflops: float,
    mfu: float,
    excluded: str = "",
) -> PublishedRun:
    dp = gpus // (tp * cp * pp)
    layout = Layout(
        dp_shard=dp,
        cp=cp,
        tp=tp,
        pp=pp,
        schedule="Interleaved1F1B",
        stages_per_rank=8,
        end_blocks=1,
        microbatches=per_dp,
        ac="none",
        reshard_after_forward=False,
    )
    return PublishedRun(
        name=f"Llama 3 405B, {gpus:,} GPUs, seq {seq:,}",
        code_base=LLAMA3,
        source=_LLAMA3,
        role="validation",
        series="",
        size="405B",
        device="h100",
        memory_gib=80,
        model=preset("llama3-405b"),
        layout=layout,
        work=Workload(seq, per_dp * dp),
        metric="tflops",
        value=tflops,
        flops="plait",
        dp_flavour="FSDP",
        stated_mfu=mfu,
        notes=_LLAMA3_NOTES,
        software=Software(kv_repeated=False),
        excluded=excluded,
        node_network_gbps=8 * 400,  # 400 Gb/s RoCE per GPU (section 3.3.1)
    )


LLAMA3_RUNS = (
    _llama3(8192, 8, 1, 16, 8192, 32, 430, 0.43),
    _llama3(16384, 8, 1, 16, 8192, 16, 400, 0.41),
    _llama3(
        16384,
        8,
        16,
        16,
        131072,
        16,
        380,
        0.38,
        "Table 4 prints DP 4, but TP x CP x PP x DP = 8,192, not 16,384 GPUs, and 4 x 16 "
        "sequences of 131,072 are 8M tokens, not 16M: modelled with DP 8, not counted",
    ),
)

RUNS: tuple[PublishedRun, ...] = (
    *TORCHTITAN_RUNS,
    *MEGATRON_A100,
    *MEGATRON_H100,
    *FOUNDRY_RUNS,
    *LLAMA3_RUNS,
)
"""Every published run, grouped by source."""

CALIBRATION = tuple(r for r in RUNS if r.role == "calibration")
VALIDATION = tuple(r for r in RUNS if r.role == "validation")
