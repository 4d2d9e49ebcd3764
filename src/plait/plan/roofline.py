"""Kernel times from a roofline: what one block (and the head) costs on one rank.

Each kernel of a transformer block takes the longer of its FLOPs at the rate its shape
reaches and its bytes at the device's memory bandwidth:

* **GEMMs** (q, k, v, o; MLP gate / up / down or fc / proj; the head; a mixture of
  experts' router, routed and shared experts) at their tensor-parallel split (the routed
  experts whole, on the tp rank's ``1 / tp`` of the routed rows) and the
  microbatch's tokens ``M``: ``2 M N K`` FLOPs at ``gemm x g(M) g(N) g(K)`` of the dense
  peak, ``g(x) = x / (x + GEMM_HALF)``, or ``e (M K + K N + M N)`` bytes at the
  bandwidth, whichever is longer. ``gemm`` is the largest fraction of the peak cuBLAS
  reaches on the device (its "maximum achievable matmul FLOPS"), ``g`` the loss of
  small dimensions (tiles and waves left part-empty, short main loops):
  ``GEMM_HALF = 128`` (one tile edge) gives a 1,024-cube 70% of the large-GEMM rate,
  4,096 91%, 16,384 98%, the shape of the size sweeps of the sources below. Backward runs
  two GEMMs of the same three dimensions per forward one, so twice the forward's time.
  **The reduction dimension** ``K`` is priced per device: ``g_K(K) = K / (K + K_half)``
  (:func:`k_half`). Each output tile runs a main loop of ``K`` steps after a fixed
  prologue (its first operand stages loaded) and before a fixed epilogue (the tile
  written); those are memory latency, about the same on every generation, while the
  loop's steps run at the device's tensor rate per SM: 2.89 TFLOP/s on the A100
  (312 / 108), 7.49 on the H100 (989 / 132), 15.2 on the B200. The fixed part therefore
  costs ``K`` steps 2.6 times longer on the H100: ``K_half = GEMM_HALF x`` (per-SM peak
  / the A100's), 128 on the A100, 332 on the H100 and H200, 674 on the B200 (a K of
  2,048: 94% of the long-K rate on the A100, 86% on the H100). The size sweeps agree:
  ``mamf-finder``'s best H100 shapes have K 13,312 (v2) and 17,920 (v1), the A100's
  5,120, and its README (``compute/accelerator/benchmarks``) sweeps the A100 to 5,376
  and the H100 to 20,480 for its maximum.
  **torch's async TP** (``pipelined``) multiplies each gathered shard as it arrives and
  each reduce-scatter destination's chunk apart
  (``torch.distributed._symmetric_memory``'s fused all-gather + matmul and matmul +
  reduce-scatter): its fused GEMMs run as ``tp`` GEMMs of ``M / tp`` rows, every tp-split
  GEMM of the forward (a MoE block's attention only) and, in backward, the input
  gradients of the attention's output projection and a dense MLP's (the two gathers of
  output gradients it fuses); their launches overlap on two streams (no extra gaps).
* **Attention** (flash attention, causal): the scores and weighted values of
  ``4 T d / (tp)`` FLOPs per token in forward, of which a causal kernel computes half
  (it skips masked tiles; the MFU convention still counts all of them), at
  ``attention_fwd`` of the peak; backward ``2.5 x`` the forward's FLOPs (five matmuls
  against two) at ``attention_bwd``.
* **Memory-bound operations** at ``BANDWIDTH_FRACTION`` of the HBM bandwidth, with the
  traffic of eager PyTorch (no fusion; what plait and torchtitan without ``torch.compile``
  run), per token of one block forward, ``e`` bytes of the compute dtype: two RMSNorms
  (computed in fp32: read ``e``, upcast, square, mean, scale, downcast, weight:
  ``3 e + 24`` bytes per element of ``d``), two residual additions (``3 e d``), rotary
  embeddings of q and k (``2 e + 16`` bytes per element of their ``(d + k) / tp``: fp32
  complex products), the SwiGLU's ``silu(a) x b`` (``5 e`` per element of ``f / tp``;
  GELU ``2 e``); backward moves twice the forward's bytes. The head's loss (``logits``
  upcast to fp32, log-softmax, its backward, the downcast): ``2 e + 28`` bytes per
  vocabulary element of the rank and token.

Sources of the kernel fractions (:data:`PROFILES`):

* GEMMs: the maximum achievable matmul FLOPS measured with the ``mamf-finder`` sweep
  (S. Bekman, *Machine Learning Engineering*, ``compute/accelerator``, table "Maximum
  Achievable Matmul FLOPS comparison"): H100 SXM bf16 about 792 of 989 TFLOP/s (0.80),
  A100 SXM about 271 of 312 (0.87); H200 shares the H100's tensor cores (0.80); B200
  taken as 0.75 (early cuBLAS figures, about 1.7 of 2.25 PFLOP/s).
* Attention: FlashAttention-2 as PyTorch's SDPA runs it (what plait and torchtitan's
  December 2024 runs use): on H100, about 350 TFLOP/s forward and 300 backward for head
  dimension 128, causal, 8k tokens (the FlashAttention-2 baselines of FlashAttention-3,
  Shah et al. 2024, arXiv 2407.08608, figures 5 and 6): 0.35 and 0.30 of the peak; on
  A100 up to 73% forward and 63% backward (Dao 2023, arXiv 2307.08691): 0.70 and 0.60.
* Bandwidth: the datasheets' HBM bandwidth (:func:`plait.plan.devices.memory_bandwidth`),
  of which streaming kernels reach about 85-90% (``BANDWIDTH_FRACTION = 0.85``).

**Software stacks**, ``torch.compile`` and Float8, and the loss over the logits: the
kernels each code base runs beside this roofline, in :mod:`plait.plan.stacks`.

Sequence parallelism runs the norms and residuals on ``tokens / tp``. Each kernel a block
launches costs :data:`KERNEL_GAP` (3 us: launch latency, ramp and tail between dependent
kernels) beside its roofline time; backward launches twice as many. The AdamW step moves
:data:`OPTIMIZER_BYTES` (32: read parameter, gradient and both moments in fp32, write
three of them and the bf16 copy, read the gradient for its norm) per parameter of the
rank's shard at the sustained bandwidth.

None of those is fitted. The fitted constants, the *sustained fraction* (power-capped
clocks below the boost clock the peaks assume, collectives sharing the SMs and memory
with compute, what the op list above misses), divide every kernel time:
:data:`plait.plan.compute_time.EFFICIENCY`, shared, times the stack's
:data:`plait.plan.compute_time.STACK_SCALE`, fitted by :mod:`plait.plan.calibration`.

Devices without a profile (the ``cpu`` preset, a device named otherwise) have no
roofline: :func:`profile` returns None and the cost model falls back to one fraction of
the peak for every FLOP (:data:`plait.plan.compute_time.FLAT_EFFICIENCY`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from plait.plan.devices import (
    DEVICES,
    STREAMING_MULTIPROCESSORS,
    family,
    memory_bandwidth,
    streaming_multiprocessors,
)
from plait.plan.spec import DeviceSpec, ModelSpec
from plait.plan.stacks import (
    ATTENTION,
    LOSS_BYTES,
    STACKS,
    Float8,
    Stack,
)

__all__ = [
    "BANDWIDTH_FRACTION",
    "GEMM_HALF",
    "KERNEL_GAP",
    "OPTIMIZER_BYTES",
    "PROFILES",
    "BlockKernels",
    "KernelProfile",
    "attention_fractions",
    "block_kernels",
    "elementwise_seconds",
    "flash_seconds",
    "gemm_fraction",
    "gemm_seconds",
    "head_kernels",
    "k_half",
    "loss_bytes",
    "profile",
]

GEMM_HALF = 128.0
"""The dimension at which a GEMM reaches half its large-shape rate in that dimension."""

BANDWIDTH_FRACTION = 0.85
"""Fraction of the datasheet HBM bandwidth memory-bound kernels reach."""


@dataclass(frozen=True)
class KernelProfile:
    """Fractions of the dense peak a device's kernels reach (module docstring)."""

    gemm: float  # large GEMMs (maximum achievable matmul FLOPS / peak)
    attention_fwd: float  # flash attention forward, causal FLOPs counted
    attention_bwd: float
    bandwidth: float  # HBM bytes/s (datasheet)
    k_half: float = GEMM_HALF  # the reduction length at half rate (:func:`k_half`)


