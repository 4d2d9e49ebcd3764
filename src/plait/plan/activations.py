"""What one block saves for backward, per token of one rank: the ``activations`` part of
:mod:`plait.plan.memory`, and the working set of context-parallel attention.

Saved activations per token of one block (``d`` width, ``k`` the width of k and of v,
``f`` the MLP width; ``/tp`` where tensor parallelism splits heads or the MLP; norm inputs
``/tp`` under sequence parallelism only; linear inputs whole, since torch's tensor
parallelism saves the all-gathered input), as plait's recipe counts them (other recipes:
:mod:`plait.plan.keeps`):

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
(``extra["dispatch"]`` of :mod:`plait.plan.memory`).

Context parallelism (``cp`` ranks, :mod:`plait.context`) divides every per-token part by
``cp`` through the tokens of a microbatch, and its attention adds what
:mod:`plait.context` keeps per block. No method builds a mask (blocks run through SDPA's
fused kernels, unmasked or causal on the diagonal; only packed documents take tile-sized
masks, and ``plait train`` packs none), and every method returns its output as ``(batch,
heads, tokens, head dim)``, so the output projection's input is a copy of it (``d / tp``
beside the output):

* ``allgather``: the fused blocks' backward saves the whole sequence's keys and values,
  expanded to the query heads (``2 cp d / tp`` per local token, in place of the local
  ``2 k / tp``), the local q, the output and its log-sum-exp;
* ``ring``: the local q, k, v, the output and its log-sum-exp (its custom backward sends
  the key/value blocks round again);
* ``alltoall``: SDPA saves the head-split q and the expanded k, v (``3 d / tp`` per local
  token in place of ``(d + 2 k) / tp``) and its output beside the returned one.

The log-sum-exps (fp32, one per query head and token) are not counted, as without
context parallelism (attention's per-row statistics are not modelled).

Those are saved under ``--ac none``; under checkpointing they are rebuilt per block
(``recompute``). The working set of one block's attention in backward
(:func:`cp_working_set`, ``extra["cp_attention"]``): the fp32 gradient accumulators of
the local queries and of the gathered, expanded keys and values and the gathered gradient
in the compute dtype (``allgather``), the gradients of the head-split q, k, v and output
(``alltoall``), or the local queries' fp32 accumulator with two travelling key/value
blocks and their two fp32 gradient accumulators (``ring``). It is alive while the block's
attention runs backward, after its MLP's backward has freed the MLP's saved values and
hidden gradient.

plait's Llama (``"plait"`` recipe, a gated model without learned positions:
:class:`plait.train.llama.Llama`): without context parallelism k and v are repeated to
the query heads before attention, which saves them so (``2 q / tp`` in place of ``2 k /
tp``, ``q`` the query width ``heads x head_dim``; under it they reach
:mod:`plait.context` grouped, ``LlamaAttention.repeat_kv``); each RMSNorm (computed in
fp32) saves an fp32 copy of its input beside its output, and Qwen3's per-head q and k
norms their fp32 copies and outputs (:func:`rms_norm_bytes`).
"""

from __future__ import annotations

from plait.plan.keeps import Keeps, recipe_keeps
from plait.plan.shards import compute_bytes, microbatch_tokens, routed_tp
from plait.plan.spec import Layout, ModelSpec, Workload

__all__ = [
    "activation_elems_per_token",
    "cp_saved_elems_per_token",
    "cp_working_set",
    "rms_norm_bytes",
    "routed_elems_per_token",
    "scores_elems_per_token",
]


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
        if kind == "plait" and _plait_llama(model) and k < q and layout.cp == 1:
            kv = 2 * q  # plait's Llama repeats k, v to the query heads before attention
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
