"""Peak memory of one rank under a layout: the parts, as plait's code allocates them.

Per rank, with ``P`` the elements it holds after tensor parallelism
(:func:`~plait.plan.shards.rank_params`), ``ds = dp_shard x cp`` (the ranks
``fully_shard`` shards over), ``e`` the compute dtype's bytes (2 for bf16, 4 for fp32) and
``n`` the tokens of one microbatch on one rank (``global_batch / dp / microbatches *
seq_len / cp``: context parallelism's ranks share a batch and split its sequences):

* **params, grads**: fp32 shards, ``4 P / ds`` each (``--mp bf16`` keeps fp32 shards and
  fp32 gradient reductions); **optimizer**: AdamW's two fp32 moments, ``8 P / ds``.
  ``fully_shard`` pads each parameter's dim 0 to a multiple of ``ds`` (rank 0 holds
  ``ceil(dim0 / ds)`` rows): the shards, the gathered units and the fp32 reduce-scatter
  inputs are of each unit's padded elements (:func:`~plait.plan.shards.padded_params`,
  :func:`~plait.plan.shards.shard_padding`; not under ZeRO or Megatron-LM's flat buffers).
* **unsharded** (``ds > 1``): the all-gathered units in flight, in the compute dtype. The
  root unit (embeddings, head) stays gathered from forward through backward
  (``fully_shard`` does not reshard the root after forward); blocks: the current one and the
  prefetched next, or every block with ``reshard_after_forward=False``; under a pipeline the
  whole stage (plait's schedules gather a stage once per step, ``add_fsdp_actions``).
  Without ``fully_shard``, ``--mp bf16`` runs under autocast, whose cache keeps a bf16 copy
  of every matrix until backward.
* **activations**: per block and token, what autograd saves (below), times the block's
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
  takes away what the others count beyond it.

Saved activations per token of one block (``d`` width, ``k`` the width of k and of v,
``f`` the MLP width; ``/tp`` where tensor parallelism splits heads or the MLP; norm inputs
``/tp`` under sequence parallelism only; linear inputs whole, since torch's tensor
parallelism saves the all-gathered input):

* ``--ac none``: norm inputs ``2d`` + linear inputs ``2d`` + q, k, v ``(d + 2k)/tp`` +
  attention output ``d/tp`` (flash kernels lay it out so that the output projection's
  input is a view of it) + MLP ``4f/tp`` (SwiGLU: w1, w3, silu, product) or ``2f/tp``
  (GELU: fc output, gelu output).
* ``--ac selective`` (plait keeps matmul outputs, recomputes the rest, attention included):
  block input ``d`` + q, k, v ``(d + 2k)/tp`` + attention projection ``d`` + MLP matmuls
  ``2f/tp + d`` (SwiGLU) or ``f/tp + d``.
* ``--ac full``: the block input ``d`` only.

A mixture-of-experts block (``E`` experts, ``k`` per token, width ``h``, ``s`` shared):
its attention saves as above; in place of the MLP, per token, the router's scores ``2E``
(gate output and probabilities; every tp rank routes the whole sequence) and the shared
experts' ``4 h s / tp``; per routed row (``k`` per token) the expert's input ``d`` and its
SwiGLU ``4h``, for the rank's tp chunk of the rows only (``/ tp``: tensor parallelism
under ``fully_shard`` cuts the routed rows into ``tp`` chunks, one per rank;
:func:`~plait.plan.shards.routed_tp`), and the output ``d`` of every row
(the chunks' outputs all-gathered over tp, kept for the routing weight)
(:func:`routed_elems_per_token`). ``--ac selective`` keeps the matmul outputs: gate ``E``,
per row of the chunk ``2h + d``, shared ``2 h s / tp + d``. With expert parallelism the
rows a rank saves are the ones its experts receive (``n k / tp`` with balanced routing)
and one all-to-all's send and receive buffers (``2 n k d / tp``) are alive at a time
(``extra["dispatch"]``).

Context parallelism (``cp`` ranks, :mod:`plait.context`) divides every per-token part by
``cp`` through ``n``, and its attention adds what :mod:`plait.context` keeps per block. No
method builds a mask (blocks run through SDPA's fused kernels, unmasked or causal on the
diagonal; only packed documents take tile-sized masks, and ``plait train`` packs none),
and every method returns its output as ``(batch, heads, tokens, head dim)``, so the
output projection's input is a copy of it (``d / tp`` beside the output):

* ``allgather``: the fused blocks' backward saves the whole sequence's keys and values,
  expanded to the query heads (``2 cp d / tp`` per local token, in place of the local
  ``2 k / tp``), the local q, the output and its log-sum-exp;
* ``ring``: the local q, k, v, the output and its log-sum-exp (its custom backward sends
  the key/value blocks round again);
* ``alltoall``: SDPA saves the head-split q and the expanded k, v (``3 d / tp`` per local
  token in place of ``(d + 2 k) / tp``) and its output beside the returned one.

The log-sum-exps (fp32, one per query head and token) are not counted, as without
context parallelism (module docstring's last paragraph).

Recipes (:class:`~plait.plan.spec.PlanLayout`'s ``recipe``). The counts above are
plait's (``"plait"``: what its runtime keeps, checked against real and dry runs).
``"megatron"`` counts what Megatron-LM keeps (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", arXiv 2205.05198, Table 2 and
section 4.2.2: ``s b h (34 / t + 5 a s / (h t))`` bytes per layer with sequence
parallelism and no recomputation): linear inputs are saved split by ``tp`` under
sequence parallelism (``2 d / tp``; re-gathered in backward), a fused SwiGLU saves its
input and output only (``3 f / tp``), the residual stream is in the compute dtype, and
with flash attention the ``5 a s / (h t)`` term (scores, softmax, dropout) is not saved,
so ``selective`` (core attention recomputed) saves what ``none`` does. Per token, in
bf16: ``(12 d + 4 k + 6 f) / tp`` bytes for a SwiGLU block, 32 of the paper's 34 for
GPT-3's (no dropout masks).

Other frameworks' recipes (:data:`RECIPE_KEEPS`, :class:`Keeps`): ``"torchtitan"``
(plait's counts; ``selective`` is torchtitan's per-op policy, which saves every other
matmul's output: wq, wv, w1, w2, the attention output and the block input);
``"foundry"`` (llm-foundry's MPT under Composer's FSDP: a fused cross-entropy,
flash-attn's, the default ``loss_fn`` of ``ComposerMPTCausalLM``, saves the
compute-dtype logits, no fp32 copy; gradient accumulation without ``no_sync`` reduce-
scatters every microbatch, so no unsharded fp32 gradients are held); ``"llama3"``
(Llama 3 paper, arXiv 2407.21783, section 3.3.2: Megatron-like activations, gradients
sharded ZeRO-2-like every microbatch, stage inputs and outputs freed, one block fewer on
the first and last stages). ``attention="materialized"`` adds the softmax's ``heads / tp x
seq_len`` probabilities per token (no flash kernel); ``moments=1`` is a one-moment
optimizer (Lion).

ZeRO (``zero`` 1 or 2, over ``z = dp_replicate x cp`` ranks, no ``fully_shard``):
params ``e P`` (replicated in the compute dtype); optimizer ``(8 + 4) P / z`` in bf16
(AdamW's moments and an fp32 master copy; ``8 P / z`` in fp32); grads ``4 P`` (ZeRO-1:
the fp32 gradient buffer, which lives across steps) or ``4 P / z`` (ZeRO-2, plus one
block's fp32 bucket in ``buffers``). Megatron-LM's distributed optimizer table: ``6 +
12 / d`` bytes per parameter for bf16 with fp32 gradients.

Those are saved under ``--ac none``; under checkpointing they are rebuilt per block
(``recompute``). ``extra["cp_attention"]`` is the working set of one block's attention
in backward: the fp32 gradient accumulators of the local queries and of the gathered,
expanded keys and values and the gathered gradient in the compute dtype (``allgather``),
the gradients of the head-split q, k, v and output (``alltoall``), or the local queries'
fp32 accumulator with two travelling key/value blocks and their two fp32 gradient
accumulators (``ring``). It is alive while the block's attention runs backward, after its
MLP's backward has freed the MLP's saved values and hidden gradient.

Memory per rank under expert parallelism (``ep`` ranks of ``dp_shard x cp``, experts
sharded over ``efsdp = dp_shard x cp / ep``): parameters, gradients and optimizer states
of the experts are ``1 / (dp_shard x cp)`` of all of them, like the dense ones; the
*unsharded* working set of a block holds only its ``E / ep`` experts, so ``ep`` shrinks
``unsharded``, the gradient staging (``buffers``) and the accumulated gradients, not the
states. Under tensor parallelism ``fully_shard`` shards the routed experts over ``efsdp x
tp`` ranks (:func:`~plait.plan.shards.expert_fsdp_ranks`), so their states are ``1 /
(dp_shard x cp x tp)`` of all of them; a block still gathers its ``E / ep`` experts whole on
every tp rank (each runs its chunk of the rows through all of them).

plait's Llama (``"plait"`` recipe, a gated model without learned positions:
:class:`plait.train.llama.Llama`): k and v are repeated to the query heads before
attention, which saves them so (``2 q / tp`` in place of ``2 k / tp``, ``q`` the query
width ``heads x head_dim``); each RMSNorm (computed in fp32) saves an fp32 copy of its
input beside its output, and Qwen3's per-head q and k norms their fp32 copies and outputs
(:func:`rms_norm_bytes`); a block's backward holds SwiGLU's three hidden gradients. At the
loss the backward starts with two fp32 full-vocabulary gradients beside the saved
log-probabilities (not under tp's ``loss_parallel``, measured as the forward's count; the
logits themselves are freed by then: ``Keeps.logits_held``), and, with blocks
resharded after forward, no block is gathered then.

Not modelled: the allocator's fragmentation and caching, CUDA context and library
workspaces (the search leaves headroom for them), dropout masks, attention's per-row
statistics, the root unit's gradient staging at the very end of backward (when activations
are already freed), and the optimizer step's temporaries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plait.plan.schedule import PipelineShape, RankLoad, layout_shape, pipeline_shape
from plait.plan.shards import (
    compute_bytes,
    fsdp_ranks,
    microbatch_tokens,
    moe_rows,
    padded_params,
    rank_params,
    routed_tp,
)
from plait.plan.spec import (
    DeviceSpec,
    Layout,
    MemoryBreakdown,
    ModelSpec,
    Workload,
    recipe,
    zero_ranks,
    zero_stage,
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
class Keeps:
    """What a framework's recipe keeps, beyond the layout (module docstring, "Recipes").

    * ``activations``: whose per-token count of saved activations applies: ``"plait"``,
      ``"megatron"`` (Korthikanti et al.), or ``"torchtitan"`` (plait's, but ``selective``
      is torchtitan's per-op policy);
    * ``attention``: ``"flash"`` (a fused kernel saves q, k, v, its output and per-row
      statistics: O(s) per token) or ``"materialized"`` (the softmax's ``heads/tp x s``
      probabilities per token, in the compute dtype, which the values' matmul saves too);
    * ``loss``: ``"lm_loss"`` (plait's and torch's ``cross_entropy`` under autocast: fp32
      log-probabilities per microbatch in flight, the compute-dtype logits and their fp32
      copy) or ``"fused_ce"`` (a fused cross-entropy kernel: the compute-dtype logits of
      each microbatch in flight and, in backward, their gradient; no fp32 full-vocabulary
      tensor);
    * ``moments``: fp32 optimizer moments per parameter (AdamW 2, Lion 1);
    * ``sharded_accumulation``: gradient accumulation (microbatches, pipelines)
      reduce-scatters every microbatch's gradients into the fp32 shard (FSDP1 without
      ``no_sync``, ZeRO-2) instead of keeping unsharded fp32 gradients until the last;
    * ``stage_output``: a pipeline stage keeps its output tensor until its backward (False:
      freed once sent, Megatron's ``deallocate_output_tensor``, Llama 3 section 3.3.2);
    * ``end_stage_fewer``: blocks fewer on the first and last pipeline stages (Llama 3
      section 3.3.2: one, balancing the embedding and the head);
    * ``logits_held``: the logits stay referenced through the loss's backward (a training
      loop that keeps them in a variable; plait's stepper did until 2026-11), which starts
      with two fp32 full-vocabulary gradients (of the log-probabilities and of the logits'
      fp32 copy) beside the saved log-probabilities. Without it the loss's backward holds
      the saved log-probabilities and the two fp32 gradients only;
    * ``resharded_at_loss``: with blocks resharded after forward, none is gathered when
      the loss runs (plait's fully_shard frees the last block's parameters before).
    """

    activations: str = "plait"
    attention: str = "flash"
    loss: str = "lm_loss"
    moments: int = 2
    sharded_accumulation: bool = False
    stage_output: bool = True
    end_stage_fewer: int = 0
    logits_held: bool = False
    resharded_at_loss: bool = False

    def __post_init__(self) -> None:
        if self.activations not in ("plait", "megatron", "torchtitan"):
            raise ValueError(f"activations {self.activations!r}: plait, megatron, torchtitan")
        if self.attention not in ("flash", "materialized"):
            raise ValueError(f"attention {self.attention!r}: flash or materialized")
        if self.loss not in ("lm_loss", "fused_ce"):
            raise ValueError(f"loss {self.loss!r}: lm_loss or fused_ce")
        if self.moments not in (1, 2):
            raise ValueError(f"moments {self.moments}: 1 (Lion) or 2 (AdamW)")


#: Each recipe's :class:`Keeps` (module docstring, "Recipes"): ``recipe`` names a row of
#: this table (:func:`plait.plan.spec.recipe`).
RECIPE_KEEPS: dict[str, Keeps] = {
    "plait": Keeps(resharded_at_loss=True),
    "megatron": Keeps(activations="megatron"),
    "torchtitan": Keeps(activations="torchtitan"),
    "foundry": Keeps(loss="fused_ce", sharded_accumulation=True),
    "llama3": Keeps(
        activations="megatron", sharded_accumulation=True, stage_output=False, end_stage_fewer=1
    ),
}


def recipe_keeps(layout: Layout) -> Keeps:
    """What ``layout``'s recipe keeps (:data:`RECIPE_KEEPS`)."""
    name = recipe(layout)
    if name not in RECIPE_KEEPS:
        raise ValueError(f"recipe {name!r}: the memory model knows {', '.join(RECIPE_KEEPS)}")
    return RECIPE_KEEPS[name]


def scores_elems_per_token(model: ModelSpec, layout: Layout, work: Workload, keeps: Keeps) -> float:
    """Elements of attention probabilities one block saves per local token: 0 with a flash
    kernel; ``heads / tp`` rows of ``seq_len`` keys when materialized."""
    if keeps.attention == "flash":
        return 0.0
    return model.heads / layout.tp * work.seq_len


def _widths(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """A tp rank's query width and key (value) width."""
    tp = layout.tp
    return model.q_width / tp, model.kv_width / tp


def cp_saved_elems_per_token(model: ModelSpec, layout: Layout) -> float:
    """Elements one block's context-parallel attention saves per local token under ``--ac
    none`` beyond the q, k, v and output counted without it (module docstring): the output
    projection's own copy of the output, and the gathered (``allgather``) or head-split
    (``alltoall``) keys and values; 0 without context parallelism."""
    if layout.cp == 1:
        return 0.0
    d, k = _widths(model, layout)
    if layout.cp_method == "allgather":  # the sequence's k, v at query heads, not the local
        return 2 * layout.cp * d - 2 * k + d
    if layout.cp_method == "ring":  # the local q, k, v and output, and the projection's copy
        return d
    return 3 * d - 2 * k  # alltoall: head-split q, k, v (expanded) and output, not local q, k, v


def cp_working_set(model: ModelSpec, layout: Layout, work: Workload) -> float:
    """Bytes one block's context-parallel attention adds while its backward runs, for one
    microbatch (module docstring): 0 without context parallelism."""
    if layout.cp == 1:
        return 0.0
    n, e = microbatch_tokens(layout, work), compute_bytes(work)
    d, k = _widths(model, layout)
    dq = n * d * 4  # the local queries' fp32 gradient accumulator
    if layout.cp_method == "allgather":  # fp32 accumulators of the gathered k, v, their grad
        return dq + n * layout.cp * 2 * d * (4 + e)
    if layout.cp_method == "ring":  # two k, v blocks and two fp32 gradient accumulators
        return dq + 2 * (2 * n * k) * (e + 4)
    return n * 4 * d * e  # alltoall: gradients of the head-split q, k, v, output


def routed_elems_per_token(model: ModelSpec, layout: Layout, ac: str | None = None) -> float:
    """Elements a MoE block's routed experts save per token of the rank under ``ac``
    (default: the layout's; module docstring), plait's count: per routed row, the expert's
    input and SwiGLU (``none``; ``selective``: its matmul outputs) for the rank's tp chunk
    of the rows, and (``none``) the gathered output of every row; 0 under ``full``."""
    d, h, rows, tp = model.d_model, model.expert_hidden, model.top_k, routed_tp(layout)
    mode = ac or layout.ac
    if mode == "none":
        return rows * (d + 4 * h) / tp + rows * d
    if mode == "selective":
        return rows * (2 * h + d) / tp
    return 0.0


def activation_elems_per_token(
    model: ModelSpec,
    layout: Layout,
    ac: str | None = None,
    *,
    moe: bool = False,
    keeps: Keeps | None = None,
) -> float:
    """Elements one block saves per token under ``ac`` (default: the layout's), per rank:
    a dense block, or with ``moe`` a mixture-of-experts block (module docstring), as
    ``keeps`` (default: the layout's recipe) counts them; attention probabilities apart
    (:func:`scores_elems_per_token`)."""
    d, f, tp = model.d_model, model.ffn_hidden, layout.tp
    q, k = model.q_width, model.kv_width
    norm = tp if layout.sequence_parallel and tp > 1 else 1
    mode = ac or layout.ac
    shared = model.expert_hidden * model.shared_experts
    kind = (keeps or recipe_keeps(layout)).activations
    megatron = kind == "megatron"
    if kind == "torchtitan" and mode == "selective" and not moe:
        # torchtitan's per-op policy: the block's input, every other matmul's output (wq,
        # wv, w1, w2), the attention kernel's output.
        return d / norm + q / tp + k / tp + q / tp + f / tp + d / norm
    if megatron and mode == "selective":
        mode = "none"  # recomputes core attention only, which flash attention saves nothing of
    if mode == "none":
        swiglu = 3 if megatron else 4  # Megatron's fused SwiGLU saves its input, not silu's
        mlp = (swiglu if model.gated else 2) * f / tp
        if moe:
            mlp = (
                2 * model.experts + 4 * shared / tp + routed_elems_per_token(model, layout, "none")
            )
        cp = cp_saved_elems_per_token(model, layout)
        kv = 2 * k
        if kind == "plait" and _plait_llama(model) and k < q:
            kv = 2 * q  # plait's Llama repeats k, v to the query heads before attention
            if layout.cp > 1 and layout.cp_method != "ring":
                cp -= (kv - 2 * k) / tp  # their expanded (not local) k, v are counted there
        linear_inputs = 2 * d / norm if megatron else 2 * d  # saved split, or all-gathered
        return 2 * d / norm + linear_inputs + (q + kv) / tp + q / tp + mlp + cp
    if mode == "selective":
        mlp = (2 if model.gated else 1) * f / tp + d
        if moe:
            kept_shared = 2 * shared / tp + d if shared else 0.0
            mlp = model.experts + kept_shared + routed_elems_per_token(model, layout, mode)
        return d / norm + (q + 2 * k) / tp + d + mlp
    if mode == "full":
        return d / norm
    raise ValueError(f"--ac {mode}: the planner models none, selective and full")


def _plait_llama(model: ModelSpec) -> bool:
    """Whether ``model`` is a Llama-family model (SwiGLU, RMSNorm, no learned positions) as
    plait's own recipe runs it (:class:`plait.train.llama.Llama`)."""
    return model.gated and not model.norm_bias and not model.positions


def rms_norm_bytes(
    model: ModelSpec, layout: Layout, element: int, keeps: Keeps | None = None
) -> float:
    """Bytes per token one block's RMSNorms save under ``--ac none`` in plait's recipe of
    a Llama beyond what :func:`activation_elems_per_token` counts (module docstring): the
    fp32 copy of each block norm's input (plait's RMSNorm computes in fp32), and with
    ``qk_norm`` the per-head norms' fp32 copies and normalized outputs (``element`` bytes)
    of q and k; 0 for other models and recipes."""
    if (keeps or recipe_keeps(layout)).activations != "plait" or not _plait_llama(model):
        return 0.0
    sp = layout.sequence_parallel and layout.tp > 1
    block_norms = 2 * 4 * model.d_model / (layout.tp if sp else 1)
    if not model.qk_norm:
        return block_norms
    return block_norms + (model.q_width + model.kv_width) / layout.tp * (4 + element)


def rank_memory(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    load: RankLoad,
    keeps: Keeps | None = None,
) -> MemoryBreakdown:
    """The memory of pipeline rank ``load`` (module docstring), under ``keeps`` (default:
    the layout's recipe, :func:`recipe_keeps`)."""
    keeps = keeps or recipe_keeps(layout)
    blocks_scale = 1.0  # the share of its blocks an end stage keeps (``end_stage_fewer``)
    if keeps.end_stage_fewer and layout.pp > 1 and (load.embedding or load.head):
        fewer = min(keeps.end_stage_fewer, load.layers - 1)
        blocks_scale = (load.layers - fewer) / load.layers
        load = dataclasses.replace(load, layers=load.layers - fewer)
    e = compute_bytes(work)
    bf16 = work.precision == "bf16"
    ds, tp = fsdp_ranks(layout), layout.tp
    zero = zero_stage(layout)
    p = rank_params(model, layout, load)
    # fully_shard's buffers and rank 0's shards, padded per parameter to ds rows (shards.py)
    padded = padded_params(model, layout, load)
    sharded = padded.total / ds
    n = microbatch_tokens(layout, work)
    pipelined = layout.pp > 1
    sp = layout.sequence_parallel and tp > 1
    # Norm inputs live in the residual stream: fp32 under plait's autocast (no fully_shard),
    # else e (a model kept in the compute dtype: fully_shard's cast, ZeRO, Megatron-LM).
    autocast = bf16 and ds == 1 and not zero
    e_res = 4 if autocast and keeps.activations != "megatron" else e

    resharded = 0.0  # blocks' gathered parameters not alive at the loss (resharded)
    if ds > 1:
        gathered_blocks = load.layers if (pipelined or not layout.reshard_after_forward) else 2
        unsharded = (padded.root + padded.largest_blocks(gathered_blocks)) * e
        if gathered_blocks == 2 and keeps.resharded_at_loss:
            resharded = padded.largest_blocks(2) * e
    elif autocast:  # autocast's cache: a bf16 copy of every matrix, forward to backward
        head = model.vocab * model.d_model / tp if load.head else 0.0
        # Not of the routed experts: they multiply slices of their stacked weights, which
        # autocast does not cache (it caches leaf parameters only).
        moe_cached = p.moe_matmul - p.routed_matmul
        matrices = p.dense_blocks * p.dense_matmul + p.moe_blocks * moe_cached
        unsharded = (matrices + head) * 2
    else:
        unsharded = 0.0

    norm_part = model.d_model / (tp if sp else 1) * (1 if layout.ac != "none" else 2)

    scores = scores_elems_per_token(model, layout, work, keeps)

    rms_fp32 = rms_norm_bytes(model, layout, e, keeps)

    def saved_bytes(moe: bool) -> float:  # one block, one token
        per_token = activation_elems_per_token(model, layout, moe=moe, keeps=keeps)
        kept_scores = scores if layout.ac == "none" else 0.0  # else recomputed
        norms = norm_part * e_res + (rms_fp32 if layout.ac == "none" else 0.0)
        return (per_token - norm_part + kept_scores) * e + norms

    # The stage's dense blocks and MoE blocks (the dense ones lead: see shards.py).
    stage_dense = min(p.dense_blocks, load.stage_layers)
    kinds = [(False, stage_dense), (True, load.stage_layers - stage_dense)]
    kinds = [(moe, count) for moe, count in kinds if count]
    per_microbatch = n * sum(saved_bytes(moe) * count for moe, count in kinds) * blocks_scale
    block_bytes = max(saved_bytes(moe) for moe, _ in kinds)  # the largest block
    if pipelined and not load.head and keeps.stage_output:
        # A stage's output is the root its backward starts from: kept until then.
        per_microbatch += n * model.d_model / (tp if sp else 1) * e_res
    activations = per_microbatch * load.in_flight

    extra: dict[str, float] = {}
    if load.head:
        v = model.vocab / tp
        if keeps.loss == "fused_ce":  # the logits of each microbatch in flight, one gradient
            extra["logits"] = n * v * e * (max(load.head_in_flight, 1) + 1)
        else:
            # The backward's two fp32 gradients beside the held logits, or (forward) the
            # compute-dtype logits and their fp32 copy (also tp's loss_parallel backward's).
            if keeps.logits_held:  # backward: two fp32 gradients beside the logits
                at_loss = e + 8 if tp == 1 else e + 4  # (loss_parallel's: one)
            else:  # the forward's logits and fp32 copy (none of fp32 logits), or backward's
                at_loss = max(e + (4 if e < 4 else 0), 8 if tp == 1 else 4)
            extra["logits"] = n * v * (4 * max(load.head_in_flight, 1) + at_loss)
        extra["logits"] += n * model.d_model * (e_res / (tp if sp else 1) + e)  # ln_f, head in
    if layout.ac != "none":
        full = max(
            activation_elems_per_token(model, layout, "none", moe=m, keeps=keeps) for m, _ in kinds
        )
        extra["recompute"] = n * ((full + scores) * e + rms_fp32)
    attention = cp_working_set(model, layout, work)
    if attention:
        extra["cp_attention"] = attention
    accumulating = pipelined or layout.microbatches > 1
    if ds > 1 and accumulating and not keeps.sharded_accumulation:
        extra["accumulated_grads"] = p.gathered * 4  # of the rank's ep shard of experts

    # The block's unsharded gradients (autograd's, unpadded) and its fp32 reduce-scatter
    # input (padded).
    buffers = p.block * e + padded.block * 4 if ds > 1 else 0.0
    grads = 4 * sharded
    params, optimizer = 4 * sharded, 4 * keeps.moments * sharded
    if zero:  # module docstring: ZeRO
        z = zero_ranks(layout)
        params = e * p.total  # replicated, in the compute dtype
        master = 4 if e < 4 else 0  # the moments and an fp32 master copy
        optimizer = (4 * keeps.moments + master) * p.total / z
        grads = 4 * p.total / (z if zero == 2 else 1)
        buffers = p.block * 4 if zero == 2 else 0.0  # one block's bucket, then scattered
    # Backward frees activations as it makes gradients, so not everything peaks together.
    # Gradients are dropped after each step (``zero_grad(set_to_none=True)``) and exist
    # from the step's first backward on (accumulated: unsharded under fully_shard, the
    # gradients themselves otherwise). The peak is the largest of: the first backward's
    # start (the most microbatches in flight, the logits' saved values); a later moment
    # with the accumulated gradients (the most in flight from then on); a block's
    # backward (the activations below it, its own or their recomputation, the gradients
    # flowing through it, and the previous block's fp32 reduce-scatter input, still in
    # flight: not under a pipeline, which reduces after its last backward; the block's own
    # unsharded gradients appear as its activations go); the end (gradients, staging).
    held = extra.get("accumulated_grads", grads if accumulating else 0.0)
    if zero:  # the gradient buffer lives across steps (it is zeroed, not freed)
        held = grads
    logits = extra.get("logits", 0.0)
    one_block = n * block_bytes  # one block's saved activations, one microbatch
    # Inside a block's backward, gradients of activations: the output's (whole sequence
    # once tensor parallelism gathered it) and the MLP's hidden one.
    hidden = model.ffn_hidden / tp
    if rms_fp32:  # plait's SwiGLU: the product's, silu's, up's and gate's gradients
        hidden *= 3
    if p.moe_blocks:  # the routed rows' gradients (gathered) and their experts' hidden ones
        routed = model.top_k * (model.d_model + model.expert_hidden / routed_tp(layout))
        hidden = max(hidden, routed + model.expert_hidden * model.shared_experts / tp)
    flowing = n * (model.d_model + hidden) * e
    after = per_microbatch * load.in_flight_after_backward
    below = (  # a block's backward: the activations below it, its own or their recomputation
        per_microbatch * max(load.in_flight_after_backward, 1)
        - one_block
        + extra.get("recompute", one_block)
        + held
        + (0.0 if (pipelined and not keeps.sharded_accumulation) or ds == 1 else padded.block * 4)
        + (p.block * 4 if zero == 2 else 0.0)
    )
    # Its attention's backward runs after its MLP's: the MLP's saved values and hidden
    # gradient are gone, the output's gradient flows in beside the attention's working set.
    mlp_saved = n * (4 if model.gated else 2) * model.ffn_hidden / tp * e
    in_attention = n * model.d_model * e + attention - mlp_saved
    moments = (
        activations + logits + (held if zero else 0.0) - resharded,
        after + logits + held - resharded,
        below + max(flowing, in_attention),
        (0.0 if zero else grads) + buffers + held,
    )
    counted = activations + logits + extra.get("recompute", 0.0) + grads + buffers
    counted += 0.0 if zero else held  # under ZeRO, held is grads: counted once
    counted += attention
    extra["not_at_peak"] = max(moments) - counted
    if pipelined:  # send / receive buffers live through the whole step
        buffers += 2 * n * model.d_model / (tp if sp else 1) * e
    if p.moe_blocks and layout.ep > 1:  # one all-to-all's send and receive buffers
        extra["dispatch"] = 2 * moe_rows(model, layout, work) * model.d_model * e
    return MemoryBreakdown(
        params=params,
        grads=grads,
        optimizer=optimizer,
        unsharded=unsharded,
        activations=activations,
        buffers=buffers,
        extra=extra,
    )


def peak_memory(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    shape: PipelineShape,
    keeps: Keeps | None = None,
) -> MemoryBreakdown:
    """The memory of the pipeline rank of ``shape`` that needs the most."""
    return max((rank_memory(model, layout, work, r, keeps) for r in shape.ranks), key=_total)


def first_rank_memory(model: ModelSpec, layout: Layout, work: Workload) -> MemoryBreakdown:
    """The memory of pipeline rank 0 (the one a pipelined dry run measures:
    :func:`plait.plan.dryrun.pipeline_step`), whether or not it needs the most.
    ValueError for a layout plait's schedules refuse, or where another rank's load
    dominates rank 0's (its load is then not among the shape's ranks)."""
    shape = pipeline_shape(
        model.layers, layout.pp, layout.schedule, layout.stages_per_rank, layout.microbatches
    )
    loads = [r for r in shape.ranks if r.rank == 0]
    if not loads:
        raise ValueError("pipeline rank 0 holds less than another rank: not reported")
    return rank_memory(model, layout, work, loads[0])


def _total(m: MemoryBreakdown) -> float:
    return m.total


def predict_memory(
    model: ModelSpec,
    layout: Layout,
    work: Workload,
    device: DeviceSpec | None = None,
    *,
    keeps: Keeps | None = None,
) -> MemoryBreakdown:
    """Peak bytes of the rank that needs the most under ``layout`` (module docstring).

    ``device`` is accepted for symmetry with the other predictions and not used: memory
    does not depend on the device. ``keeps``: what the recipe keeps (default: the
    layout's, :func:`recipe_keeps`). ValueError for a layout plait's schedules refuse.
    """
    del device
    return peak_memory(model, layout, work, layout_shape(model, layout), keeps)
