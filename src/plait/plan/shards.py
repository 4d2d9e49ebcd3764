"""What one rank holds and processes: its parameter elements before ``fully_shard``
divides them, the tokens of one microbatch, the bytes of one compute element.

Tensor parallelism (plait's plan, :mod:`plait.train.parallelize`) splits each block's
matrices and column-wise biases ``tp`` ways and keeps its norms and row-wise biases whole;
it splits the token embedding and the head by vocabulary, and the learned positions by
position under sequence parallelism. ``fully_shard`` then divides what is left
``dp_shard`` ways: one unit per block, and the root unit (embeddings, final norm, head).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.models import ParamCounts, param_counts
from plait.plan.schedule import RankLoad
from plait.plan.spec import Layout, ModelSpec, Workload

__all__ = ["RankParams", "compute_bytes", "microbatch_tokens", "rank_params"]


@dataclass(frozen=True)
class RankParams:
    """Elements one rank holds per tensor-parallel shard (not yet divided by dp_shard)."""

    block: float  # one block (a fully_shard unit)
    block_matmul: float  # of which matrices split by tp (for FLOPs)
    blocks: int  # blocks this rank holds
    root: float  # the root unit: embeddings, final norm, head (what this stage holds of them)

    @property
    def total(self) -> float:
        return self.blocks * self.block + self.root


def rank_params(model: ModelSpec, layout: Layout, load: RankLoad) -> RankParams:
    """What pipeline rank ``load`` holds of ``model`` under ``layout``'s tensor parallelism."""
    c: ParamCounts = param_counts(model)
    tp = layout.tp
    sp = layout.sequence_parallel and tp > 1
    root = 0.0
    if load.embedding:
        root += c.embedding / tp + c.positions / (tp if sp else 1)
    if load.head:
        root += c.final_norm + c.head / tp
    return RankParams(
        block=c.block_split / tp + c.block_replicated,
        block_matmul=c.block_split / tp,
        blocks=load.layers,
        root=root,
    )


def microbatch_tokens(layout: Layout, work: Workload) -> float:
    """Tokens of one microbatch on one data-parallel rank."""
    return work.global_batch / layout.dp / layout.microbatches * work.seq_len


def compute_bytes(work: Workload) -> int:
    """Bytes of one element in the compute dtype (activations, gathered parameters)."""
    return 2 if work.precision == "bf16" else 4
