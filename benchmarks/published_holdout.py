"""Published runs held out from every fit: issue 38's validation set.

Rows that are not in :mod:`benchmarks.published_runs` (nothing here is a ``"calibration"``
row, and no constant of the cost model may be fitted to them), each a figure read in a
public source (a vendor benchmark recipe, a framework's performance table): NVIDIA's DGX
Cloud benchmarking recipes (NeMo on H100), Google Cloud's A3 Ultra recipe (NeMo on H200, listed
only), NeMo AutoModel (MoE on FSDP2), IBM's fms-fsdp,
torchtitan's 64-A100 table of 2024, llm-foundry's sequence-length and GPU-count rows not in
issue 28's set, and rows listed but not counted (FP8, ``torch.compile``, XLA, what the
planner does not model). Every row says its source and, in ``notes``, what it assumes where
the source is silent.

The evaluation is :mod:`benchmarks.plan_published`'s, row for row
(:func:`benchmarks.plan_published.published_table`, which knows each code base's activation
recipe)::

    .venv/bin/python -m benchmarks.published_holdout

prints a Markdown table (published and predicted tokens/s per GPU, their ratio, whether the
planner predicts the layout fits) and the summary over the counted rows (validation and
modelled): median and worst ``|predicted / published - 1|``, per code base, and how many
rows are predicted not to fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from benchmarks.plan_published import Row, published_table
from benchmarks.published_runs import (
    AUTOMODEL,
    FMS_FSDP,
    FOUNDRY_A100_40,
    FOUNDRY_A100_80,
    FOUNDRY_H100,
    MAXTEXT,
    NEMO,
    TORCHTITAN,
    PublishedRun,
    foundry_run,
    grand_teton_run,
    tokens_per_s,
)
from plait.plan.models import gpt, preset
from plait.plan.spec import Layout, ModelSpec, Software, Workload

__all__ = [
    "AUTOMODEL_RUNS",
    "EXCLUDED_RUNS",
    "FMS_RUNS",
    "FOUNDRY_HOLDOUT",
    "HOLDOUT",
    "NEMO_H200_RUNS",
    "NEMO_RUNS",
    "TITAN_A100_RUNS",
    "format_holdout",
    "holdout_table",
    "main",
]

_FP8 = "FP8"
_COMPILE = "torch.compile"


def _llama(name: str, layers: int, d: int, heads: int, kv: int, ffn: int) -> ModelSpec:
    """A Llama 2 shape (vocabulary 32,000, SwiGLU, untied)."""
    return ModelSpec(name, layers, d, heads, kv, ffn, 32000, gated=True, tied=False)


_LLAMA2_7B = _llama("llama2-7b", 32, 4096, 32, 32, 11008)
_LLAMA2_13B = _llama("llama2-13b", 40, 5120, 40, 40, 13824)
_LLAMA2_34B = _llama("codellama-34b", 48, 8192, 64, 8, 22016)
_LLAMA2_70B = _llama("llama2-70b", 80, 8192, 64, 8, 28672)


# --- NeMo on H100, BF16: NVIDIA DGX Cloud benchmarking recipes ---------------------------

_DGXC = (
    "NVIDIA/dgxc-benchmarking {path} at 143b90d (v25.01, May 2025), table '{table}' "
    "(tokens/s of the whole job; per GPU = tokens/s / GPUs)"
)
_NEMO_NOTES = (
    "NeMo launcher (Megatron-Core + Transformer Engine), bf16, DGX H100 (8 x 400 Gb/s "
    "per node assumed: the recipes do not state the fabric)",
    "Apex distributed_fused_adam (optimizer state sharded over DP, overlap_grad_sync and "
    "overlap_param_sync true in the recipes' configs): modelled as ZeRO-1 with the "
    "parameter all-gather overlapped; gradients reduced in bf16 (grad_sync_dtype: bf16 "
    "in the 24.11 configs; assumed for the 24.09 Llama configs)",
    "context parallelism: Transformer Engine's ring (p2p) attention, cp_method ring",
)


def _nemo(
    name: str,
    path: str,
    table: str,
    model: ModelSpec,
    gpus: int,
    seq: int,
    batch: int,
    tp: int,
    pp: int,
    vp: int,
    cp: int,
    ga: int,
    job_tokens: float,
    mfu: float,
    ac: str = "none",
    tp_overlap: bool = True,
    notes: tuple[str, ...] = (),
    excluded: str = "",
    optimizer_states: str = "fp32",
) -> PublishedRun:
    dp = gpus // (tp * pp * cp)
    if dp * ga * (batch // (dp * ga)) != batch:
        raise ValueError(f"{name}: GBS {batch} is not DP {dp} x GA {ga} x MBS")
    layout = Layout(
        dp_replicate=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        cp_method="ring",
        schedule="Interleaved1F1B" if vp > 1 else "1F1B",
        stages_per_rank=vp,
        microbatches=ga,
        ac=ac,
    )
    return PublishedRun(
        name=f"NeMo H100 {name}",
        code_base=NEMO,
        source=_DGXC.format(path=path, table=table),
        role="validation",
        series="",
        size=name.split(",")[0],
        device="h100",
        memory_gib=80,
        model=model,
        layout=layout,
        work=Workload(seq, batch),
        metric="tokens",
        value=job_tokens / gpus,
        flops="megatron-core",
        dp_flavour="ZeRO-1",
        stated_mfu=mfu,
        zero=1,
        notes=_NEMO_NOTES + notes,
        excluded=excluded,
        software=Software(
            "megatron-core",
            "async" if tp_overlap and tp > 1 else "none",
            param_gather_overlap=True,
            grad_reduce_fp32=False,
            optimizer_states=optimizer_states,
        ),
    )


_L31 = "llama3.1/README_{}.md"
_L31_TABLE = "Llama 3.1 {} 24.09 BF16 ({})"
_L31_NOTES = (
    "no activation recomputation, sequence parallelism, TP communication overlap "
    "(NVIDIA/NeMo-Framework-Launcher conf/training/llama/llama3_1_70b.yaml: "
    "activations_checkpoint_* null, ub_tp_comm_overlap true); the 8B's the same assumed",
)
_DFA_REMAINDERS = (
    "optimizer states (memory): the recipe's yaml (optim: distributed_fused_adam, no dtype, "
    "grad_sync_dtype bf16, contiguous_grad_buffer true; megatron_amp_O2 true) makes NeMo 2.0 "
    "(nemo/collections/nlp/models/language_modeling/megatron_base_model.py, "
    "setup_optimization at v2.0.0 and v2.1.0: an fp32 optimizer over a bf16 model) run apex's "
    "DistributedFusedAdam with store_params False and store_param_remainders True: fp32 "
    "moments and 16-bit remainders of the master weights, sharded over DP x CP; the bf16 "
    "contiguous grad buffer whole (optimizer_states 'remainders', grads in bf16)"
)
_405B_PROXY = dataclasses.replace(preset("llama3-405b"), name="llama3-405b-gpt2-vocab", vocab=51200)
_NEMOTRON_15B = ModelSpec("nemotron4-15b", 32, 6144, 48, 8, 24576, 256000, gated=False, tied=False)
_NEMOTRON_340B = ModelSpec(
    "nemotron4-340b", 96, 18432, 96, 8, 73728, 256000, gated=False, tied=False
)
_NEMOTRON_NOTES = (
    "Nemotron-4 shape from the recipe's yaml (nemotron/nemotron4-*-synth.yaml): squared-ReLU "
    "MLP (priced as a plain 2-matrix MLP), LayerNorm1p, no biases, GQA 8 groups, RoPE, "
    "vocabulary 256,000 untied, synthetic data",
)
_GPT3_175B = gpt(96, 96, 12288, 2048, vocab=50688, tied=True)

NEMO_RUNS = (
    _nemo(
        "Llama 3.1 8B, 8 GPUs",
        _L31.format("8b"),
        _L31_TABLE.format("8b", "TP=1, PP=1, CP=2, MBS=1, GA=32"),
        preset("llama3-8b"),
        8,
        8192,
        128,
        1,
        1,
        1,
        2,
        32,
        81222,
        0.5937,
        optimizer_states="remainders",
        notes=(*_L31_NOTES, _DFA_REMAINDERS),
    ),
    _nemo(
        "Llama 3.1 8B, 128 GPUs",
        _L31.format("8b"),
        _L31_TABLE.format("8b", "TP=1, PP=1, CP=2, MBS=1, GA=32"),
        preset("llama3-8b"),
        128,
        8192,
        2048,
        1,
        1,
        1,
        2,
        32,
        1280704,
        0.5851,
        optimizer_states="remainders",
        notes=(*_L31_NOTES, _DFA_REMAINDERS),
    ),
    _nemo(
        "Llama 3.1 70B, 64 GPUs",
        _L31.format("70b"),
        _L31_TABLE.format("70b", "TP=4, PP=4, CP=2, VP=5, MBS=1, GA=64"),
        preset("llama3-70b"),
        64,
        8192,
        128,
        4,
        4,
        5,
        2,
        64,
        71235,
        0.5410,
        optimizer_states="remainders",
        notes=(*_L31_NOTES, _DFA_REMAINDERS),
    ),
    _nemo(
        "Llama 3.1 70B, 1,024 GPUs",
        _L31.format("70b"),
        _L31_TABLE.format("70b", "TP=4, PP=4, CP=2, VP=5, MBS=1, GA=64"),
        preset("llama3-70b"),
        1024,
        8192,
        2048,
        4,
        4,
        5,
        2,
        64,
        1124478,
        0.5338,
        optimizer_states="remainders",
        notes=(*_L31_NOTES, _DFA_REMAINDERS),
    ),
    _nemo(
        "Llama 3.1 405B, 576 GPUs",
        _L31.format("405b"),
        _L31_TABLE.format("405b", "TP=8, PP=9, CP=2, VP=7, MBS=1, GA=63"),
        _405B_PROXY,
        576,
        8192,
        252,
        8,
        9,
        7,
        2,
        63,
        120022,
        0.5578,
        optimizer_states="remainders",
        notes=(*_L31_NOTES, _DFA_REMAINDERS)
        + (
            "the recipe trains on synthetic data with the GPT2BPETokenizer as a proxy "
            "(README): vocabulary 50,257 padded to 51,200 (128 x TP 8) assumed",
        ),
    ),
    _nemo(
        "Llama 3.1 405B, 2,304 GPUs",
        _L31.format("405b"),
        _L31_TABLE.format("405b", "TP=8, PP=9, CP=2, VP=7, MBS=1, GA=63"),
        _405B_PROXY,
        2304,
        8192,
        1008,
        8,
        9,
        7,
        2,
        63,
        468646,
        0.5445,
        optimizer_states="remainders",
        notes=(*_L31_NOTES, _DFA_REMAINDERS)
        + (
            "the recipe trains on synthetic data with the GPT2BPETokenizer as a proxy "
            "(README): vocabulary 50,257 padded to 51,200 (128 x TP 8) assumed",
        ),
    ),
    _nemo(
        "Nemotron-4 15B, 16 GPUs",
        "nemotron/README_15b.md",
        "Nemotron4 15b 24.11 BF16 (TP=4, PP=1, MBS=4, GA=4)",
        _NEMOTRON_15B,
        16,
        4096,
        64,
        4,
        1,
        1,
        1,
        4,
        92630,
        0.6210,
        optimizer_states="remainders",
        notes=(
            *_NEMOTRON_NOTES,
            "no recomputation, sequence parallelism, ub_tp_comm_overlap true (yaml)",
            _DFA_REMAINDERS,
        ),
    ),
    _nemo(
        "Nemotron-4 15B, 2,048 GPUs",
        "nemotron/README_15b.md",
        "Nemotron4 15b 24.11 BF16 (TP=4, PP=1, MBS=4, GA=4)",
        _NEMOTRON_15B,
        2048,
        4096,
        8192,
        4,
        1,
        1,
        1,
        4,
        11335957,
        0.5937,
        optimizer_states="remainders",
        notes=(
            *_NEMOTRON_NOTES,
            "no recomputation, sequence parallelism, ub_tp_comm_overlap true (yaml)",
            _DFA_REMAINDERS,
        ),
    ),
    _nemo(
        "Nemotron-4 340B, 128 GPUs",
        "nemotron/README_340b.md",
        "Nemotron4 340b 24.11 BF16 (TP=8, PP=8, MBS=1, GA=16, VP=12)",
        _NEMOTRON_340B,
        128,
        4096,
        32,
        8,
        8,
        12,
        1,
        16,
        28432,
        0.5538,
        ac="selective",
        tp_overlap=False,
        optimizer_states="bf16",
        notes=(
            *_NEMOTRON_NOTES,
            "activations_checkpoint_granularity: selective (Megatron's: core attention "
            "recomputed), ub_tp_comm_overlap False (yaml)",
            "optimizer states (memory): the yaml's optim (distributed_fused_adam, dtype bf16, "
            "grad_sync_dtype bf16, contiguous_grad_buffer True; megatron_amp_O2 true) makes "
            "NeMo (megatron_base_model.py setup_optimization at v2.0.0 and v2.1.0: optimizer "
            "dtype equal to the model's) run apex's DistributedFusedAdam with bf16 moments "
            "and store_params False: no master weights (optimizer_states 'bf16', grads in "
            "bf16)",
        ),
    ),
    _nemo(
        "GPT-3 175B, 128 GPUs",
        "nemo_megatron/README_175b.md",
        "NeMo Megatron 24.11 BF16 (TP=4,PP=8, MBS=1, VP=12, SEQ=2048)",
        _GPT3_175B,
        128,
        2048,
        256,
        4,
        8,
        12,
        1,
        64,
        58843,
        0.4993,
        notes=(
            "GPT-3 175B from nemo_megatron/gpt3_175b_hydra.yaml: 96 layers, hidden 12,288, "
            "FFN 49,152; GELU, biases, learned positions and tied embeddings (NeMo GPT "
            "defaults, not in the yaml); GPT2BPE vocabulary padded to 50,688 (128 x TP 4)",
            "no recomputation, sequence parallelism, ub_tp_comm_overlap true, "
            "grad_sync_dtype bf16 (yaml)",
            _DFA_REMAINDERS,
        ),
        optimizer_states="remainders",
    ),
    _nemo(
        "Grok-1 314B (MoE), 512 GPUs",
        "grok1/README_314b.md",
        "Grok 1 314b Dev BF16",
        ModelSpec(
            "grok-1",
            64,
            6144,
            48,
            8,
            32768,
            131072,
            gated=True,
            tied=False,
            experts=8,
            top_k=2,
            expert_hidden=32768,
        ),
        512,
        8192,
        1024,
        4,
        8,
        8,
        2,
        128,
        402718,
        0.415,
        tp_overlap=False,
        notes=(
            "TP 4, PP 8, CP 2, EP 8, VP 8, MBS 1, GBS 1,024, GA 128 (README's config table: "
            "its DP 1 excludes the 8 EP ranks, which Megatron takes from DP x CP)",
            "grok1_314b.yaml: 8 experts top-2 (GeGLU), mcore distributed optimizer, "
            "alltoall dispatcher padded to capacity factor 1.0, no recomputation; "
            "vocabulary 131,072 assumed (not in the yaml)",
            "listed with ep 1 (DP 8 as ZeRO-1): the prediction is not of the run",
        ),
        excluded=(
            "expert parallelism beside Megatron's distributed optimizer (the planner takes "
            "ep from dp_shard, and its ZeRO-1 layout has ep 1); experts padded to capacity"
        ),
    ),
)

# --- NeMo on H200 (Google Cloud A3 Ultra), BF16: AI-Hypercomputer/gpu-recipes -------------
#
# The only BF16, non-compiled H200 training figure with its layout that issue 38's search
# found: every NVIDIA performance table (dgxc-benchmarking, NeMo and Megatron-Bridge
# performance summaries, NeMo AutoModel) lists DGX-H100, B200 and GB200 but no H200, and the
# other A3 Ultra recipes' example figures are FP8 (Llama 3.1 70B, 405B) or MaxText (XLA).

_A3U = (
    "AI-Hypercomputer/gpu-recipes training/a3ultra/mixtral_8x7b/nemo-gke/nemo2407/recipe/"
    "README.md at 2e1fd5ef (2026-08-12), the README's example DLLogger entry (step 26, "
    "'train_step_timing in s': 2.7396, consumed_samples 27,648); config src/frameworks/"
    "a3ultra/nemo-configs/mixtral-8x7b-256gpus-a3u-bf16.yaml (tokens/s per GPU = GBS x seq "
    "/ (step time x GPUs))"
)

NEMO_H200_RUNS = (
    PublishedRun(
        name="NeMo H200 Mixtral 8x7B (MoE), 256 GPUs (A3 Ultra)",
        code_base=NEMO,
        source=_A3U,
        role="validation",
        series="",
        size="8x7B",
        device="h200",
        memory_gib=141,
        model=ModelSpec(
            "mixtral-8x7b-gpt2-vocab",
            32,
            4096,
            32,
            8,
            14336,
            50304,
            gated=True,
            tied=False,
            experts=8,
            top_k=2,
            expert_hidden=14336,
        ),
        layout=Layout(dp_replicate=256, microbatches=2, ac="none"),
        work=Workload(4096, 1024),
        metric="tokens",
        value=1024 * 4096 / (2.7396187782287598 * 256),
        flops="megatron-core",
        dp_flavour="ZeRO-1",
        zero=1,
        notes=(
            "NeMo 24.07 (NeMo 1.0 launcher, mcore GPT, Transformer Engine, flash attention), "
            "bf16 (fp8 false), 32 a3-ultragpu-8g nodes = 256 H200 141 GB, 8 x 400 Gb/s "
            "ConnectX-7 RoCE per node (A3 Ultra); the README's default run is 32 nodes, GBS "
            "1,024, and its metrics command for the example log names 256 accelerators "
            "(the 512-GPU variant is not assumed)",
            "config: TP 1, PP 1, EP 8, MBS 2, GBS 1,024 (GA 2 over DP 256), seq 4,096; "
            "Mixtral shape (32 layers, hidden 4,096, FFN 14,336, 32 heads, 8 query groups, "
            "8 experts top-2, SwiGLU, RMSNorm, RoPE, untied); GPT2BPETokenizer (mock data): "
            "vocabulary 50,257 padded to 50,304 (128 x TP 1) assumed",
            "no recomputation, no sequence parallelism, alltoall dispatcher, experts padded "
            "to capacity factor 1.0, moe_grouped_gemm false (sequential expert GEMMs)",
            "mcore_distributed_optim, grad_sync_dtype bf16, overlap_grad_sync and "
            "overlap_param_sync true (config); the example entry is one step (step 26 of 30), "
            "not an average over steps",
            "listed with ep 1 (DP 256 as ZeRO-1): the prediction is not of the run",
        ),
        excluded=(
            "expert parallelism beside Megatron's distributed optimizer (the planner takes "
            "ep from dp_shard, and its ZeRO-1 layout has ep 1); experts padded to capacity"
        ),
        software=Software(
            "megatron-core", "none", param_gather_overlap=True, grad_reduce_fp32=False
        ),
        node_network_gbps=8 * 400,  # 8 x 400 Gb/s ConnectX-7 RoCE per node (A3 Ultra)
    ),
)

# --- NeMo AutoModel (FSDP2 + expert parallelism) on H100, BF16 ---------------------------

AUTOMODEL_RUNS = (
    PublishedRun(
        name="NeMo AutoModel H100 Qwen3-30B-A3B (MoE), 8 GPUs",
        code_base=AUTOMODEL,
        source=(
            "NVIDIA-NeMo/Automodel docs/performance-summary.md at 01926a5c (updated "
            "2025-10-02), 'Pre-Training Performance, DGX-H100, BF16', row 'Qwen3 MoE 30B'; "
            "config examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml"
        ),
        role="validation",
        series="",
        size="30B-A3B",
        device="h100",
        memory_gib=80,
        model=preset("qwen3-30b-a3b"),
        layout=Layout(dp_shard=8, ep=8, microbatches=16, ac="full"),
        work=Workload(4096, 512),
        metric="tokens",
        value=12040,
        flops="plait",
        dp_flavour="FSDP",
        stated_mfu=277 / 989,
        notes=(
            "FSDP2 8 x EP 8, local batch 4, GA 16, seq 4,096 (table); activation "
            "checkpointing true (config: full blocks assumed), no torch.compile in the config",
            "TE attention, linear and RMSNorm, DeepEP dispatch, balanced fake gate "
            "(table's notes): kernels priced as the megatron-core stack (TE); the rest of "
            "the block (SwiGLU, rope, residuals) is eager PyTorch, which that stack "
            "prices fused",
            "reductions in fp32 assumed (FSDP2 defaults; not stated)",
            "memory: weights in bf16 (components/models/qwen3_moe/model.py at 01926a5c builds "
            "and initializes the model in config.torch_dtype, bfloat16, and apply_fsdp's "
            "MixedPrecisionPolicy casts nothing up), so FSDP2's shards, their gradients and "
            "torch.optim.Adam's moments (the config's optimizer; torch keeps them in the "
            "parameter's dtype) are bf16, no fp32 master (optimizer_states 'bf16'); the loss "
            "is MaskedCrossEntropy with fp32_upcast: false (config; components/loss/"
            "masked_ce.py: cross_entropy on the bf16 logits; loss_upcast False)",
        ),
        software=Software("megatron-core", optimizer_states="bf16", loss_upcast=False),
    ),
)

# --- fms-fsdp (IBM), Llama 2 shapes on 128 A100 and 96 H100 ------------------------------

_FMS = (
    "foundation-model-stack/fms-fsdp README.md at 4ffb9bd (Mar 2024), table 'Training "
    "throughput benchmarks' (the eager table, before 'update numbers with compile')"
)
_FMS_NOTES = (
    "FSDP (torch>=2.1, FSDP1) with MixedPrecision bf16 parameters, reductions and buffers "
    "(fms_fsdp/policies/mixed_precision.py bfSixteen), SDPA flash attention, no "
    "torch.compile (use_torch_compile False in the scripts of the time)",
    "seq 4,096 (train_config default, 'a 4k context length'); batch size per GPU, no "
    "gradient accumulation (the trainer has none)",
    "Full AC: non-reentrant checkpoint_wrapper on every block (selective_checkpointing=1)",
)


def _fms(
    size: str,
    model: ModelSpec,
    gpu: str,
    hsdp: bool,
    ac: str,
    tokens: float,
    mfu: float,
    excluded: str = "",
) -> PublishedRun:
    gpus, dev, network = {"A100": (128, "a100", 400), "H100": (96, "h100", 800)}[gpu]
    layout = Layout(
        dp_replicate=gpus // 8 if hsdp else 1,
        dp_shard=8 if hsdp else gpus,
        ac=ac,
    )
    return PublishedRun(
        name=f"fms-fsdp {gpu} Llama2-shape {size}",
        code_base=FMS_FSDP,
        source=_FMS,
        role="validation",
        series=f"fms-fsdp {gpu}",
        size=size,
        device=dev,
        memory_gib=80,
        model=model,
        layout=layout,
        work=Workload(4096, 2 * gpus),
        metric="tokens",
        value=tokens,
        flops="plait",
        dp_flavour="HSDP" if hsdp else "FSDP",
        stated_mfu=mfu,
        notes=(
            *_FMS_NOTES,
            f"{gpu} 80G, {network} Gbps (source), read per node (800 Gb/s per H100 would "
            "take two 400 Gb/s NICs per GPU, which no 2024 H100 node had; llm-foundry's "
            f"tables state theirs per node too): {network / 64:.4g} GB/s per GPU",
            "MFU as stated (nanoGPT / PaLM count, 989 / 312 TFLOP/s peaks)",
        ),
        excluded=excluded,
        software=Software("torchtitan", grad_reduce_fp32=False),
        node_network_gbps=network,
    )


_FMS_SELECTIVE = (
    "fms-fsdp's 'Selective AC' checkpoints every k-th block (selective_checkpointing, k "
    "not stated); the planner's selective is per-op"
)
FMS_RUNS = (
    _fms("7B", _LLAMA2_7B, "A100", True, "none", 3700, 0.57),
    _fms("13B", _LLAMA2_13B, "A100", False, "selective", 1800, 0.51, _FMS_SELECTIVE),
    _fms("34B", _LLAMA2_34B, "A100", False, "full", 700, 0.47),
    _fms("70B", _LLAMA2_70B, "A100", False, "full", 370, 0.50),
    _fms("7B", _LLAMA2_7B, "H100", True, "none", 7500, 0.37),
    _fms("13B", _LLAMA2_13B, "H100", False, "selective", 3800, 0.35, _FMS_SELECTIVE),
    _fms("34B", _LLAMA2_34B, "H100", False, "full", 1550, 0.32),
    _fms("70B", _LLAMA2_70B, "H100", False, "full", 800, 0.34),
)

# --- torchtitan on 64 A100 80GB (2024) ---------------------------------------------------

_TITAN_A100 = (
    "pytorch/torchtitan docs/performance.md at 1ea476e9 (Apr 2024), table '{t}' (64 A100 "
    "80GB, FSDP2)"
)
_TITAN_A100_NOTES = (
    "train_configs of the same commit: compile false, seq 8,192 (Llama 3) / 4,096 (Llama 2); "
    "bf16 parameters, fp32 reductions (torchtitan's defaults)",
    "8B and 13B configs use norm_type fused_rmsnorm (a Triton RMSNorm), priced as eager",
    "A100 interconnect not stated (preset 25 GB/s per GPU)",
)
_LAYER_AC = (
    "'selective layer' checkpoints every second block (selective_ac_option '2'); the "
    "planner's selective is per-op"
)


def _titan_a100(
    table: str,
    size: str,
    model: ModelSpec,
    seq: int,
    local: int,
    ac: str,
    tokens: float,
    mfu: float,
    excluded: str = "",
) -> PublishedRun:
    return PublishedRun(
        name=f"torchtitan A100 {size}, local batch {local}, AC {ac}"
        + (" (layer)" if excluded else ""),
        code_base=TORCHTITAN,
        source=_TITAN_A100.format(t=table),
        role="validation",
        series="",
        size=size,
        device="a100",
        memory_gib=80,
        model=model,
        layout=Layout(dp_shard=64, ac=ac),
        work=Workload(seq, 64 * local),
        metric="tokens",
        value=tokens,
        flops="plait",
        dp_flavour="FSDP",
        stated_mfu=mfu,
        notes=_TITAN_A100_NOTES,
        excluded=excluded,
        software=Software("torchtitan"),
    )


_L3 = "Llama 3 performance numbers"
_L2 = "Llama 2 performance numbers"
TITAN_A100_RUNS = (
    _titan_a100(
        _L3, "Llama 3 8B", preset("llama3-8b"), 8192, 1, "selective", 2904, 0.568, _LAYER_AC
    ),
    _titan_a100(_L3, "Llama 3 8B", preset("llama3-8b"), 8192, 1, "selective", 2973, 0.582),
    _titan_a100(_L3, "Llama 3 70B", preset("llama3-70b"), 8192, 1, "full", 331, 0.517),
    _titan_a100(_L2, "Llama 2 13B", _LLAMA2_13B, 4096, 2, "none", 2162, 0.611),
    _titan_a100(_L2, "Llama 2 13B", _LLAMA2_13B, 4096, 2, "selective", 1914, 0.541, _LAYER_AC),
    _titan_a100(_L2, "Llama 2 13B", _LLAMA2_13B, 4096, 2, "selective", 1904, 0.538),
    _titan_a100(_L2, "Llama 2 70B", _LLAMA2_70B, 4096, 1, "selective", 355, 0.508),
    _titan_a100(_L2, "Llama 2 70B", _LLAMA2_70B, 4096, 2, "full", 353, 0.505),
)

# --- llm-foundry: rows of the same README not in issue 28's set --------------------------

_H, _A80, _A40 = FOUNDRY_H100, FOUNDRY_A100_80, FOUNDRY_A100_40
FOUNDRY_HOLDOUT = (
    foundry_run(_H, "7b", 8192, 8, 37.14, 8, 2, 128, 6935, True, 6684024832),
    foundry_run(_H, "13b", 4096, 8, 41.6, 10, 3, 240, 4717, True, 12864440320),
    foundry_run(_H, "3b", 8192, 8, 40.31, 3, 6, 144, 16578, False, 2667566080),
    foundry_run(_H, "1b", 32768, 8, 33.54, 1, 4, 32, 12025, False, 1378865152),
    foundry_run(_H, "30b", 8192, 8, 29.92, 1, 21, 168, 1384, True, 30019254272),
    foundry_run(_H, "70b", 2048, 32, 36.15, 2, 16, 1024, 882, True, 64862437376),
    foundry_run(_A80, "7b", 8192, 8, 54.47, 8, 2, 128, 3206, True, 6684024832),
    foundry_run(_A80, "3b", 8192, 8, 59.34, 3, 6, 144, 7695, False, 2667566080),
    foundry_run(_A80, "13b", 32768, 8, 51.69, 1, 3, 24, 1016, True, 13011240960),
    foundry_run(_A40, "7b", 8192, 8, 49.04, 3, 4, 96, 2887, True, 6684024832),
)

# --- torch.compile / Float8 runs (counted since the planner prices both), and listed, not
# counted: what the planner does not model (MaxText) -------------------------------------

_TRAINY = (
    "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (Jun 2025), "
    "table 'Results'"
)
_MAXTEXT = (
    "NVIDIA/dgxc-benchmarking maxtext/README_70b.md at 143b90d (v25.01), table 'Maxtext "
    "LLama2 70b BF16 (FSDP+DP MBS=2)' (tokens/s of the whole job; per GPU = / GPUs); "
    "config maxtext/configure.sh"
)
_MAXTEXT_NOTES = (
    "JAX / XLA, attention=cudnn_flash_te, scan_layers, seq 4,096 (max_target_length), "
    "per-device batch 2 (configure.sh)",
    "bf16 remat_policy custom: q/k/v/out projections and the MLP's output projection "
    "saved, the rest recomputed (configure.sh)",
)


def _trainy(nodes: int, tokens: float) -> PublishedRun:
    gpus = 8 * nodes
    return PublishedRun(
        name=f"torchtitan H200 Llama 3.1 8B, {gpus} GPUs (Trainy)",
        code_base=TORCHTITAN,
        source=_TRAINY,
        role="validation",
        series="",
        size="8B",
        device="h200",
        memory_gib=141,
        model=preset("llama3-8b"),
        layout=Layout(dp_shard=gpus, ac="selective"),
        work=Workload(8192, 2 * gpus),
        metric="tokens",
        value=tokens,
        flops="plait",
        dp_flavour="FSDP",
        notes=(
            "llama3_8b.toml (seq 8,192, selective op AC: the config's defaults assumed), "
            "local batch 2; 400 Gb/s per GPU (source)",
            f"{_COMPILE} and Float8 (tensorwise, with Float8 all-gathers) as the source "
            "ran them: priced by the planner's compile and float8 models (Software "
            "compiled, float8, float8_all_gather), nothing fitted to this row",
            "the loss compiled with the blocks (torchtitan e7c0cae, "
            "components/loss.py build_cross_entropy_loss: compiled under training.compile "
            "since bbb1b616, 2025-04-02): Software compiled_loss",
        ),
        software=Software(
            "torchtitan",
            compiled=True,
            float8="tensorwise",
            float8_all_gather=True,
            compiled_loss=True,
        ),
        node_network_gbps=8 * 400,  # 400 Gb/s per GPU (source)
    )


def _maxtext(gpus: int, fsdp: int, job_tokens: float, mfu: float) -> PublishedRun:
    return PublishedRun(
        name=f"MaxText H100 Llama 2 70B, {gpus} GPUs",
        code_base=MAXTEXT,
        source=_MAXTEXT,
        role="validation",
        series="",
        size="70B",
        device="h100",
        memory_gib=80,
        model=_LLAMA2_70B,
        layout=Layout(dp_replicate=gpus // fsdp, dp_shard=fsdp, ac="selective"),
        work=Workload(4096, 2 * gpus),
        metric="tokens",
        value=job_tokens / gpus,
        flops="megatron-core",
        dp_flavour="FSDP",
        stated_mfu=mfu,
        notes=_MAXTEXT_NOTES,
        excluded="XLA-compiled (fused kernels, as torch.compile); a custom remat policy",
    )


EXCLUDED_RUNS = (
    _trainy(4, 10938),
    _trainy(8, 10753),
    _maxtext(64, 64, 74908.99, 0.5259),
    _maxtext(512, 128, 591496.83, 0.5190),
    grand_teton_run(
        "torchtitan H100 Llama 3.1 405B, 128 GPUs, FSDP 16 x TP 8",
        (
            "pytorch/torchtitan docs/performance.md at 3faaa1a0 (Aug 2024), table 'Llama 3.1 "
            "performance numbers', row 'Optimizations: None'"
        ),
        "405B",
        Layout(dp_shard=16, tp=8, ac="full"),
        Workload(8192, 32),
        109,
        Software("torchtitan", compiled=True),
        stated_mfu=0.29,
        notes=(
            "H100 95 GB HBM2e at a lower TDP (source's footnote); local batch 2, global 32, "
            "seq 8,192, full AC (source / train_configs/llama3_405b.toml)",
            "torch.compile taken as on (the 405B preset of the time sets compile = true and "
            "the row's 'None' names only Float8 and async TP as absent): priced by the "
            "planner's compile model; no Float8, no async TP",
            "network not stated in this source (the h100-hbm2e preset's 50 GB/s per GPU)",
        ),
        node_network_gbps=0,
    ),
)

HOLDOUT: tuple[PublishedRun, ...] = (
    *NEMO_RUNS,
    *NEMO_H200_RUNS,
    *AUTOMODEL_RUNS,
    *FMS_RUNS,
    *TITAN_A100_RUNS,
    *FOUNDRY_HOLDOUT,
    *EXCLUDED_RUNS,
)
"""Every held-out run: all ``"validation"``, none fitted to."""


# --- evaluation --------------------------------------------------------------------------


def holdout_table(runs: tuple[PublishedRun, ...] = HOLDOUT) -> list[Row]:
    """The planner's prediction of each run, as :func:`plan_published.published_table`."""
    return published_table(runs)


