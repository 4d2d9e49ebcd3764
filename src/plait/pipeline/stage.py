"""``PipelineStage``: one stage of a manually split model, as a schedule runs it.

A stage owns a module and, for the microbatches of the current step, everything between
its actions: activations received and waiting for their forward, outputs waiting to be
sent, saved graphs waiting for their backward, input gradients waiting to be sent, weight
gradients waiting for ``W``. The runtime (:mod:`plait.pipeline.runtime`) calls its
methods in schedule order; each method names the stage and microbatch when something is
missing, so a bad schedule fails with a message instead of a hang.

Contract:

* The first stage's forward takes the microbatch's positional arguments; every other
  stage takes the tensors the previous stage returned (a tensor, or a tuple / list of
  tensors), as positional arguments. Keyword arguments of ``step`` go to every stage.
* Shapes and dtypes between stages need not be declared: they are exchanged at the first
  step and again whenever they change (see :mod:`plait.pipeline.p2p`). ``input_args`` /
  ``output_args``, if given, are checked (dtype, and shape apart from the batch dimension
  0) against what actually arrives / leaves, and a mismatch raises an error naming the
  stage and microbatch.
* ``output_chunks`` (torch's): on the last stage, each microbatch's output of the step
  (detached, in the order the forwards ran; none with ``return_outputs=False``), kept
  until the next step starts, as in torch.
* Backward sends one gradient per output that requires grad (zeros where the next stage
  did not use an input), so neither end needs metadata for it.
* ``dw_builder`` (torch's): a callable returning a function that finishes the weight
  gradients of one microbatch. With it, ``I`` runs a full backward and ``W`` calls that
  function; without it, plait splits the autograd graph (:mod:`plait.pipeline.backward`).

The constructor takes torch 2.13's arguments in torch's order. ``output_grads`` /
``input_grads`` (torch: static gradient metadata, for DTensor stages) are accepted for
compatibility and have nothing to do in plait, by design: a gradient's shape, dtype and
layout are those of the forward tensor it belongs to, which both ends of a link already
know, so nothing needs declaring.

``get_mesh`` (torch's, torchtitan's): ``get_mesh(mesh_dim_names, mesh_layout)`` returns the
device mesh on which received DTensor activations are rebuilt. plait needs it only when
the receiving stage holds no DTensor parameter or buffer on a mesh of those dimensions
(it looks there first) and calls it with ``mesh_layout=None``. A DTensor output crosses
a stage boundary as its local tensor and arrives as a DTensor with the same placements
(:mod:`plait.pipeline.dtensors`); its gradient flows back the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from plait.pipeline.backward import (
    backward_full,
    backward_input,
    backward_weight,
)
from plait.pipeline.dtensors import MeshResolver, to_local
from plait.pipeline.p2p import (
    ActivationRecv,
    Direction,
    GradientRecv,
    Meta,
    P2PBatch,
    meta_of,
    transfer_tag,
)

__all__ = ["PipelineStage"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass
class _Saved:
    """A forward waiting for its backward: the graph's roots and the stage inputs."""

    roots: list[torch.Tensor]  # outputs that require grad (the loss on the last stage)
    inputs: list[torch.Tensor]  # received activations that require grad
    root_grads: list[torch.Tensor] = field(default_factory=list)


