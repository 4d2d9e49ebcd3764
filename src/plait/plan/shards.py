"""What one rank holds and processes: its parameter elements before ``fully_shard``
divides them, the tokens of one microbatch, the bytes of one compute element.

Tensor parallelism (plait's plan, :mod:`plait.train.parallelize`) splits each block's
matrices and column-wise biases ``tp`` ways and keeps its norms and row-wise biases whole;
it splits the token embedding and the head by vocabulary, and the learned positions by
position under sequence parallelism. ``fully_shard`` then divides what is left
``dp_shard x cp`` ways (:func:`fsdp_ranks`): one unit per block, and the root unit
(embeddings, final norm, head).

Mixture-of-experts blocks (plait's recipe, :mod:`plait.train.parallelize`): tensor
parallelism splits the attention and the shared experts and leaves the router whole (every
tp rank routes the whole sequence alike); expert parallelism gives each ``ep`` rank ``E /
ep`` whole experts; ``fully_shard`` shards those over ``efsdp = dp_shard x cp / ep`` as a
parameter group of their own in the block's unit, the rest of the block over ``dp_shard x
cp``. So a rank *stores* ``1 / (dp_shard x cp)`` of all experts (as of the dense
parameters) but *gathers* only its ``E / ep`` experts when the block runs.

Under tensor parallelism (``tp`` > 1) with ``fully_shard`` (``dp_shard x cp`` > 1,
:attr:`plait.layout.Layout.splits_routed_rows`) the routed experts split the *rows*, not
their matrices (:func:`routed_tp`): the ``n k`` routed rows of a block (sorted by expert,
the same on every tp rank) are cut into ``tp`` equal chunks, tp rank ``j`` runs chunk
``j`` through its experts (with ``ep`` > 1 dispatched over the ep ranks of its tp index)
and the chunks' outputs are all-gathered over tp. So a rank computes ``1 / tp`` of the
routed FLOPs (:func:`moe_rows`: ``n k / tp`` rows) but still gathers its ``E / ep``
experts whole; their states are sharded over ``efsdp x tp`` ranks
(:func:`expert_fsdp_ranks`; with ``ep`` 1 a group of their own too, over ``dp_shard x cp
x tp``), whose reduce-scatter sums the chunks' gradients, so it stores ``1 / (dp_shard x
cp x tp)`` of them. Without ``fully_shard`` (``dp_shard x cp`` 1; ZeRO, which plait train
does not run) every tp rank computes all the routed rows and holds the experts whole.
plait also falls back to the replicated computation when ``n k`` is not divisible by
``tp``; the planner does not model that case (it takes the rows as divisible).

Padding (:func:`shard_padding`): plait's ``fully_shard`` (as torch's) shards every
parameter on dim 0 in ``torch.chunk`` layout over its ``ws`` ranks, so rank 0 holds
``ceil(dim0 / ws)`` rows (the most of any rank), and a unit's all-gather output and
reduce-scatter input hold ``ws x ceil(dim0 / ws)`` rows of each parameter: a matrix of
fewer rows than ranks, or of rows not divisible by them, is padded. :func:`padded_params`
scales each unit's elements by its factor (``sum ceil(dim0 / ws) ws rest / sum dim0
rest`` over its parameters, after tensor parallelism's split); the routed experts'
stacked weights are sharded on a dim ``ws`` divides where one does
(:func:`plait.layout.expert_shard_dim`), unpadded then. Only plait's and torchtitan's
recipes shard so (:func:`pads_shards`); ZeRO's and Megatron-LM's flat buffers are not
padded per tensor.

Which blocks are dense: the model's first ``dense_layers``, on the rank that holds the
embeddings (exact without interleaved stages, or when they fit the first stage; other
ranks are taken as all MoE, which can only overstate them).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from plait.layout import expert_shard_dim
from plait.plan.models import ParamCounts, param_counts
from plait.plan.schedule import RankLoad
from plait.plan.spec import Layout, ModelSpec, Workload, recipe, zero_stage

__all__ = [
    "PADDED_RECIPES",
    "RankParams",
    "ShardPadding",
    "compute_bytes",
    "expert_fsdp_ranks",
    "experts_apart",
    "fsdp_ranks",
    "microbatch_tokens",
    "moe_rows",
    "padded_params",
    "pads_shards",
    "rank_params",
    "routed_rows",
    "routed_tp",
    "shard_padding",
]


@dataclass(frozen=True)
class RankParams:
    """Elements one rank holds per tensor-parallel shard (not yet divided by dp_shard).

    A dense model has only ``dense`` blocks. In a mixture of experts, ``moe`` is what
    ``fully_shard`` shards over ``dp_shard`` of one MoE block and ``experts`` the routed
    experts of the rank's ep shard (``E / ep`` of them), which it shards over ``efsdp``
    (under tensor parallelism over ``efsdp x expert_tp``: :func:`expert_fsdp_ranks`).
    """

    dense: float  # one block with a dense MLP (a fully_shard unit)
    dense_blocks: int
    root: float  # the root unit: embeddings, final norm, head (what this stage holds of them)
    dense_matmul: float = 0.0  # a dense block's matrices after tp: elements per token (FLOPs)
    moe: float = 0.0  # one MoE block without its routed experts
    moe_blocks: int = 0
    experts: float = 0.0  # one MoE block's routed experts on this rank's ep shard (E / ep)
    moe_matmul: float = 0.0  # matrix elements one token goes through in a MoE block
    routed_matmul: float = 0.0  # of moe_matmul: the routed experts' (top_k x expert / tp)
    expert: float = 0.0  # one routed expert's elements
    ep: int = 1
    expert_tp: int = 1  # tp ranks that shard the routed experts' states besides efsdp

    @property
    def blocks(self) -> int:
        return self.dense_blocks + self.moe_blocks

    @property
    def moe_unit(self) -> float:
        """One MoE block as ``fully_shard`` gathers it: its own part and its ep shard's
        experts."""
        return self.moe + self.experts

    @property
    def block(self) -> float:
        """The largest unit the rank gathers (its working set and staging buffers)."""
        dense = self.dense if self.dense_blocks else 0.0
        return max(dense, self.moe_unit if self.moe_blocks else 0.0)

    @property
    def block_matmul(self) -> float:
        """Matrix elements per token of an average block of the rank (for FLOPs)."""
        if not self.blocks:
            return 0.0
        total = self.dense_blocks * self.dense_matmul + self.moe_blocks * self.moe_matmul
        return total / self.blocks

    @property
    def sharded_blocks(self) -> float:
        """The blocks' elements ``fully_shard`` shards over ``dp_shard``."""
        return self.dense_blocks * self.dense + self.moe_blocks * self.moe

    @property
    def expert_total(self) -> float:
        """The routed experts the rank gathers over all its blocks (over ``efsdp``)."""
        return self.moe_blocks * self.experts

    @property
    def total(self) -> float:
        """Elements stored, before ``dp_shard x cp`` divides them: all ``E`` experts of each
        MoE block count, since the ``ep x efsdp = dp_shard x cp`` ranks split them (and,
        under tensor parallelism, ``expert_tp`` more: the tp ranks shard them too)."""
        experts = self.expert_total * self.ep / self.expert_tp
        return self.sharded_blocks + experts + self.root

    @property
    def gathered(self) -> float:
        """Elements the rank's units hold unsharded (its ep shard of the experts only)."""
        return self.sharded_blocks + self.expert_total + self.root

    def largest_blocks(self, count: int) -> float:
        """Elements of the ``count`` largest units gathered together."""
        sizes = [self.moe_unit] * self.moe_blocks + [self.dense] * self.dense_blocks
        return sum(sorted(sizes, reverse=True)[:count])