_H100 = (0.80, 0.35, 0.30)
PROFILES: dict[str, tuple[float, float, float]] = {
    "h100": _H100,
    "a100": (0.87, 0.70, 0.60),
    "b200": (0.75, 0.35, 0.30),
}
"""Per chip family (:func:`plait.plan.devices.family`): ``(gemm, attention_fwd,
attention_bwd)`` (sources: module docstring)."""


def profile(device: DeviceSpec) -> KernelProfile | None:
    """The roofline profile of ``device`` (None: no roofline, see the module docstring).
    Measured devices have none (their rates are achieved rates already)."""
    chip = family(device.name)
    if device.measured or chip not in PROFILES:
        return None
    bandwidth = memory_bandwidth(device)
    if not bandwidth:
        return None
    gemm, fwd, bwd = PROFILES[chip]
    return KernelProfile(gemm, fwd, bwd, bandwidth, k_half(device))


def k_half(device: DeviceSpec) -> float:
    """The reduction length ``K`` at which a GEMM tile's main loop takes as long as its
    fixed prologue and epilogue (module docstring, "The reduction dimension"):
    :data:`GEMM_HALF` on the A100, scaled by the device's dense peak per streaming
    multiprocessor over the A100's (the fixed part is latency, the same on both)."""
    sms = streaming_multiprocessors(device)
    if not sms:
        return GEMM_HALF
    reference = DEVICES["a100"]
    per_sm = reference.flops / STREAMING_MULTIPROCESSORS[family(reference.name)]
    return GEMM_HALF * (device.flops / sms) / per_sm