class PipelineStage:
    """One stage of a pipeline: ``submodule`` is this rank's part of the model.

    ``stage_index`` / ``num_stages`` place it in the pipeline; ``group`` is the pipeline
    group (default: the world), whose ranks the schedule maps stages onto; ``device`` is
    where received tensors are allocated. See the module docstring for the contract.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str | int,
        input_args: Any = None,
        output_args: Any = None,
        output_grads: Any = None,
        input_grads: Any = None,
        group: dist.ProcessGroup | None = None,
        dw_builder: Callable[[], Callable[..., None]] | None = None,
        get_mesh: Callable[..., Any] | None = None,
    ) -> None:
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"PipelineStage needs an nn.Module, got {type(submodule).__name__}")
        if not 0 <= stage_index < num_stages:
            raise ValueError(
                f"stage_index {stage_index} is out of range for a pipeline of {num_stages} "
                f"stages (0..{num_stages - 1})"
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "PipelineStage needs an initialised process group: call "
                "torch.distributed.init_process_group() first (torchrun sets up the environment)"
            )
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group: dist.ProcessGroup = group if group is not None else _world()
        self.group_rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.dw_builder = dw_builder
        self.get_mesh = get_mesh
        self._meshes = MeshResolver(submodule, get_mesh)  # for DTensors received
        del output_grads, input_grads  # known from the forward outputs (module docstring)
        self.has_backward = True  # torch's flag; the schedule's order decides here
        self._declared_in = _declared(input_args)
        self._declared_out = _declared(output_args)
        self.prev_peer: int | None = None  # global ranks of remote neighbours
        self.next_peer: int | None = None
        self.prev_local: PipelineStage | None = None  # neighbours on this rank
        self.next_local: PipelineStage | None = None
        # Per microbatch, kept across steps: the activation metadata agreed with each
        # neighbour, apart for training and eval steps (whose tensors differ in
        # requires_grad), so that alternating them changes nothing on the wire.
        self._agreed: dict[bool, tuple[dict[int, Meta], dict[int, Meta]]] = {}
        self._sent_meta, self._received_meta = self._agreed.setdefault(True, ({}, {}))
        # torch's: the last stage's output of each microbatch, in the order the forwards
        # ran, without graph (detached); kept from one step's start to the next's.
        self.output_chunks: list[Any] = []
        self._clear_step()

    def __repr__(self) -> str:
        return (
            f"PipelineStage({self.stage_index} of {self.num_stages}, group rank {self.group_rank})"
        )

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _name(self, microbatch: int | None = None) -> str:
        where = f"stage {self.stage_index}"
        return where if microbatch is None else f"{where}, microbatch {microbatch}"

    # --- placement -------------------------------------------------------------------------

    def attach(self, rank_of_stage: Sequence[int], local: Mapping[int, PipelineStage]) -> None:
        """Find the neighbours: ``rank_of_stage[s]`` is stage s's rank in the pipeline group
        and ``local`` holds every stage of this rank. Raises ValueError if this stage is
        not placed on this rank."""
        s = self.stage_index
        if rank_of_stage[s] != self.group_rank:
            raise ValueError(
                f"{self._name()} belongs on pipeline rank {rank_of_stage[s]} under this "
                f"schedule's placement, but this is pipeline rank {self.group_rank}: build "
                f"stages {[i for i, r in enumerate(rank_of_stage) if r == self.group_rank]} "
                "here"
            )
        self.prev_local = local.get(s - 1)
        self.next_local = local.get(s + 1)
        self.prev_peer = self.next_peer = None
        if not self.is_first and self.prev_local is None:
            self.prev_peer = dist.get_global_rank(self.group, rank_of_stage[s - 1])
        if not self.is_last and self.next_local is None:
            self.next_peer = dist.get_global_rank(self.group, rank_of_stage[s + 1])

    # --- step lifecycle --------------------------------------------------------------------

    def _clear_step(self) -> None:
        # From a local stage, for F; computed, waiting to be sent: tensors and metadata.
        self._inputs: dict[int, tuple[list[torch.Tensor], Meta]] = {}
        self._outputs: dict[int, tuple[list[torch.Tensor], Meta]] = {}
        self._saved: dict[int, _Saved] = {}  # forward graphs waiting for B / I
        self._output_grads: dict[int, list[torch.Tensor]] = {}  # from a local stage
        self._input_grads: dict[int, list[torch.Tensor]] = {}  # computed, waiting to be sent
        self._weight_work: dict[int, Callable[[], None]] = {}  # waiting for W
        self._activation_recvs: dict[int, ActivationRecv] = {}  # posted, waited for by F
        self._gradient_recvs: dict[int, GradientRecv] = {}  # posted, waited for by B / I

    def begin_step(self, training: bool | None = None) -> None:
        """Forget whatever a failed previous step left behind, and the previous step's
        ``output_chunks`` (as torch, which clears them when a step starts). ``training``:
        whether the step runs backwards (None: as the last one), which selects the
        activation metadata agreed for such steps."""
        self._clear_step()
        self.output_chunks.clear()
        if training is not None:
            self._sent_meta, self._received_meta = self._agreed.setdefault(training, ({}, {}))

    def clear_runtime_states(self) -> None:
        """torch's name: forget the per-step state (what :meth:`begin_step` does)."""
        self.begin_step()

    def end_step(self) -> None:
        """Raise RuntimeError if the step left work undone (an incomplete schedule)."""
        left: dict[str, dict[int, Any]] = {
            "activations of the previous stage never used": self._inputs,
            "outputs never sent": self._outputs,
            "forwards without backward": self._saved,
            "gradients of the next stage never used": self._output_grads,
            "input gradients never sent": self._input_grads,
            "weight gradients never computed (W)": self._weight_work,
            "activations received but never used": self._activation_recvs,
            "gradients received but never used": self._gradient_recvs,
        }
        problems = [f"{what}: microbatches {sorted(d)}" for what, d in left.items() if d]
        self._clear_step()
        if problems:
            raise RuntimeError(f"{self._name()} finished the step with " + "; ".join(problems))

    # --- forward ---------------------------------------------------------------------------

    def forward_one_chunk(
        self, microbatch: int, args: tuple[Any, ...], kwargs: dict[str, Any], *, save: bool
    ) -> Any:
        """Run the module on this microbatch; returns its raw output.

        ``args`` are used by the first stage only; other stages take what was received.
        With ``save`` the graph is kept for the backward actions.
        """
        leaves: list[torch.Tensor] = []  # received tensors: the graph's inputs
        if self.is_first:
            inputs = list(args)
        else:
            leaves, meta = self._received_inputs(microbatch)
            layouts = [m.layout for m in meta]
            inputs = self._meshes.rebuild(leaves, layouts, self._name(microbatch))
            self._check_declared(inputs, self._declared_in, microbatch, "input")
        output = self.submod(*inputs, **kwargs)
        outputs = self._as_tensors(output, microbatch)
        self._check_declared(outputs, self._declared_out, microbatch, "output")
        if not self.is_last:
            outputs = self._hand_on(microbatch, outputs)
        if save:
            self._saved[microbatch] = _Saved(
                roots=[o for o in outputs if o.requires_grad],
                inputs=[x for x in leaves if x.requires_grad],
            )
        return output

    def _hand_on(self, microbatch: int, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Give ``outputs`` to the next stage on this rank, or keep them for SEND_F.

        Returns the tensors that leave: DTensors as their local tensors, which become the
        graph's roots, their layouts kept in the metadata (:mod:`plait.pipeline.dtensors`).
        """
        local, layouts = to_local(outputs)
        meta = meta_of(local, layouts)
        if self.next_local is not None:
            self.next_local._meshes.remember(outputs)
            self.next_local._inputs[microbatch] = ([_leaf(o) for o in local], meta)
        else:
            self._outputs[microbatch] = (local, meta)  # until SEND_F
        return local

    def _received_inputs(self, microbatch: int) -> tuple[list[torch.Tensor], Meta]:
        """The tensors received for ``microbatch`` (leaves) and their metadata."""
        if self.prev_local is not None:
            return self._take(self._inputs, microbatch, "the previous stage's forward (F)")
        recv = self._take(self._activation_recvs, microbatch, "its input activations (RECV_F)")
        meta, tensors = recv.wait()
        if meta != self._received_meta.get(microbatch):
            logger.debug("%s: new input metadata %s", self._name(microbatch), _describe(meta))
        self._received_meta[microbatch] = meta
        leaves = [t.requires_grad_(m.requires_grad) for t, m in zip(tensors, meta, strict=True)]
        return leaves, meta

    def _as_tensors(self, output: Any, microbatch: int) -> list[torch.Tensor]:
        if self.is_last:
            return [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)]
        items = list(output) if isinstance(output, (tuple, list)) else [output]
        bad = [type(x).__name__ for x in items if not isinstance(x, torch.Tensor)]
        if bad:
            raise TypeError(
                f"{self._name(microbatch)}: a stage that is not the last must return a tensor "
                f"or a tuple of tensors (they are sent to the next stage), got {bad}"
            )
        return items

    def _check_declared(
        self, tensors: list[torch.Tensor], declared: Meta | None, microbatch: int, what: str
    ) -> None:
        if declared is None:
            return
        actual = meta_of(tensors)
        ok = len(actual) == len(declared) and all(
            a.dtype == d.dtype and a.shape[1:] == d.shape[1:]
            for a, d in zip(actual, declared, strict=True)
        )
        if not ok:
            raise RuntimeError(
                f"{self._name(microbatch)}: {what}s {_describe(actual)} do not match the "
                f"declared {what}_args {_describe(declared)} (dtype and all dims but the "
                f"batch dim 0 must agree); fix {what}_args or leave it None to let plait "
                "discover shapes"
            )

    def seed_loss(self, microbatch: int, loss: torch.Tensor, scale: float) -> None:
        """Last stage: backward starts from ``loss * scale`` instead of the outputs."""
        if loss.numel() != 1:
            raise ValueError(
                f"{self._name(microbatch)}: loss_fn must return a scalar, got shape "
                f"{tuple(loss.shape)}"
            )
        saved = self._saved[microbatch]
        saved.roots = [loss] if loss.requires_grad else []
        saved.root_grads = [torch.full_like(loss, scale)] if loss.requires_grad else []

    # --- backward --------------------------------------------------------------------------

    def backward_one_chunk(self, microbatch: int, *, full: bool) -> None:
        """``B`` (``full``) or ``I``: the input gradients, and with ``B`` the weights'."""
        saved = self._take(self._saved, microbatch, "its forward (F)")
        if not self.is_last:
            saved.root_grads = self._received_output_grads(microbatch)
        if full or self.dw_builder is not None:
            grads = backward_full(saved.roots, saved.root_grads, saved.inputs)
            if self.dw_builder is not None:
                runner = self.dw_builder()
                if full:
                    runner()
                else:
                    self._weight_work[microbatch] = runner
        else:
            grads, work = backward_input(saved.roots, saved.root_grads, saved.inputs)
            self._weight_work[microbatch] = partial(backward_weight, work)
        if not self.is_first:
            input_grads = [
                torch.zeros_like(x) if g is None else g
                for x, g in zip(saved.inputs, grads, strict=True)
            ]
            if self.prev_local is not None:
                self.prev_local._output_grads[microbatch] = input_grads
            else:
                self._input_grads[microbatch] = input_grads  # until SEND_B

    def _received_output_grads(self, microbatch: int) -> list[torch.Tensor]:
        if self.next_local is not None:
            return self._take(self._output_grads, microbatch, "the next stage's backward (B / I)")
        return self._take(self._gradient_recvs, microbatch, "its output gradients (RECV_B)").wait()

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """``W``: the weight gradients that ``I`` left for microbatch ``bwd_chunk_id``.

        Raises AssertionError (torch's type) if its ``I`` half, ``backward_one_chunk``
        with ``full=False``, has not run. ``last_backward`` is torch's and has no use
        here: gradient reduction is the schedule's ``REDUCE_GRAD`` action."""
        del last_backward
        if bwd_chunk_id not in self._weight_work:
            raise AssertionError(
                f"{self._name(bwd_chunk_id)}: backward_weight_one_chunk (W) was called "
                "before backward_one_chunk(full=False) (I) computed this microbatch's input "
                "gradients: run the I half first"
            )
        self._weight_work.pop(bwd_chunk_id)()

    # --- communication ---------------------------------------------------------------------

    def send_activations(self, microbatch: int, batch: P2PBatch) -> None:
        assert self.next_peer is not None
        outputs, meta = self._take(self._outputs, microbatch, "its forward (F) before SEND_F")
        tag = transfer_tag(self.stage_index, microbatch, Direction.FORWARD, self.num_stages)
        agreed = self._sent_meta.get(microbatch)
        owner = self._transfer("activations", self.stage_index, microbatch)
        self._sent_meta[microbatch] = batch.send_activations(
            outputs, agreed, self.next_peer, tag, owner, meta
        )

    def recv_activations(self, microbatch: int, batch: P2PBatch) -> None:
        assert self.prev_peer is not None
        tag = transfer_tag(self.stage_index - 1, microbatch, Direction.FORWARD, self.num_stages)
        agreed = self._received_meta.get(microbatch)
        owner = self._transfer("activations", self.stage_index - 1, microbatch)
        self._activation_recvs[microbatch] = batch.recv_activations(
            agreed, self.prev_peer, tag, owner
        )

    def send_gradients(self, microbatch: int, batch: P2PBatch) -> None:
        assert self.prev_peer is not None
        grads = self._take(self._input_grads, microbatch, "its backward (B / I) before SEND_B")
        tag = transfer_tag(self.stage_index, microbatch, Direction.BACKWARD, self.num_stages)
        owner = self._transfer("gradients", self.stage_index, microbatch)
        batch.send_gradients(grads, self.prev_peer, tag, owner)

    def can_recv_gradients(self, microbatch: int) -> bool:
        """Whether RECV_B can be posted: its buffers take the forward outputs' shapes."""
        return microbatch in self._saved

    def recv_gradients(self, microbatch: int, batch: P2PBatch) -> None:
        assert self.next_peer is not None
        saved = self._saved.get(microbatch)
        if saved is None:
            raise RuntimeError(
                f"{self._name(microbatch)}: RECV_B before the forward (F) whose output "
                "gradients it receives"
            )
        meta = meta_of(saved.roots)  # gradients: the outputs' shapes and dtypes
        tag = transfer_tag(self.stage_index + 1, microbatch, Direction.BACKWARD, self.num_stages)
        owner = self._transfer("gradients", self.stage_index + 1, microbatch)
        self._gradient_recvs[microbatch] = batch.recv_gradients(meta, self.next_peer, tag, owner)

    def send_abort(self, forward: bool, microbatch: int, key: int, batch: P2PBatch) -> int | None:
        """Queue an abort in place of this stage's SEND_F (``forward``) or SEND_B of
        ``microbatch``, sized as the peer's posted receive; ``key`` says where the reason
        is (:mod:`plait.pipeline.p2p`).
        Returns the peer's global rank, or None when the neighbour is on this rank or
        expects no message."""
        peer = self.next_peer if forward else self.prev_peer
        if peer is None:
            return None
        direction = Direction.FORWARD if forward else Direction.BACKWARD
        tag = transfer_tag(self.stage_index, microbatch, direction, self.num_stages)
        owner = "abort of " + self._transfer(
            "activations" if forward else "gradients", self.stage_index, microbatch
        )
        if forward:
            agreed = self._sent_meta.get(microbatch)
            batch.send_abort(key, peer, tag, agreed, agreed is None, owner)
            return peer
        # The peer's gradient buffer holds its outputs that require grad: the inputs this
        # stage last received for the microbatch (unknown before the first: header only).
        received = self._received_meta.get(microbatch)
        expected = None if received is None else tuple(m for m in received if m.requires_grad)
        if expected is not None and not expected:
            return None  # no gradients flow back on this link: the peer waits for nothing
        batch.send_abort(key, peer, tag, expected, False, owner)
        return peer

    @staticmethod
    def _transfer(what: str, sender: int, microbatch: int) -> str:
        """Names a transfer in error reports: "gradients of pipeline stage 1 microbatch 3"."""
        return f"{what} of pipeline stage {sender} microbatch {microbatch}"

    def _take(self, store: dict[int, _T], microbatch: int, what: str) -> _T:
        if microbatch not in store:
            raise RuntimeError(
                f"{self._name(microbatch)}: the action needs {what}, which has not run for this "
                "microbatch in this step (is the schedule complete and in order?)"
            )
        return store.pop(microbatch)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """The next stage's input: same storage, a fresh leaf (each stage has its own graph)."""
    return t.detach().requires_grad_(t.requires_grad)


def _declared(example: Any) -> Meta | None:
    if example is None:
        return None
    leaves = [x for x in tree_flatten(example)[0] if isinstance(x, torch.Tensor)]
    return meta_of(leaves)


def _describe(meta: Meta) -> str:
    return "[" + ", ".join(f"{m.dtype} {list(m.shape)}" for m in meta) + "]"


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    return group