def rank_params(model: ModelSpec, layout: Layout, load: RankLoad) -> RankParams:
    """What pipeline rank ``load`` holds of ``model`` under ``layout``'s tensor and expert
    parallelism (module docstring)."""
    c: ParamCounts = param_counts(model)
    tp = layout.tp
    sp = layout.sequence_parallel and tp > 1
    root = 0.0
    if load.embedding:
        root += c.embedding / tp + c.positions / (tp if sp else 1)
    if load.head:
        root += c.final_norm + c.head / tp
    dense = RankParams(
        dense=c.block_split / tp + c.block_replicated,
        dense_blocks=load.layers,
        root=root,
        dense_matmul=c.block_split / tp,
    )
    if not model.experts:
        return dense
    dense_blocks = min(model.dense_layers, load.layers) if load.embedding else 0
    # The router runs whole on every tp rank; the k experts of a token on one tp rank only
    # (its chunk of the routed rows: module docstring).
    routed = c.top_k * c.expert / routed_tp(layout)
    return dataclasses.replace(
        dense,
        dense_blocks=dense_blocks,
        moe=c.moe_split / tp + c.moe_replicated,
        moe_blocks=load.layers - dense_blocks,
        experts=c.experts * c.expert / layout.ep,
        moe_matmul=c.moe_split / tp + c.router + routed,
        routed_matmul=routed,
        expert=c.expert,
        ep=layout.ep,
        expert_tp=routed_tp(layout),  # fully_shard shards the experts over efsdp x tp
    )


