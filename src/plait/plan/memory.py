"""Peak memory of one rank under a layout: the parts, as plait's code allocates them.

Per rank, with ``P`` the elements it holds after tensor parallelism
(:func:`~plait.plan.shards.rank_params`), ``ds = dp_shard x cp`` (the ranks
``fully_shard`` shards over), ``e`` the compute dtype's bytes (2 for bf16, 4 for fp32) and
``n`` the tokens of one microbatch on one rank (``global_batch / dp / microbatches *
seq_len / cp``: context parallelism's ranks share a batch and split its sequences):

* **params, grads**: fp32 shards, ``4 P / ds`` each (``--mp bf16`` keeps fp32 shards and
  fp32 gradient reductions); **optimizer**: AdamW's two fp32 moments, ``8 P / ds``
  (other frameworks' dtypes: below).
  ``fully_shard`` pads each parameter's dim 0 to a multiple of ``ds`` (rank 0 holds
  ``ceil(dim0 / ds)`` rows): the shards, the gathered units and the fp32 reduce-scatter
  inputs are of each unit's padded elements (:func:`~plait.plan.shards.padded_params`,
  :func:`~plait.plan.shards.shard_padding`; not under ZeRO or Megatron-LM's flat buffers).
* **unsharded** (``ds > 1``): the all-gathered units in flight, in the compute dtype. The
  root unit (embeddings, head) stays gathered from forward through backward
  (``fully_shard`` does not reshard the root after forward); blocks: the current one and the
  prefetched next, or every block with ``reshard_after_forward=False``; under a pipeline
  every local stage (plait's schedules gather a stage once per step, ``add_fsdp_actions``),
  or with ``max_active_stages`` that many of the rank's largest stages and one more: the
  all-gather output of the stage being gathered again, mid-step.
  With ``Software.float8_all_gather`` a dense model's gathered blocks are fp8, 1 byte per
  parameter. Float8 changes nothing else here: torchao's ``Float8Linear`` saves its
  high-precision input and weight for backward and casts again there (no fp8 copies
  kept), and the casts' fp8 outputs live for one GEMM; a compiled block saves what the
  eager one does (the activation recipes are kept as they are).
  Without ``fully_shard``, ``--mp bf16`` runs under autocast, whose cache keeps a bf16 copy
  of every matrix until backward.
* **activations**: per block and token, what autograd saves
  (:mod:`plait.plan.activations`, as the layout's recipe counts it:
  :mod:`plait.plan.keeps`), times the block's
  layers and the microbatches in flight on the rank (from plait's schedule simulator).
* **buffers**: the reduce-scatter staging of the largest block (its unsharded gradient in
  the compute dtype and its fp32 reduction input, padded); pipeline send / receive buffers.
* **extra**: ``logits`` (the head's rank: the fp32 log-probabilities ``lm_loss`` saves per
  microbatch in flight, plus the compute-dtype logits and their fp32 copy at the loss);
  ``accumulated_grads`` (``fully_shard`` without gradient sync, i.e. gradient accumulation
  or a pipeline: unsharded fp32 gradients of everything the rank holds); ``recompute``
  (checkpointing: one block's activations rebuilt during its backward); ``not_at_peak``
  (negative): backward frees activations while it makes gradients, so not every part is
  alive at once. The peak is the largest of backward's start (activations and logits),
  a block's backward (the activations below it, its own or their recomputation, and the
  gradient staging of ``buffers``) and backward's end (gradients and staging); this part
  takes away what the others count beyond it. ``cp_attention`` and ``dispatch``: context
  parallelism's and expert parallelism's working sets (:mod:`plait.plan.activations`).

ZeRO (``zero`` 1 or 2, over ``z = dp_replicate x cp`` ranks, no ``fully_shard``):
params ``e P`` (replicated in the compute dtype); optimizer ``(8 + 4) P / z`` in bf16
(AdamW's moments and an fp32 master copy; ``8 P / z`` in fp32); grads ``4 P`` (ZeRO-1:
the fp32 gradient buffer, which lives across steps) or ``4 P / z`` (ZeRO-2, plus one
block's fp32 bucket in ``buffers``). Megatron-LM's distributed optimizer table: ``6 +
12 / d`` bytes per parameter for bf16 with fp32 gradients.

Other frameworks' dtypes (``software``, :class:`~plait.plan.spec.Software`; the default
is plait's, the figures above): every gradient buffer is in the reduction's dtype
(``grad_reduce_fp32``; ``e`` bytes for bf16 reductions: ZeRO's gradients, Megatron-Core's
``main_grad`` and apex's contiguous grad buffer, ``fully_shard``'s accumulated gradients
and reduce-scatter input); ``optimizer_states`` ``"remainders"`` keeps a 2-byte master
(apex ``store_param_remainders``: ZeRO's optimizer ``(8 + 2) P / z``), ``"bf16"`` none and
bf16 moments (ZeRO's ``4 P / z``; under ``fully_shard`` bf16 shards and gradients, ``2 P /
ds`` each, and ``4 P / ds`` of moments); ``loss_upcast`` False keeps the loss's
log-probabilities and gradients in the compute dtype.

Memory per rank under expert parallelism (``ep`` ranks of ``dp_shard x cp``, experts
sharded over ``efsdp = dp_shard x cp / ep``): parameters, gradients and optimizer states
of the experts are ``1 / (dp_shard x cp)`` of all of them, like the dense ones; the
*unsharded* working set of a block holds only its ``E / ep`` experts, so ``ep`` shrinks
``unsharded``, the gradient staging (``buffers``) and the accumulated gradients, not the
states. Under tensor parallelism ``fully_shard`` shards the routed experts over ``efsdp x
tp`` ranks (:func:`~plait.plan.shards.expert_fsdp_ranks`), so their states are ``1 /
(dp_shard x cp x tp)`` of all of them; a block still gathers its ``E / ep`` experts whole on
every tp rank (each runs its chunk of the rows through all of them).

plait's Llama (:mod:`plait.plan.activations` for what its blocks save): a block's
backward holds SwiGLU's three hidden gradients. At the loss the backward starts with two
fp32 full-vocabulary gradients beside the saved log-probabilities (not under tp's
``loss_parallel``, measured as the forward's count; the logits themselves are freed by
then: ``Keeps.logits_held``), and, with blocks resharded after forward, no block is
gathered then.

Not modelled: the allocator's fragmentation and caching, CUDA context and library
workspaces (the search leaves headroom for them), dropout masks, attention's per-row
statistics, the root unit's gradient staging at the very end of backward (when activations
are already freed), and the optimizer step's temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.activations import (
    activation_elems_per_token,
    cp_saved_elems_per_token,
    cp_working_set,
    rms_norm_bytes,
    routed_elems_per_token,
    scores_elems_per_token,
)
from plait.plan.keeps import RECIPE_KEEPS, Keeps, recipe_keeps
from plait.plan.memory_rank import MemoryRank, memory_rank
from plait.plan.schedule import PipelineShape, RankLoad, layout_shape
from plait.plan.shards import moe_rows, routed_tp
from plait.plan.spec import (
    DeviceSpec,
    Layout,
    MemoryBreakdown,
    ModelSpec,
    Software,
    Workload,
    zero_ranks,
)

__all__ = [
    "RECIPE_KEEPS",
    "Keeps",
    "activation_elems_per_token",
    "cp_saved_elems_per_token",
    "cp_working_set",
    "first_rank_memory",
    "peak_memory",
    "predict_memory",
    "rank_memory",
    "recipe_keeps",
    "rms_norm_bytes",
    "routed_elems_per_token",
    "scores_elems_per_token",
]


@dataclass(frozen=True)
class _States:
    """Parameters, gradients and optimizer state the rank stores, and its gradient
    staging (``buffers``, before a pipeline's send and receive buffers)."""

    params: float
    grads: float
    optimizer: float
    buffers: float


def _states(r: MemoryRank) -> _States:
    """``fully_shard``'s fp32 shards, padded (module docstring), or ZeRO's."""
    if r.zero:
        return _zero_states(r)
    sharded = r.padded.total / r.ds
    # The block's unsharded gradients (autograd's, unpadded) and its reduce-scatter input
    # in the reduction's dtype (padded).
    buffers = r.params.block * r.e + r.padded.block * r.grad_bytes if r.ds > 1 else 0.0
    w = r.weight_bytes  # the shards are the master weights (their remainders apart)
    remainders = r.master_bytes if w < 4 else 0
    optimizer = (r.moment_bytes * r.keeps.moments + remainders) * sharded
    return _States(w * sharded, w * sharded, optimizer, buffers)


def _zero_states(r: MemoryRank) -> _States:
    """ZeRO's (module docstring): parameters replicated in the compute dtype, the
    optimizer state (and ZeRO-2's gradients) sharded over its ranks."""
    p, e, z, g = r.params, r.e, zero_ranks(r.layout), r.grad_bytes
    optimizer = (r.moment_bytes * r.keeps.moments + r.master_bytes) * p.total / z
    grads = g * p.total / (z if r.zero == 2 else 1)  # in the reduction's dtype
    buffers = p.block * g if r.zero == 2 else 0.0  # one block's bucket, then scattered
    return _States(e * p.total, grads, optimizer, buffers)


def _gathered(r: MemoryRank) -> tuple[float, float]:
    """The ``unsharded`` part (module docstring), and of it the blocks' gathered
    parameters no longer alive at the loss (resharded after forward)."""
    if r.ds > 1:
        keep_all = r.pipelined or not r.layout.reshard_after_forward
        gathered_blocks = r.load.layers if keep_all else 2
        if r.pipelined and r.layout.max_active_stages:  # a bound on the stages held full
            # ... and, gathered mid-step, a stage's all-gather output beside them while it
            # is copied out (the unbounded order gathers before the activations build up).
            active = r.load.stage_layers * (r.layout.max_active_stages + 1)
            gathered_blocks = min(gathered_blocks, active)
        # fp8 all-gathers hold the dense blocks' weights in fp8 (MoE blocks: as they are)
        fp8 = r.software.float8_all_gather and not r.model.experts
        block_e = 1 if fp8 else r.e
        blocks = r.padded.largest_blocks(gathered_blocks) * block_e
        unsharded = (
            r.padded.root * r.e + blocks
            if fp8
            else (r.padded.root + r.padded.largest_blocks(gathered_blocks)) * r.e
        )
        if gathered_blocks == 2 and r.keeps.resharded_at_loss:
            return unsharded, r.padded.largest_blocks(2) * block_e
        return unsharded, 0.0
    if r.autocast:  # autocast's cache: a bf16 copy of every matrix, forward to backward
        p, model = r.params, r.model
        head = model.vocab * model.d_model / r.layout.tp if r.load.head else 0.0
        # Not of the routed experts: they multiply slices of their stacked weights, which
        # autocast does not cache (it caches leaf parameters only).
        moe_cached = p.moe_matmul - p.routed_matmul
        matrices = p.dense_blocks * p.dense_matmul + p.moe_blocks * moe_cached
        return (matrices + head) * 2, 0.0
    return 0.0, 0.0


@dataclass(frozen=True)
class _Saved:
    """The activations the rank's blocks save: per microbatch (its stage output
    included), over the microbatches in flight, and per token of its largest block;
    ``moe``: which kinds of block its stage has (dense, MoE); ``scores`` and
    ``rms_fp32``: the attention probabilities' elements and the RMSNorms' fp32 bytes
    one block saves per token (:mod:`plait.plan.activations`)."""

    per_microbatch: float
    activations: float
    largest_block: float
    moe: tuple[bool, ...]
    scores: float
    rms_fp32: float


def _block_bytes(r: MemoryRank, moe: bool, scores: float, rms_fp32: float) -> float:
    """Bytes one block (a MoE block with ``moe``) saves per token: its norm inputs in the
    residual stream's dtype, the rest in the compute dtype."""
    ac = r.layout.ac
    norm_part = r.model.d_model / r.seq_split * (1 if ac != "none" else 2)
    per_token = activation_elems_per_token(r.model, r.layout, moe=moe, keeps=r.keeps)
    kept_scores = scores if ac == "none" else 0.0  # else recomputed
    norms = norm_part * r.e_res + (rms_fp32 if ac == "none" else 0.0)
    return (per_token - norm_part + kept_scores) * r.e + norms


def _saved(r: MemoryRank) -> _Saved:
    """The ``activations`` part (module docstring) and what the other parts read of it."""
    scores = scores_elems_per_token(r.model, r.layout, r.work, r.keeps)
    rms_fp32 = rms_norm_bytes(r.model, r.layout, r.e, r.keeps)
    # The stage's dense blocks and MoE blocks (the dense ones lead: see shards.py).
    stage_dense = min(r.params.dense_blocks, r.load.stage_layers)
    kinds = [(False, stage_dense), (True, r.load.stage_layers - stage_dense)]
    kinds = [(moe, count) for moe, count in kinds if count]
    stage = sum(_block_bytes(r, moe, scores, rms_fp32) * count for moe, count in kinds)
    per_microbatch = r.n * stage * r.blocks_scale
    largest = max(_block_bytes(r, moe, scores, rms_fp32) for moe, _ in kinds)
    if r.pipelined and not r.load.head and r.keeps.stage_output:
        # A stage's output is the root its backward starts from: kept until then.
        per_microbatch += r.n * r.model.d_model / r.seq_split * r.e_res
    activations = per_microbatch * r.load.in_flight
    moe = tuple(moe for moe, _ in kinds)
    return _Saved(per_microbatch, activations, largest, moe, scores, rms_fp32)


def _logits(r: MemoryRank) -> float:
    """The head's rank's ``logits`` part: the loss's full-vocabulary tensors (module
    docstring; ``Keeps.loss``, ``Keeps.logits_held``) and the final norm's and head's
    inputs."""
    n, e, tp = r.n, r.e, r.layout.tp
    v, in_flight = r.model.vocab / tp, max(r.load.head_in_flight, 1)
    if r.keeps.loss == "fused_ce" or r.software.compiled_loss:  # the logits in flight, one
        # gradient (a compiled loss saves the compute-dtype logits and per-row statistics)
        logits = n * v * e * (in_flight + 1)
    else:
        # The log-probabilities and the backward's gradients: fp32 when the loss runs on
        # an fp32 copy of the logits (Software.loss_upcast), else in the compute dtype.
        upcast = r.software.loss_upcast
        lp = 4 if upcast else e
        grads = 2 * lp if tp == 1 else lp  # (loss_parallel's backward: one gradient)
        # The backward's two gradients beside the held logits, or (forward) the
        # compute-dtype logits and their fp32 copy (also tp's loss_parallel backward's).
        if r.keeps.logits_held:  # backward: the gradients beside the logits
            at_loss = e + grads
        else:  # the forward's logits and fp32 copy (none of fp32 logits), or backward's
            at_loss = max(e + (4 if upcast and e < 4 else 0), grads)
        logits = n * v * (lp * in_flight + at_loss)
    return logits + n * r.model.d_model * (r.e_res / r.seq_split + e)  # ln_f, head in


def _recompute(r: MemoryRank, saved: _Saved) -> float:
    """Checkpointing's ``recompute`` part: the largest block's activations rebuilt."""
    full = max(
        activation_elems_per_token(r.model, r.layout, "none", moe=m, keeps=r.keeps)
        for m in saved.moe
    )
    return r.n * ((full + saved.scores) * r.e + saved.rms_fp32)


def _extra(r: MemoryRank, saved: _Saved) -> dict[str, float]:
    """The ``extra`` parts alive at some moment of the step: ``logits``, ``recompute``,
    ``cp_attention`` and ``accumulated_grads`` (module docstring)."""
    extra: dict[str, float] = {}
    if r.load.head:
        extra["logits"] = _logits(r)
    if r.layout.ac != "none":
        extra["recompute"] = _recompute(r, saved)
    attention = cp_working_set(r.model, r.layout, r.work)
    if attention:
        extra["cp_attention"] = attention
    if r.ds > 1 and r.accumulating and not r.keeps.sharded_accumulation:
        # Of the rank's ep shard of experts, in the reduction's dtype.
        extra["accumulated_grads"] = r.params.gathered * r.grad_bytes
    return extra


def _held_grads(r: MemoryRank, states: _States, extra: dict[str, float]) -> float:
    """Gradients alive from the step's first backward on: accumulated (unsharded under
    ``fully_shard``, the gradients themselves otherwise), or ZeRO's buffer, which lives
    across steps (it is zeroed, not freed)."""
    if r.zero:
        return states.grads
    return extra.get("accumulated_grads", states.grads if r.accumulating else 0.0)


def _gradient_flow(r: MemoryRank, saved: _Saved) -> float:
    """Inside a block's backward, gradients of activations: the output's (whole sequence
    once tensor parallelism gathered it) and the MLP's hidden one."""
    model, tp = r.model, r.layout.tp
    hidden = model.ffn_hidden / tp
    if saved.rms_fp32:  # plait's SwiGLU: the product's, silu's, up's and gate's gradients
        hidden *= 3
    if r.params.moe_blocks:  # the routed rows' gradients (gathered) and their experts' hidden
        routed = model.top_k * (model.d_model + model.expert_hidden / routed_tp(r.layout))
        hidden = max(hidden, routed + model.expert_hidden * model.shared_experts / tp)
    return r.n * (model.d_model + hidden) * r.e


def _in_attention(r: MemoryRank, attention: float) -> float:
    """A block's attention's backward runs after its MLP's: the MLP's saved values and
    hidden gradient are gone, the output's gradient flows in beside the attention's
    working set."""
    model = r.model
    mlp_saved = r.n * (4 if model.gated else 2) * model.ffn_hidden / r.layout.tp * r.e
    return r.n * model.d_model * r.e + attention - mlp_saved


def _block_backward(r: MemoryRank, saved: _Saved, extra: dict[str, float], held: float) -> float:
    """Bytes alive in a block's backward: the activations below it, its own or their
    recomputation, the gradients held and flowing through it, and the previous block's
    fp32 reduce-scatter input, still in flight (not under a pipeline, which reduces after
    its last backward; the block's own unsharded gradients appear as its activations
    go)."""
    one_block = r.n * saved.largest_block  # one block's saved activations, one microbatch
    reducing = (r.pipelined and not r.keeps.sharded_accumulation) or r.ds == 1
    below = (
        saved.per_microbatch * max(r.load.in_flight_after_backward, 1)
        - one_block
        + extra.get("recompute", one_block)
        + held
        + (0.0 if reducing else r.padded.block * r.grad_bytes)
        + (r.params.block * r.grad_bytes if r.zero == 2 else 0.0)
    )
    attention = extra.get("cp_attention", 0.0)
    return below + max(_gradient_flow(r, saved), _in_attention(r, attention))


def _not_at_peak(
    r: MemoryRank, saved: _Saved, states: _States, extra: dict[str, float], resharded: float
) -> float:
    """The ``not_at_peak`` part (module docstring): the peak, the largest of the step's
    moments, less what the other parts count.

    Gradients are dropped after each step (``zero_grad(set_to_none=True)``) and exist from
    the step's first backward on. The moments: the first backward's start (the most
    microbatches in flight, the logits' saved values); a later moment with the
    accumulated gradients (the most in flight from then on); a block's backward
    (:func:`_block_backward`); the end (gradients, staging)."""
    held = _held_grads(r, states, extra)
    # fully_shard's unsharded accumulation is a part of its own; otherwise the held
    # gradients are ``grads`` themselves (ZeRO's buffer, gradients accumulated in their
    # shards or without fully_shard), counted once.
    accumulated = extra.get("accumulated_grads", 0.0)
    logits = extra.get("logits", 0.0)
    after = saved.per_microbatch * r.load.in_flight_after_backward
    moments = (
        saved.activations + logits + (held if r.zero else 0.0) - resharded,
        after + logits + held - resharded,
        _block_backward(r, saved, extra, held),
        states.grads + states.buffers + accumulated,
    )
    counted = saved.activations + logits + extra.get("recompute", 0.0) + states.grads
    counted += states.buffers + accumulated + extra.get("cp_attention", 0.0)
    return max(moments) - counted


def rank_memory(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    load: RankLoad,
    keeps: Keeps | None = None,
    software: Software | None = None,
) -> MemoryBreakdown:
    """The memory of pipeline rank ``load`` (module docstring), under ``keeps`` (default:
    the layout's recipe, :func:`recipe_keeps`) and ``software`` (the framework's dtypes,
    :class:`~plait.plan.spec.Software`; default: plait's): its states, gathered units,
    saved activations and the extra parts, less what is not alive at the peak."""
    r = memory_rank(model, layout, work, load, keeps or recipe_keeps(layout), software)
    states = _states(r)
    unsharded, resharded = _gathered(r)
    saved = _saved(r)
    extra = _extra(r, saved)
    extra["not_at_peak"] = _not_at_peak(r, saved, states, extra, resharded)
    buffers = states.buffers
    if r.pipelined:  # send / receive buffers live through the whole step
        buffers += 2 * r.n * model.d_model / r.seq_split * r.e
    if r.params.moe_blocks and layout.ep > 1:  # one all-to-all's send and receive buffers
        extra["dispatch"] = 2 * moe_rows(model, layout, work) * model.d_model * r.e
    return MemoryBreakdown(
        params=states.params,
        grads=states.grads,
        optimizer=states.optimizer,
        unsharded=unsharded,
        activations=saved.activations,
        buffers=buffers,
        extra=extra,
    )


def peak_memory(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    shape: PipelineShape,
    keeps: Keeps | None = None,
    software: Software | None = None,
) -> MemoryBreakdown:
    """The memory of the pipeline rank of ``shape`` that needs the most."""
    ranks = (rank_memory(model, layout, work, r, keeps, software) for r in shape.ranks)
    return max(ranks, key=_total)


def first_rank_memory(
    model: ModelSpec, layout: Layout, work: Workload, software: Software | None = None
) -> MemoryBreakdown:
    """The memory of pipeline rank 0 (the one a pipelined dry run measures:
    :func:`plait.plan.dryrun.pipeline_step`), whether or not it needs the most.
    ValueError for a layout plait's schedules refuse, or where another rank's load
    dominates rank 0's (its load is then not among the shape's ranks)."""
    shape = layout_shape(model, layout)
    loads = [r for r in shape.ranks if r.rank == 0]
    if not loads:
        raise ValueError("pipeline rank 0 holds less than another rank: not reported")
    return rank_memory(model, layout, work, loads[0], software=software)


def _total(m: MemoryBreakdown) -> float:
    return m.total


def predict_memory(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec | None = None,
    *,
    keeps: Keeps | None = None,
    software: Software | None = None,
) -> MemoryBreakdown:
    """Peak bytes of the rank that needs the most under ``layout`` (module docstring).

    ``device`` is accepted for symmetry with the other predictions and not used: memory
    does not depend on the device. ``keeps``: what the recipe keeps (default: the
    layout's, :func:`recipe_keeps`); ``software``: the framework's dtypes (gradient
    buffers, optimizer states, the loss's upcast: :class:`~plait.plan.spec.Software`;
    default: plait's). ValueError for a layout plait's schedules refuse.
    """
    del device
    shape = layout_shape(model, layout)
    return peak_memory(model, layout, work, shape, keeps, software)