def _layout(run: PublishedRun) -> str:
    lay = run.layout
    parts = [
        f"{name} {getattr(lay, name)}"
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
        if getattr(lay, name) > 1
    ]
    if lay.pp > 1 and lay.stages_per_rank > 1:
        parts.append(f"vp {lay.stages_per_rank}")
    if run.zero:
        parts.append(f"ZeRO-{run.zero}")
    parts.append(f"mb {lay.microbatches}")
    parts.append(f"ac {lay.ac}")
    return ", ".join(parts)


def _error_stats(rows: list[Row]) -> str:
    errors = [abs(r.ratio - 1) for r in rows]
    worst = max(rows, key=lambda r: abs(r.ratio - 1))
    return (
        f"{len(rows)} | {statistics.median(errors):.2f} | {max(errors):.2f} "
        f"({worst.run.name}, ratio {worst.ratio:.2f})"
    )


def format_holdout(rows: list[Row]) -> str:
    """The table, its summary and its sources as Markdown (no trailing newline)."""
    sources: list[str] = []
    for r in rows:
        if r.run.source not in sources:
            sources.append(r.run.source)
    lines = [
        "| # | run | code base | device | GPUs | layout | seq x GBS | published tok/s/GPU "
        "| predicted | ratio | fits? | source | counted |",
        "|---|---|---|---|---:|---|---|---:|---:|---:|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        run = r.run
        counted = "yes" if r.counted else f"no: {run.excluded}"
        fits = "yes" if r.fits else f"no ({r.memory_gib:.0f} GiB)"
        lines.append(
            f"| {i} | {run.name} | {run.code_base} | {run.device} {run.memory_gib:.0f} GB "
            f"| {run.gpus:,} | {_layout(run)} | {run.work.seq_len:,} x "
            f"{run.work.global_batch:,} | {tokens_per_s(run):,.0f} | {r.tokens_per_s:,.0f} "
            f"| {r.ratio:.2f} | {fits} | [{sources.index(run.source) + 1}] | {counted} |"
        )
    counted_rows = [r for r in rows if r.counted]
    lines += [
        "",
        "| counted rows | n | median abs(pred/pub - 1) | worst |",
        "|---|---:|---:|---|",
        f"| all | {_error_stats(counted_rows)} |",
    ]
    for base in sorted({r.run.code_base for r in counted_rows}):
        lines.append(
            f"| {base} | {_error_stats([r for r in counted_rows if r.run.code_base == base])} |"
        )
    for dev in sorted({r.run.device for r in counted_rows}):
        lines.append(
            f"| device {dev} | {_error_stats([r for r in counted_rows if r.run.device == dev])} |"
        )
    not_fit = [r for r in counted_rows if not r.fits]
    over = sum(r.ratio > 1 for r in counted_rows)
    lines += [
        "",
        f"Counted rows: {len(counted_rows)} of {len(rows)} (the others are listed, not "
        f"counted); over-predicted: {over}, under-predicted: {len(counted_rows) - over}; "
        f"predicted not to fit: {len(not_fit)}"
        + (f" ({', '.join(r.run.name for r in not_fit)})" if not_fit else "")
        + ".",
        "",
    ]
    lines.extend(f"{i}. {s}" for i, s in enumerate(sources, 1))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the held-out table and its summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    print(format_holdout(holdout_table()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