def routed_tp(layout: Layout) -> int:
    """The tp ranks that split a MoE block's routed rows among them (module docstring):
    ``tp`` under ``fully_shard`` (each runs its chunk of ``1 / tp`` of them), else 1 (every
    tp rank computes all of them). plait computes them replicated too when the rank's ``n
    k`` rows do not divide by ``tp``: not modelled (taken as divisible)."""
    return layout.tp if layout.splits_routed_rows and fsdp_ranks(layout) > 1 else 1


def expert_fsdp_ranks(layout: Layout) -> int:
    """The ranks ``fully_shard`` shards the routed experts of one ep rank over: ``efsdp``,
    times ``tp`` where tp splits their rows (:func:`routed_tp`; module docstring); with
    ``ep`` 1 and ``tp`` 1 that is ``dp_shard x cp`` (:func:`fsdp_ranks`), the block's own
    group. 1 without ``fully_shard``."""
    if fsdp_ranks(layout) == 1:
        return 1
    return layout.efsdp * routed_tp(layout)


def experts_apart(layout: Layout) -> bool:
    """Whether the routed experts are a ``fully_shard`` parameter group of their own (on
    the ``efsdp`` collectives): under expert parallelism, or when tensor parallelism
    shards them over ``efsdp x tp``; else they join the block's group over ``dp_shard x
    cp``."""
    return fsdp_ranks(layout) > 1 and (layout.ep > 1 or routed_tp(layout) > 1)


def routed_rows(model: ModelSpec, layout: Layout, work: Workload) -> float:
    """Rows one rank routes to experts per MoE block and microbatch: each token of the
    microbatch ``top_k`` times (the rank's whole share of the sequence on every tp rank; 0
    for a dense model). Tensor parallelism all-gathers the experts' outputs of these rows
    (and in backward their inputs' gradients)."""
    return microbatch_tokens(layout, work) * model.top_k if model.experts else 0.0


def moe_rows(model: ModelSpec, layout: Layout, work: Workload) -> float:
    """Rows one rank runs through the routed experts per MoE block and microbatch: its tp
    chunk, ``1 / tp`` of :func:`routed_rows` (module docstring); what it dispatches by
    all-to-all under expert parallelism."""
    return routed_rows(model, layout, work) / routed_tp(layout)


