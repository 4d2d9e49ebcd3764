"""A head tied to the token embedding under a pipeline: two copies of one matrix, kept equal.

The pipeline split gives the first stage the embedding and the last stage the head, each
its own copy of the matrix they share in one process (``tie_word_embeddings``). The copies
start equal; after every step's backward :class:`TiedCopies` gives both the sum of their
gradients, which is the one-process gradient of the shared matrix (Megatron's embedding
group). With the same gradient, the same clipping factor and the same AdamW state, the
copies stay equal. The sum is an all-reduce of the copies' local pieces between the two
pipeline ranks holding them (the pipeline group at ``--pp 2``; for more, a group of just
the two per pipeline group); under ``fully_shard`` and tensor parallelism both are
DTensors laid out alike, on meshes whose ranks line up. With V-shaped schedules, whose
first and last stage are on one rank, it is a local addition.

Clipping counts the matrix once: the head's copy is left out of the norm
(:meth:`TiedCopies.duplicates`) and scaled by the same factor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plait import spmd
from plait.layout import Layout
from plait.mesh import collective_device
from plait.pipeline import schedule_spec, stage_to_rank
from plait.train.config import TrainConfig
from plait.train.parallelize import Stage

__all__ = ["TiedCopies"]


def _local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``param``'s gradient (zeros if it has none), to change in place:
    laid out as the parameter. (Tensor parallelism leaves the embedding's gradient
    replicated once its pending sum is done, the head's sharded by vocabulary like both
    weights: cut to this rank's rows, the two line up.)"""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor):
        if grad.placements != param.placements:
            grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
        return grad._local_tensor
    return grad


class TiedCopies:
    """The copies of a tied embedding and head among this rank's pipeline ``stages``
    (built after :func:`~plait.train.parallelize.parallelize`); ``cfg``: the run's layout
    (its pipeline and schedule), or the whole TrainConfig; ``group``: this rank's pipeline
    group. Collective: every rank builds one."""

    def __init__(
        self, stages: list[Stage], cfg: Layout | TrainConfig, group: dist.ProcessGroup
    ) -> None:
        self.emb: torch.Tensor | None = None
        self.head: torch.Tensor | None = None
        for stage in stages:
            if stage.is_first:
                assert stage.module.tok_emb is not None
                self.emb = stage.module.tok_emb.weight
            if stage.is_last:
                assert stage.module.head is not None
                self.head = stage.module.head.weight
        pp = cfg.pp
        style = schedule_spec(cfg.schedule).style
        first, last = (stage_to_rank(s, pp, style) for s in (0, cfg.n_stages - 1))
        #: Both copies on one rank (V-shaped schedules): summed there, no communication.
        self.local = first == last
        #: The group of the two pipeline ranks holding the copies (None on the others).
        self.pair: dist.ProcessGroup | None = None
        if self.local:
            return
        if pp == 2:
            self.pair = group
            return
        # The pipeline is the mesh's outermost dimension: pipeline rank p of the group of
        # ranks r, r + inner, ... is global rank p * inner + r. Collective: every rank
        # makes every pair's group.
        inner = dist.get_world_size() // pp
        ranks = dist.get_process_group_ranks(group)
        assert ranks == [p * inner + ranks[0] for p in range(pp)], ranks
        pairs = [[first * inner + r, last * inner + r] for r in range(inner)]
        self.pair, _ = dist.new_subgroups_by_enumeration(pairs)

    def duplicates(self) -> list[torch.Tensor]:
        """The copy to leave out of the gradient norm (it equals the embedding's): this
        rank's head copy, if it holds one."""
        return [self.head] if self.head is not None else []

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Give both copies the sum of their gradients (after the step's backward, before
        clipping). Collective over the two ranks holding the copies, unless they are one."""
        if self.local:
            if self.emb is not None and self.head is not None:
                emb, head = _local_grad(self.emb), _local_grad(self.head)
                emb.add_(head)
                head.copy_(emb)
            return
        mine = self.emb if self.emb is not None else self.head
        if mine is None or self.pair is None:  # a pipeline rank between the two
            return
        local = _local_grad(mine)
        buffer = local.detach().to(collective_device(self.pair), copy=True)
        spmd.record("all_reduce", buffer, self.pair, "the tied matrix's gradient")
        work = dist.all_reduce(buffer, group=self.pair, async_op=True)
        spmd.wait(work, "all_reduce of the tied matrix's gradient")
        local.copy_(buffer)
