"""What one rank holds and processes: its parameter elements before ``fully_shard``
divides them, the tokens of one microbatch, the bytes of one compute element.

Tensor parallelism (plait's plan, :mod:`plait.train.parallelize`) splits each block's
matrices and column-wise biases ``tp`` ways and keeps its norms and row-wise biases whole;
it splits the token embedding and the head by vocabulary, and the learned positions by
position under sequence parallelism. ``fully_shard`` then divides what is left
``dp_shard x cp`` ways (:func:`fsdp_ranks`): one unit per block, and the root unit
(embeddings, final norm, head).

Mixture-of-experts blocks (plait's recipe, :mod:`plait.train.parallelize`): tensor
parallelism splits the attention and the shared experts and leaves the router and the
routed experts whole (every tp rank routes the whole sequence alike); expert parallelism
gives each ``ep`` rank ``E / ep`` whole experts; ``fully_shard`` shards those over
``efsdp = dp_shard x cp / ep`` as a parameter group of their own in the block's unit, the
rest of the block over ``dp_shard x cp``. So a rank *stores* ``1 / (dp_shard x cp)`` of all
experts (as of the dense parameters) but *gathers* only its ``E / ep`` experts when the
block runs.

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
    "fsdp_ranks",
    "microbatch_tokens",
    "moe_rows",
    "rank_params",
]


@dataclass(frozen=True)
class RankParams:
    """Elements one rank holds per tensor-parallel shard (not yet divided by dp_shard).

    A dense model has only ``dense`` blocks. In a mixture of experts, ``moe`` is what
    ``fully_shard`` shards over ``dp_shard`` of one MoE block and ``experts`` the routed
    experts of the rank's ep shard (``E / ep`` of them), which it shards over ``efsdp``.
    """

    dense: float  # one block with a dense MLP (a fully_shard unit)
    dense_blocks: int
    root: float  # the root unit: embeddings, final norm, head (what this stage holds of them)
    dense_matmul: float = 0.0  # a dense block's matrices after tp: elements per token (FLOPs)
    moe: float = 0.0  # one MoE block without its routed experts
    moe_blocks: int = 0
    experts: float = 0.0  # one MoE block's routed experts on this rank's ep shard (E / ep)
    moe_matmul: float = 0.0  # matrix elements one token goes through in a MoE block
    expert: float = 0.0  # one routed expert's elements
    ep: int = 1

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
        MoE block count, since the ``ep x efsdp = dp_shard x cp`` ranks split them."""
        return self.sharded_blocks + self.expert_total * self.ep + self.root

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
    return dataclasses.replace(
        dense,
        dense_blocks=dense_blocks,
        moe=c.moe_split / tp + c.moe_replicated,
        moe_blocks=load.layers - dense_blocks,
        experts=c.experts * c.expert / layout.ep,
        # The router and the k experts run whole on every tp rank (module docstring).
        moe_matmul=c.moe_split / tp + c.router + c.top_k * c.expert,
        expert=c.expert,
        ep=layout.ep,
    )


def moe_rows(model: ModelSpec, layout: Layout, work: Workload) -> float:
    """Rows one rank routes to experts per MoE block and microbatch: each token of the
    microbatch ``top_k`` times (the rank's whole share of the sequence on every tp rank; 0
    for a dense model)."""
    return microbatch_tokens(layout, work) * model.top_k if model.experts else 0.0


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