def microbatch_tokens(layout: Layout, work: Workload) -> float:
    """Tokens of one microbatch on one rank: its data-parallel rank's sequences, of which
    context parallelism leaves each of its ``cp`` ranks ``seq_len / cp`` tokens (the cp
    ranks of a data-parallel rank share its batch)."""
    return work.global_batch / layout.dp / layout.microbatches * work.seq_len / layout.cp


def fsdp_ranks(layout: Layout) -> int:
    """The ranks ``fully_shard`` shards parameters over and reduces gradients over:
    ``dp_shard x cp`` (the cp ranks hold the same parameters and different tokens, as the
    dp_shard ranks do; torchtitan's ``dp_shard_cp``). 1 under ZeRO (a
    :class:`~plait.plan.spec.PlanLayout` with ``zero``): its parameters are replicated,
    and it shards optimizer state over ``dp_replicate x cp`` instead
    (:func:`~plait.plan.spec.zero_ranks`)."""
    return 1 if zero_stage(layout) else layout.dp_shard * layout.cp


def compute_bytes(work: Workload) -> int:
    """Bytes of one element in the compute dtype (activations, gathered parameters)."""
    return 2 if work.precision == "bf16" else 4


#: The recipes whose ``fully_shard`` pads each parameter's dim 0 to a multiple of its
#: shard group (module docstring, "Padding").
PADDED_RECIPES = ("plait", "torchtitan")


def pads_shards(layout: Layout) -> bool:
    """Whether ``layout``'s parameters are sharded per tensor on dim 0 with padding: under
    ``fully_shard`` (:func:`fsdp_ranks` > 1) in one of :data:`PADDED_RECIPES`."""
    return fsdp_ranks(layout) > 1 and recipe(layout) in PADDED_RECIPES


@dataclass(frozen=True)
class ShardPadding:
    """Per unit, the padded elements of ``fully_shard``'s buffers over the elements
    themselves (1.0: none; module docstring, "Padding"): a dense block, a MoE block without
    its routed experts, the routed experts, the root unit (what the rank holds of it)."""

    dense: float = 1.0
    moe: float = 1.0
    experts: float = 1.0
    root: float = 1.0


