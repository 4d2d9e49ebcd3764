"""Context parallelism: each sequence split over a ``cp`` mesh dimension, and attention
over the whole sequence computed exactly from the local shards, on CPU (gloo) and GPUs.

Layers, each importing only those before it: collectives (stateless: the cp group, a
sequence gather whose backward is a reduce-scatter, the Ulysses all-to-alls, a ring
shift) <- sequence (the plain and load-balanced layouts, ``shard_sequence`` /
``unshard_sequence`` / positions) <- masks (who may attend to whom, from global positions
and document ids) <- blocks (one key block's attention with its log-sum-exp, the exact
merge, one block's gradients) <- allgather, ring, ulysses (the three methods) <- attention
(``context_parallel_attention``, checks and dispatch) <- options (``set_rotate_method``,
``set_load_balance``, ``packed_documents``) <- mode (the ``TorchFunctionMode`` that routes
SDPA calls) <- api (torch's ``context_parallel``, ``context_parallel_unshard``), module
(``apply_context_parallel``).

The methods, all exact (fp32 matches one process attending over the whole sequence):

* ``"allgather"`` (torch's default): gather keys and values, attend local queries to
  them. Backward: the blocks' own, then the gather's backward, a reduce-scatter.
* ``"ring"``: key/value blocks go round the ring (``cp - 1`` point-to-point shifts,
  overlapped with compute), partial results merged by log-sum-exp. Backward: custom, the
  blocks go round again with their gradient accumulators.
* ``"alltoall"`` (Ulysses): all-to-all to a head split, attention over the whole
  sequence in natural order (SDPA's ``is_causal``), all-to-all back; the heads must divide
  by cp. Backward: autograd, the all-to-alls reversed.

None of them builds a mask of the sequence's size: attention runs as blocks through
SDPA's fused kernels that return the log-sum-exp (CPU:
``_scaled_dot_product_flash_attention_for_cpu``, CUDA:
``_scaled_dot_product_efficient_attention``), unmasked or causal on the diagonal, merged
exactly by log-sum-exp, and differentiated by the fused backward kernels given the merged
output and log-sum-exp (:mod:`plait.context.blocks`). Only blocks that packed documents
cut are masked, tile by tile. So activation memory per rank is linear in the local length
and falls as ``1 / cp``, less the gathered keys and values of allgather.

Applying it, in torch's vocabulary::

    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    with context_parallel(mesh["cp"], buffers=[tokens, labels, positions],
                          buffer_seq_dims=[1, 1, 1]):
        loss = loss_fn(model(tokens, positions), labels)   # model calls F.sdpa(..., is_causal=True)
        loss.backward()
    # gradients: all-reduce (sum) over cp as over data-parallel ranks (each cp rank's loss
    # covers its own tokens), e.g. fully_shard / replicate on a mesh spanning dp and cp.

or, for a model that shards its own inputs::

    apply_context_parallel(model, mesh["cp"], method="ring")
    local = shard_sequence(tokens, mesh["cp"], dim=1)
    loss = loss_fn(model(local, shard_sequence(positions, mesh["cp"], dim=1)), ...)
"""

from plait.context.api import context_parallel, context_parallel_unshard
from plait.context.attention import METHODS, Method, context_parallel_attention
from plait.context.mode import ContextParallelMode, UnsupportedAttention
from plait.context.module import ContextParallelState, apply_context_parallel
from plait.context.options import packed_documents, set_load_balance, set_rotate_method
from plait.context.sequence import (
    SequenceLayout,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "METHODS",
    "ContextParallelMode",
    "ContextParallelState",
    "Method",
    "SequenceLayout",
    "UnsupportedAttention",
    "apply_context_parallel",
    "context_parallel",
    "context_parallel_attention",
    "context_parallel_unshard",
    "packed_documents",
    "sequence_positions",
    "set_load_balance",
    "set_rotate_method",
    "shard_sequence",
    "unshard_sequence",
]
