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

Which blocks are dense: the model's first ``dense_layers``, on the rank that holds the
embeddings (exact without interleaved stages, or when they fit the first stage; other
ranks are taken as all MoE, which can only overstate them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plait.plan.models import ParamCounts, param_counts
from plait.plan.schedule import RankLoad
from plait.plan.spec import Layout, ModelSpec, Workload, zero_stage

__all__ = [
    "RankParams",
    "compute_bytes",
    "expert_fsdp_ranks",
    "experts_apart",
    "fsdp_ranks",
    "microbatch_tokens",
    "moe_rows",
    "rank_params",
    "routed_rows",
    "routed_tp",
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
    return layout.tp if fsdp_ranks(layout) > 1 else 1


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