def _factor(shapes: list[tuple[int, int]], ws: int) -> float:
    """``sum ceil(dim0 / ws) ws rest / sum dim0 rest`` over ``(dim0, rest)`` shapes."""
    total = sum(rows * rest for rows, rest in shapes)
    if not total or ws <= 1:
        return 1.0
    return sum(-(-rows // ws) * ws * rest for rows, rest in shapes) / total


def _attention_shapes(model: ModelSpec, tp: int) -> list[tuple[int, int]]:
    """A block's attention and norms after tp, as ``(dim0, rest)``: q, k, v column-wise
    (their output rows split), the output projection row-wise (``d`` rows, its columns
    split); biases as ``param_counts`` counts them; norms (and q / k norms) whole."""
    d, q, kv = model.d_model, model.q_width // tp, model.kv_width // tp
    shapes = [(q, d), (kv, d), (kv, d), (d, q)]
    if model.bias:  # q, k, v biases split, the output projection's whole
        shapes += [(q, 1), (kv, 1), (kv, 1), (d, 1)]
    shapes += [(d, 1)] * (4 if model.norm_bias else 2)
    if model.qk_norm:
        shapes += [(model.dim_head, 1)] * 2
    return shapes


def _block_shapes(model: ModelSpec, tp: int) -> list[tuple[int, int]]:
    """A dense block's parameters after tp (:func:`_attention_shapes`, and the MLP: gate
    and up, or fc, column-wise; down, or proj, row-wise)."""
    d, f = model.d_model, model.ffn_hidden // tp
    mlp = [(f, d), (f, d), (d, f)] if model.gated else [(f, d), (d, f)]
    if model.bias:  # the first linear's bias split, the row-wise one's whole
        mlp += [(f, 1), (d, 1)]
    return _attention_shapes(model, tp) + mlp


def _moe_shapes(model: ModelSpec, tp: int) -> list[tuple[int, int]]:
    """A MoE block without its routed experts after tp: attention, the shared experts (w1,
    w3 column-wise, w2 row-wise) and the router's gate (``E`` rows, whole)."""
    d, shared = model.d_model, model.expert_hidden * model.shared_experts // tp
    shapes = _attention_shapes(model, tp) + [(model.experts, d)]
    if shared:
        shapes += [(shared, d), (shared, d), (d, shared)]
    return shapes


def _root_shapes(
    model: ModelSpec, tp: int, sp: bool, embedding: bool, head: bool
) -> list[tuple[int, int]]:
    """What a rank holds of the root unit after tp (its ``embedding``, its ``head``): the
    token embedding (vocabulary rows split), learned positions (split under sequence
    parallelism ``sp``), the final norm and the head (vocabulary rows split; absent when
    tied)."""
    d = model.d_model
    shapes: list[tuple[int, int]] = []
    if embedding:
        shapes.append((model.vocab // tp, d))
        if model.positions:
            shapes.append((model.positions // (tp if sp else 1), d))
    if head:
        shapes += [(d, 1)] * (2 if model.norm_bias else 1)
        if not model.tied:
            shapes.append((model.vocab // tp, d))
    return shapes


def shard_padding(model: ModelSpec, layout: Layout, load: RankLoad) -> ShardPadding:
    """Each unit's padding factor under ``layout`` (module docstring, "Padding"): blocks
    and the root over :func:`fsdp_ranks`, the routed experts over
    :func:`expert_fsdp_ranks` (1 where a dim of ``(E / ep, d, h)`` divides by it: plait
    shards them on that dim); all 1 where :func:`pads_shards` is false."""
    if not pads_shards(layout):
        return ShardPadding()
    sp = layout.sequence_parallel and layout.tp > 1
    experts = (expert_fsdp_ranks(layout), layout.ep) if model.experts else (1, 1)
    ends = (load.embedding, load.head)
    return _padding(model, fsdp_ranks(layout), layout.tp, sp, experts, ends)


@functools.lru_cache(maxsize=4096)
def _padding(
    model: ModelSpec, ws: int, tp: int, sp: bool, experts: tuple[int, int], ends: tuple[bool, bool]
) -> ShardPadding:
    """:func:`shard_padding` of ``ws`` ranks, the routed experts' ``(group, ep)`` and the
    root's ``(embedding, head)`` (cached: the search asks for few distinct ones)."""
    routed = 1.0
    if model.experts:  # padded only where no dim of (E / ep, d, h) divides by the group
        g, stacked = experts[0], (model.experts // experts[1], model.d_model, model.expert_hidden)
        dim = expert_shard_dim(stacked, g)
        routed = _factor([(stacked[dim], 1)], g)
    return ShardPadding(
        dense=_factor(_block_shapes(model, tp), ws),
        moe=_factor(_moe_shapes(model, tp), ws) if model.experts else 1.0,
        experts=routed,
        root=_factor(_root_shapes(model, tp, sp, *ends), ws),
    )


def padded_params(model: ModelSpec, layout: Layout, load: RankLoad) -> RankParams:
    """:func:`rank_params` with each unit's elements scaled by its :func:`shard_padding`:
    the sizes of ``fully_shard``'s all-gather outputs and reduce-scatter inputs, and,
    divided by :func:`fsdp_ranks`, of rank 0's shards (its matmul counts unchanged)."""
    p, pad = rank_params(model, layout, load), shard_padding(model, layout, load)
    if pad == ShardPadding():
        return p
    return dataclasses.replace(
        p,
        dense=p.dense * pad.dense,
        moe=p.moe * pad.moe,
        experts=p.experts * pad.experts,
        root=p.root * pad.root,
    )
