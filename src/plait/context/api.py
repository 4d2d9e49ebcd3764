"""torch's context-parallel vocabulary: ``context_parallel`` (a context manager that
shards buffers in place and makes SDPA context-parallel inside it),
``context_parallel_unshard`` and ``set_rotate_method``, so code written for
``torch.distributed.tensor.experimental`` runs on plait by changing its imports.

Beyond torch: it runs on CPU (gloo) as on GPUs; ``method="ring"`` besides torch's two;
``load_balance`` to choose the layout per call; ``document_ids`` for packed sequences.
Where torch quietly falls back to the plain layout when a sequence does not split into
``2 * cp`` chunks (and then its causal attention is unbalanced), plait refuses with the
fix; and SDPA calls it cannot run exactly (an arbitrary ``attn_mask``, dropout) are
refused rather than computed wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from plait.context.attention import Method, check_method
from plait.context.collectives import cp_group
from plait.context.mode import ContextParallelMode, ModeScope
from plait.context.options import defaults, packed_documents
from plait.context.sequence import SequenceLayout, unshard_sequence
from plait.hooks import outside_graphs

__all__ = ["context_parallel", "context_parallel_unshard"]

_API = "context_parallel"


def _check_buffers(
    buffers: list[torch.Tensor],
    seq_dims: list[int],
    no_restore: set[torch.Tensor],
) -> None:
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"{_API}: buffer_seq_dims must give one dim per buffer: {len(buffers)} buffers, "
            f"{len(seq_dims)} dims"
        )
    for buffer in no_restore:
        if not any(b is buffer for b in buffers):  # identity: == would compare values
            raise ValueError(f"{_API}: no_restore_buffers must be a subset of buffers")
    for buffer in buffers:
        if isinstance(buffer, torch.nn.Parameter):
            raise ValueError(
                f"{_API}: buffers must not contain parameters (a {tuple(buffer.shape)} "
                "nn.Parameter was given): they are sharded in place"
            )


@contextlib.contextmanager
def context_parallel(
    mesh: DeviceMesh | dist.ProcessGroup,
    *,
    buffers: list[torch.Tensor] | None = None,
    buffer_seq_dims: list[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
    method: Method | None = None,
    load_balance: bool | None = None,
    document_ids: torch.Tensor | None = None,
) -> Iterator[None]:
    """Context parallelism over the 1-D ``mesh`` (the cp ranks) inside the ``with`` block.

    On entry every tensor of ``buffers`` (inputs, labels, position ids: the whole
    sequence, the same on every cp rank) is replaced in place by this rank's part along its
    ``buffer_seq_dims`` entry; on exit the buffers not in ``no_restore_buffers`` get their
    whole contents back. Inside, every ``scaled_dot_product_attention`` call attends this
    rank's queries over the whole sequence (run the backward inside too: activation-
    checkpointed blocks recompute their attention there).

    ``method`` (default: :func:`set_rotate_method`'s) is ``"allgather"``, ``"ring"`` or
    ``"alltoall"``; ``load_balance`` (default True, :func:`set_load_balance`) picks the
    layout (``plait.context.sequence``). ``document_ids`` ``(B, T)``: per-token document
    ids of packed sequences, whole (sharded here) or one of ``buffers`` (then already
    sharded); attention then stays inside each document.
    """
    buffers = [] if buffers is None else list(buffers)
    seq_dims = [] if buffer_seq_dims is None else list(buffer_seq_dims)
    no_restore = set() if no_restore_buffers is None else no_restore_buffers
    _check_buffers(buffers, seq_dims, no_restore)
    group = cp_group(mesh, _API)
    chosen = check_method(defaults().method if method is None else method)
    balanced = defaults().load_balance if load_balance is None else load_balance
    layout = SequenceLayout(dist.get_world_size(group), balanced)
    rank = dist.get_rank(group)
    with torch.no_grad():
        shards = [layout.shard(b, d % b.ndim, rank) for b, d in zip(buffers, seq_dims, strict=True)]
        originals = [None if b in no_restore else b.clone() for b in buffers]
        local_docs = document_ids
        if document_ids is not None and not any(b is document_ids for b in buffers):
            local_docs = layout.shard(document_ids, 1, rank)
        for buffer, shard in zip(buffers, shards, strict=True):
            buffer.resize_(shard.shape)
            buffer.copy_(shard)
    mode = ContextParallelMode(group, chosen, balanced)
    # Autograd runs backward without the mode; an activation-checkpointed block recomputes
    # its forward there, calling the block again: these hooks (on every module, while the
    # context is open) put the mode back around such calls.
    scope = ModeScope(mode)
    hooks = [
        register_module_forward_pre_hook(outside_graphs(scope.before)),
        register_module_forward_hook(outside_graphs(scope.after), always_call=True),
    ]
    try:
        with mode, packed_documents(local_docs):
            yield
    finally:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for buffer, original in zip(buffers, originals, strict=True):
                if original is not None:
                    buffer.resize_(original.shape)
                    buffer.copy_(original)


def context_parallel_unshard(
    mesh: DeviceMesh | dist.ProcessGroup,
    buffers: list[torch.Tensor],
    seq_dims: list[int],
    load_balance: bool | None = None,
) -> list[torch.Tensor]:
    """The whole sequences, in natural order, of tensors sharded by context parallelism
    (e.g. outputs or gradients), gathered from every cp rank along ``seq_dims``; not
    differentiable. ``load_balance`` (default: :func:`set_load_balance`'s) must be the
    layout they were sharded in. Every cp rank must call it."""
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"context_parallel_unshard: seq_dims must give one dim per buffer: "
            f"{len(buffers)} buffers, {len(seq_dims)} dims"
        )
    balanced = defaults().load_balance if load_balance is None else load_balance
    return [
        unshard_sequence(b, mesh, d, load_balance=balanced)
        for b, d in zip(buffers, seq_dims, strict=True)
    ]
