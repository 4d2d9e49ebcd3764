"""What one training step takes, and the token-weighted loss it computes.

A step takes a :class:`StepBatch` (:func:`step_batch`: this rank's share of a global batch,
its packed documents and the global count of loss tokens). The loss of a step is the
token-weighted mean over the whole global batch: the sum of the cross-entropies of every
target that is not ``IGNORE``, on every rank, divided by how many there are in the global
batch, so uneven loss tokens per row, microbatch or rank (chat answers) give the
gradients of one process on the whole batch, at any layout. Each rank's backward starts
from its own tokens' sum divided by that global count, times the number of ranks
``fully_shard`` / ``replicate`` average gradients over (:func:`gradient_ranks`:
``dp x cp``): their mean then is the global batch's gradient. Steppers
(:mod:`plait.train.step`, :mod:`plait.train.pipelined`) return this rank's
*contribution* (its tokens' loss sum over the global count; zero on ranks that compute no
loss: pipeline ranks without the last stage), which :func:`global_loss` sums into the loss
of the global batch.

Both steppers build on this module and it on neither, so the one with a pipeline and the
one without stay independent of each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait import spmd
from plait.context import shard_sequence
from plait.layout import CP, Layout
from plait.mesh import collective_device
from plait.train import packing
from plait.train.config import ExecutionConfig, TrainConfig
from plait.train.model import IGNORE, document_positions

__all__ = ["StepBatch", "global_loss", "global_loss_tensor", "gradient_ranks", "step_batch"]


@dataclass(frozen=True)
class StepBatch:
    """This rank's share of one global batch, as the steppers take it (on the device).

    ``inputs`` / ``targets`` ``(b, T_local)`` int64 (``targets`` ``IGNORE`` where no loss);
    with context parallelism ``T_local`` is this rank's tokens of each row, in the cp
    layout. ``documents`` / ``positions`` ``(b, T_local)``: each token's document index
    and its position in that document, computed on the whole rows and then sharded like
    the inputs; both None when no row holds several documents (the models' plain causal
    path). ``tokens``: the loss tokens (targets that are not ``IGNORE``) of the whole
    global batch, a 0-d int64 tensor on the device, at least 1. ``bounds`` ``(b, D + 1)``
    int32 and ``longest``: the rows' document boundaries and the longest document
    (:func:`plait.train.packing.document_bounds`, computed on the host, ``bounds`` moved
    with the rows), with which a GPU attends through flash's variable-length kernel; None
    and 0 without documents, with context parallelism (its attention is its own) and on a
    device without that kernel."""

    inputs: torch.Tensor
    targets: torch.Tensor
    documents: torch.Tensor | None
    positions: torch.Tensor | None
    tokens: torch.Tensor
    bounds: torch.Tensor | None = None
    longest: int = 0

    def model_kwargs(self) -> dict[str, Any]:
        """The models' keyword arguments for these rows (none for unpacked rows)."""
        if self.documents is None or self.positions is None:
            return {}
        kwargs: dict[str, Any] = {"documents": self.documents, "positions": self.positions}
        if self.bounds is not None:
            kwargs |= {"bounds": self.bounds, "longest": self.longest}
        return kwargs


def gradient_ranks(cfg: Layout | TrainConfig) -> int:
    """How many ranks ``fully_shard`` / ``replicate`` average each gradient over in the
    layout ``cfg``: the data-parallel ranks and, with ``--cp``, the context-parallel ones
    (each holds a share of its data-parallel rank's tokens). Every backward is scaled up by
    it, so that their mean is the sum the token-weighted loss needs."""
    return cfg.dp * cfg.cp


def _several_documents(documents: torch.Tensor) -> bool:
    """Whether some row holds more than one document (ids are non-decreasing per row)."""
    return bool((documents[:, -1] != documents[:, 0]).any())