def _g(x: float, half: float = GEMM_HALF) -> float:
    return x / (x + half)


def gemm_fraction(
    m: float, n: float, k: float, gemm: float, reduction_half: float = GEMM_HALF
) -> float:
    """Fraction of the peak an ``(m x k) @ (k x n)`` GEMM reaches (module docstring)."""
    return gemm * _g(m) * _g(n) * _g(k, reduction_half)


def gemm_seconds(
    m: float,
    n: float,
    k: float,
    peak: float,
    prof: KernelProfile,
    element: int,
    operand: float | None = None,
) -> float:
    """One ``(m x k) @ (k x n)`` GEMM: FLOPs at its shape's rate or bytes at the
    bandwidth, the longer (``operand``: bytes per input element where they differ from
    the output's ``element``, 1 for fp8)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k / (gemm_fraction(m, n, k, prof.gemm, prof.k_half) * peak)
    if operand is None:
        nbytes = element * (m * k + k * n + m * n)
    else:
        nbytes = operand * (m * k + k * n) + element * m * n
    traffic = nbytes / (prof.bandwidth * BANDWIDTH_FRACTION)
    return max(flops, traffic)


def elementwise_seconds(nbytes: float, prof: KernelProfile) -> float:
    """Memory-bound work of ``nbytes`` at the sustained bandwidth."""
    return nbytes / (prof.bandwidth * BANDWIDTH_FRACTION)


KERNEL_GAP = 3e-6
"""Seconds between two dependent kernels of one stream (launch latency, the ramp and
tail of each kernel): added per kernel a block launches (module docstring)."""

OPTIMIZER_BYTES = 32.0
"""HBM bytes per parameter of the rank's optimizer shard one AdamW step moves (module
docstring)."""


def attention_fractions(kernel: str, device: str, prof: KernelProfile) -> tuple[float, float]:
    """Forward and backward fraction of the peak of the flash ``kernel`` on ``device``
    (the profile's FlashAttention-2 figures where the table has none)."""
    return ATTENTION.get((kernel, family(device)), (prof.attention_fwd, prof.attention_bwd))


def flash_seconds(flops: float, fractions: tuple[float, float], peak: float) -> tuple[float, float]:
    """Forward and backward seconds of a flash attention kernel whose forward computes
    ``flops`` (a causal kernel's half counted), at the ``(forward, backward)`` fractions of
    the peak :func:`attention_fractions` gives; backward computes ``2.5 x`` the forward
    (five matmuls against two; module docstring)."""
    return flops / (fractions[0] * peak), 2.5 * flops / (fractions[1] * peak)


@dataclass(frozen=True)
class BlockKernels:
    """One block, one microbatch, one rank, forward: seconds by kind (before the
    sustained fraction). Backward: ``2 gemm + attention_bwd + 2 elementwise``."""

    # The forward's GEMMs by the tensor-parallel collective each follows or feeds:
    # attention's input gather (q, k, v), its output reduction (o), the MLP's input gather
    # (its input GEMMs, a MoE's router) and its output reduction (the output GEMMs).
    fused: tuple[float, float, float, float]
    attention_fwd: float
    attention_bwd: float
    elementwise: float
    matmul_elements: float  # matrix elements per token the GEMMs above go through
    launches: int = 0  # kernels the forward launches
    tail: float = 0.0  # of the forward: what runs after its last saved tensor is packed
    cast: float = 0.0  # Float8's casts to fp8 in forward
    cast_bwd: float = 0.0  # and in backward
    gemm_bwd: float | None = None  # backward's GEMMs where not twice ``gemm`` (async TP)

    @property
    def gemm(self) -> float:
        """The forward's GEMMs."""
        return sum(self.fused)

    @property
    def forward(self) -> float:
        return self.gemm + self.attention_fwd + self.elementwise + self.cast

    @property
    def backward(self) -> float:
        gemm = 2 * self.gemm if self.gemm_bwd is None else self.gemm_bwd
        return gemm + self.attention_bwd + 2 * self.elementwise + self.cast_bwd


@functools.lru_cache(maxsize=4096)
def block_kernels(
    model: ModelSpec,
    tp: int,
    tokens: float,
    seq_len: int,
    cp: int,
    element: int,
    moe: bool,
    prof: KernelProfile,
    peak: float,
    kernels: Stack = STACKS["plait"],
    sp: bool = False,
    device: str = "",
    split: int = 1,
    fp8: Float8 | None = None,
    pipelined: bool = False,
    cp_bytes: tuple[float, float] = (0.0, 0.0),
) -> BlockKernels:
    """Forward kernels of one block (dense, or a MoE block with ``moe``) for ``tokens``
    tokens of one rank (the microbatch, after context parallelism), its matrices split
    ``tp`` ways, run by the stack ``kernels`` (``sp``: sequence parallelism, the norms
    and residuals on ``tokens / tp``; ``split``: the tp ranks a MoE block's routed rows are
    cut among, each running its chunk through whole experts; ``fp8``: the block's linears
    as Float8Linears; ``pipelined``: torch's async TP runs its fused GEMMs one row chunk
    at a time, module docstring; ``cp_bytes``: a context-parallel attention's memory-bound
    passes, forward and backward, per element of its output:
    :func:`plait.plan.stacks.cp_pass_bytes`)."""
    d, f = model.d_model, model.ffn_hidden
    q, kv = model.q_width, model.kv_width
    n = tokens
    gemms: list[tuple[float, float, float]] = [  # (M, N, K) per token-row GEMM
        (n, q / tp, d),  # q
        (n, kv / tp, d),  # k
        (n, kv / tp, d),  # v
        (n, d, q / tp),  # o
    ]
    group = [0, 0, 0, 1]  # the TP collective each follows or feeds (BlockKernels.fused)
    low = [True] * len(gemms)  # which GEMMs a Float8Linear runs (q, k, v, o, MLP, shared)
    if moe:
        e, h, k = model.experts, model.expert_hidden, model.top_k
        gemms.append((n, e, d))  # the router, whole on every tp rank
        # Rows per expert, on average (dropless); a tp rank runs its chunk, 1 / tp of the
        # routed rows, through whole experts (plait.plan.shards' module docstring).
        rows = n * k / e / split
        gemms += [(rows, h, d), (rows, h, d), (rows, d, h)] * e
        group += [2] + [2, 2, 3] * e
        low += [False] * (1 + 3 * e)  # the router and the routed experts stay high
        if model.shared_experts:
            s = h * model.shared_experts / tp
            gemms += [(n, s, d), (n, s, d), (n, d, s)]
            group += [2, 2, 3]
            low += [True] * 3
        width = k * h / split + h * model.shared_experts / tp
    else:
        mlp = [(n, f / tp, d), (n, d, f / tp)]
        gemms += [(n, f / tp, d), *mlp] if model.gated else mlp
        group += [2] * (len(gemms) - 5) + [3]
        low = [True] * len(gemms)
        width = f / tp
    if fp8 is None:
        low = [False] * len(gemms)
        low_prof = prof
    else:
        low_prof = dataclasses.replace(prof, gemm=fp8.gemm, k_half=fp8.k_half)

    def timed(m: float, nn: float, kk: float, fp8_gemm: bool) -> float:
        if fp8 is not None and fp8_gemm:
            return gemm_seconds(m, nn, kk, fp8.peak, low_prof, element, operand=1)
        return gemm_seconds(m, nn, kk, peak, prof, element)

    # torch's async TP (module docstring): the fused GEMMs run as tp GEMMs of n / tp rows
    # each; forward: every tp-split GEMM of the attention (q, k, v, o) and of a dense MLP;
    # backward: the input-gradient GEMMs of o and of a dense MLP's output projection.
    chunks = tp if pipelined and tp > 1 else 1
    chunked = 4 if moe else len(gemms)  # the first ones

    def pieces(m: float, nn: float, kk: float, fp8_gemm: bool) -> float:
        return chunks * timed(m / chunks, nn, kk, fp8_gemm)

    whole = [timed(*g, x) for g, x in zip(gemms, low, strict=True)]
    times = [
        pieces(*g, x) if i < chunked and chunks > 1 else t
        for i, (g, x, t) in enumerate(zip(gemms, low, whole, strict=True))
    ]
    # The MLP's output GEMM packs its saved input before it runs; nothing after it saves
    # a tensor (the residual addition saves none). MoE blocks: not analysed, 0.
    last = 0.0 if moe else times[-1]
    fused = [0.0] * 4
    for t, which in zip(times, group, strict=True):
        fused[which] += t
    gemm_bwd = None
    if chunks > 1:
        grads = [(n, q / tp, d, low[3])] + ([] if moe else [(n, f / tp, d, low[-1])])
        gemm_bwd = 2 * sum(whole) + sum(pieces(*g) - timed(*g) for g in grads)
    elements = sum(nn * kk * (m / n) for m, nn, kk in gemms)
    cast = cast_bwd = 0.0
    launches = kernels.kernels
    if fp8 is not None:
        c = fp8.per_element * element + fp8.fixed  # bytes per element cast
        weights = 1.0 if fp8.weights else 0.0
        # Float8 TP: the column-parallel linears (q, k, v; a dense MLP's input GEMMs) take
        # their module's input gathered in fp8, cast once on the shard, kept fp8 for
        # backward: no input casts of their own.
        gathered = fp8.gathered and tp > 1
        inputs = 0
        for i, ((m, nn, kk), fp8_gemm) in enumerate(zip(gemms, low, strict=True)):
            if not fp8_gemm:
                continue
            fed = i < 3 or (not moe and kk == d)  # q, k, v; a dense MLP's input GEMMs
            own = 0.0 if gathered and fed else m * kk
            inputs += own > 0
            cast += c * (own + weights * nn * kk)
            cast_bwd += c * (own + weights * nn * kk + 2 * m * nn)
        if gathered:  # the attention's input and a dense MLP's, on the sequence shard
            modules = 1 if moe else 2
            cast += c * modules * (n / tp if sp else n) * d
            inputs += modules
        launches += (inputs + int(fp8.weights) * sum(low)) * fp8.kernels
        cast, cast_bwd = elementwise_seconds(cast, prof), elementwise_seconds(cast_bwd, prof)
    # Attention: 4 T d / (tp cp) FLOPs per token (each token of the rank's T / cp attends
    # to the whole sequence).
    heads = model.heads / tp
    scores = 0.0  # bytes of materialized scores per token, forward
    if kernels.attention == "materialized":
        # Batched GEMMs per head, all of the sequence computed (the mask applied after):
        # scores (n x T, inner head_dim) and weighted values (n x head_dim, inner T).
        hd = model.dim_head
        one = gemm_seconds(n, seq_len, hd, peak, prof, element) + gemm_seconds(
            n, hd, seq_len, peak, prof, element
        )
        attn_fwd = heads * one
        attn_bwd = 2 * attn_fwd
        # fused scale-mask-softmax (read, write) and dropout (read, write, a byte mask)
        softmax = 2 * element + (2 * element + 1 if kernels.dropout else 0)
        scores = heads * seq_len * softmax
    else:
        fractions = attention_fractions(kernels.attention, device, prof)
        attention = n * 4.0 * seq_len * q / tp / 2  # a causal kernel computes half
        attn_fwd, attn_bwd = flash_seconds(attention, fractions, peak)
    outputs = n * q / tp  # merged and accumulated beside the kernels under cp
    attn_fwd += elementwise_seconds(outputs * cp_bytes[0], prof)
    attn_bwd += elementwise_seconds(outputs * cp_bytes[1], prof)
    split = tp if sp and tp > 1 else 1  # norms and residuals over the sequence shard
    norm = (3 * element + 24) if kernels.norm == "eager-fp32" else 2 * element
    residual = 3 * element + (1 if kernels.dropout else 0)
    # A residual addition fused into the norm after it reads one more addend and writes
    # the sum beside the norm's output: ``2 e``, not ``3 e`` (torch.compile).
    residuals = 2 * residual - kernels.fused_residuals * element
    if kernels.activation == "eager":
        act = 5 * element if model.gated else 2 * element
    else:
        act = 3 * element if model.gated else 2 * element
    rope = 0.0
    if not model.positions:
        rope = (2 * element + 16) if kernels.rope == "eager-fp32" else 2 * element
    per_token = (
        2 * norm * d / split  # two norms
        + residuals * d / split  # two residual additions
        + rope * (q + kv) / tp  # rotary embedding of q and k
        + act * width  # the MLP's activation (over the routed / shared widths)
        + scores
    )
    if not moe:
        last += elementwise_seconds(n * residual * d / split, prof)
    return BlockKernels(
        (fused[0], fused[1], fused[2], fused[3]),
        attn_fwd,
        attn_bwd,
        elementwise_seconds(n * per_token, prof),
        elements,
        launches,
        last,
        cast,
        cast_bwd,
        gemm_bwd,
    )


def loss_bytes(loss: str, element: int) -> float:
    """Bytes per vocabulary element of the rank and token of the loss kind ``loss``
    (:data:`LOSS_BYTES`), forward and backward together."""
    fixed, per_element = LOSS_BYTES[loss]
    return fixed + per_element * element


@functools.lru_cache(maxsize=4096)
def head_kernels(
    model: ModelSpec,
    tp: int,
    tokens: float,
    element: int,
    prof: KernelProfile,
    peak: float,
    loss: str = "eager-fp32",
) -> tuple[float, float]:
    """The head and its ``loss`` (:data:`LOSS_BYTES`) for ``tokens`` tokens on one rank
    (vocabulary split ``tp`` ways): forward and backward seconds (before the sustained
    fraction)."""
    v = model.vocab / tp
    gemm = gemm_seconds(tokens, v, model.d_model, peak, prof, element)
    seconds = elementwise_seconds(tokens * v * loss_bytes(loss, element), prof)
    # The loss's bytes above cover its forward and backward; split them 1 : 2.
    return gemm + seconds / 3, 2 * gemm + 2 * seconds / 3