def step_batch(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    documents: torch.Tensor,
    cfg: ExecutionConfig | TrainConfig,
    mesh: DeviceMesh | None,
    tokens: int | None = None,
) -> StepBatch:
    """This rank's :class:`StepBatch` from its data-parallel share of a global batch:
    ``inputs``, ``targets`` and ``documents`` ``(b, T)`` of whole rows (host tensors, as the
    data gives them). Positions in documents are computed on the whole rows; then every
    tensor is cut to this rank's tokens of each row (``--cp``: ``shard_sequence``) and moved
    to the device. Without ``--cp``, on a device with a variable-length attention kernel
    (:func:`plait.train.packing.varlen_kernel`), the rows' document boundaries are
    computed here too, on the host (:func:`plait.train.packing.document_bounds`): the
    forward then needs no device sync to attend through it (elsewhere nothing would read
    them). The global count of loss
    tokens is ``tokens`` when the caller knows it (data without masked targets), else one
    all-reduce of the local counts over the world (every rank calls this: a collective
    when there are several). ``cfg``: the execution group (layout, device,
    ``--compile``), or the whole TrainConfig."""
    docs: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    bounds: torch.Tensor | None = None
    longest = 0
    # Rows of one document each keep plain causal attention, unless --compile: there the
    # attention stays masked by document on every batch (one graph variant for the whole
    # run, as block-causal attention in torchtitan), so that the first batch of packed
    # documents compiles nothing new. Under --cp attention is not compiled.
    layout = cfg.layout
    if _several_documents(documents) or (cfg.compile and layout.cp == 1):
        docs, positions = documents, document_positions(documents)
        if layout.cp == 1 and packing.varlen_kernel(torch.device(cfg.device)) is not None:
            bounds, longest = packing.document_bounds(documents)
    if layout.cp > 1:  # this rank's tokens of every row (the model knows their places)
        assert mesh is not None
        group = mesh[CP]
        inputs, targets = (shard_sequence(t, group, dim=1) for t in (inputs, targets))
        if docs is not None and positions is not None:
            docs, positions = (shard_sequence(t, group, dim=1) for t in (docs, positions))
    count = (targets != IGNORE).sum() if tokens is None else torch.tensor(tokens)
    if tokens is None and dist.is_initialized() and dist.get_world_size() > 1:
        # Every rank counts its own tokens; the pp and tp ranks of one (dp, cp) rank hold
        # the same ones, so the world's sum counts each pp * tp times.
        world = dist.group.WORLD
        count = count.to(collective_device(world))
        spmd.record("all_reduce", count, world, "the loss tokens")
        spmd.wait(dist.all_reduce(count, group=world, async_op=True), "all_reduce of tokens")
        count = count // (layout.pp * layout.tp)
    device = cfg.device

    def moved(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return StepBatch(
        inputs.to(device),
        targets.to(device),
        moved(docs),
        moved(positions),
        count.clamp(min=1).to(device),  # a batch without loss tokens: loss and gradients 0
        moved(bounds),
        longest,
    )


def global_loss(local: torch.Tensor, cfg: Layout | TrainConfig) -> list[float]:
    """The global batch's loss from every rank's contribution ``local`` (one per batch:
    several batches cost one collective and one wait for the device), in the layout
    ``cfg``: :func:`global_loss_tensor`, read."""
    out: list[float] = global_loss_tensor(local, cfg).tolist()
    return out


def global_loss_tensor(local: torch.Tensor, cfg: Layout | TrainConfig) -> torch.Tensor:
    """:func:`global_loss` left on the device (float32, one per batch): queued, not read.
    The ``tp`` ranks of a data-parallel rank hold the same contribution (of the same
    tokens), so the sum over the world counts it ``tp`` times; pipeline ranks without the
    last stage contribute zero."""
    total = local.detach().float().reshape(-1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.group.WORLD
        total = total.to(collective_device(world)).clone()
        spmd.record("all_reduce", total, world, "the loss")
        spmd.wait(dist.all_reduce(total, group=world, async_op=True), "all_reduce of the loss")
    return total / cfg.tp
