"""Pipelines whose stages are tensor-parallel (PP x TP) train exactly like one process.

On a ``(pp, tp)`` mesh of 4 ranks, each pipeline rank's stage modules (cut from
``TinyGPT`` by ``split_model``, names unchanged) are tensor-parallelized over ``mesh["tp"]``
with torch's own ``parallelize_module``; plait's ``PipelineStage`` runs them over
``mesh["pp"]``. Both ranks of a tp group run the same stage, so their TP collectives match,
and each talks to the rank with the same tp coordinate on the neighbouring stage.

What crosses a stage boundary depends on the plan:

* without sequence parallelism, the full activation (a plain tensor, the same on every tp
  rank);
* with sequence parallelism, the rank's sequence shard (a plain local tensor);
* with ``use_local_output=False`` styles, a DTensor sharded on the sequence dimension,
  which plait sends as its local tensor and rebuilds with the same placements on the
  receiving stage's tp mesh; gradients flow back as DTensor gradients.

No shapes are declared anywhere: plait discovers them at the first step. The oracle is
``check_parity``: the reference is the whole model on one process and the global batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard
from tp_models import SEQ, TinyGPT, block_plan, lm_loss, token_batches

from plait.checkpoint import checkpoint
from plait.fsdp import MixedPrecisionPolicy, fully_shard
from plait.pipeline import (
    SCHEDULE_CLASSES,
    SCHEDULES,
    PipelineStage,
    split_model,
    stage_layers,
    stages_of_rank,
)
from plait.pipeline.dtensors import DTensorLayout, MeshResolver, encode_layout
from plait.pipeline.p2p import TensorMeta, decode_meta, encode_meta

from harness import run_on_ranks
from parity import StageModules, check_parity, default_step

N_BLOCKS, MICROBATCHES, BATCH, STEPS = 4, 4, 8, 3


def stage_plan(kept: list[str], *, sequence_parallel: bool, dtensor_out: bool) -> dict[str, Any]:
    """The TP plan of one stage module: ``tp_models``' plan restricted to the layers the
    stage keeps. ``dtensor_out`` (sequence parallel only) keeps activations DTensors from
    the embedding on, so what crosses every stage boundary is a DTensor."""
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {
        "embed": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=not dtensor_out
        ),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if not sequence_parallel:
        del top["norm"]  # the final norm runs on the full activation, not tensor-parallel
    plan: dict[str, Any] = {}
    for name in kept:
        if name.startswith("blocks."):
            styles = block_plan(sequence_parallel)
            if dtensor_out:
                for proj in ("attn.out", "mlp.fc2"):  # residual branches stay DTensors
                    styles[proj] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
            plan.update({f"{name}.{sub}": style for sub, style in styles.items()})
        elif name in top:
            plan[name] = top[name]
    return plan


def _schedule_step(schedules: dict[int, Any], autocast: bool = False) -> Any:
    """check_parity's step: the pipeline schedule for a parallel copy, plain for the
    reference. Ranks without the last stage report 0 (the loss is summed over pp)."""

    def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any) -> torch.Tensor:
        if id(model) not in schedules:
            return default_step(model, x, y, loss_fn)
        losses: list[torch.Tensor] = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # bf16 compute
            schedules[id(model)].step(x, target=y, losses=losses)
        return torch.stack(losses).mean() if losses else torch.zeros(())

    return step


def _received(args: tuple[Any, ...]) -> str:
    """A stage input as the tests check it: its type and local (per-rank) sequence length."""
    x = args[0]
    local = x.to_local() if isinstance(x, DTensor) else x
    return f"{type(x).__name__} seq {local.shape[1]}"


def _parallelize_stage(
    module: nn.Module,
    kept: list[str],
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    dtensor_out: bool,
    ckpt: bool,
    bf16: bool = False,
) -> None:
    """The usual composition order on one stage module: tensor parallelism over
    ``mesh["tp"]``, then checkpointed blocks, then ``fully_shard`` per block and on the
    stage root over ``mesh["dp_shard"]`` when the mesh has that dimension."""
    styles = stage_plan(kept, sequence_parallel=sequence_parallel, dtensor_out=dtensor_out)
    parallelize_module(module, mesh["tp"], styles)
    blocks = [module.get_submodule(name) for name in kept if name.startswith("blocks.")]
    if ckpt:
        for block in blocks:
            checkpoint(block)
    if "dp_shard" in (mesh.mesh_dim_names or ()):
        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
        for block in blocks:
            fully_shard(block, mesh=mesh["dp_shard"], mp_policy=mp)
        fully_shard(module, mesh=mesh["dp_shard"], mp_policy=mp)
        if sequence_parallel:  # then every parameter is TP'd: all are sharded on both dims
            meshes = {p.device_mesh.mesh_dim_names for p in module.parameters()}
            assert meshes == {("dp_shard", "tp")}, meshes


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _pp_tp_body(
    schedule: str,
    *,
    sequence_parallel: bool,
    dtensor_out: bool = False,
    ckpt: bool = False,
    dp: int = 1,
    bf16: bool = False,
) -> list[str]:
    """Parity of one PP x (DP x) TP layout; returns what the stages of this rank received.

    ``bf16`` (with ``dp``: fully_shard's bf16 compute, fp32 reductions; without, autocast
    around the schedule's step) is compared with
    the fp32 reference at bf16's tolerance: TP sums partial products in bf16 across ranks,
    so no single-process run does the same casts (test_fsdp_tp.py compares bf16 FSDP x TP
    with torch's, which does)."""
    if dp == 1:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (2, dp, 2), mesh_dim_names=("pp", "dp_shard", "tp"))
    pp_rank, pp_group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
    dp_rank = mesh["dp_shard"].get_local_rank() if dp > 1 else 0
    # Local losses are averaged over the ranks that hold different data or stages: all
    # ranks with this rank's tp coordinate (tp is innermost). The new groups are made on
    # every rank, in the same order.
    world = dist.get_world_size()
    same_tp = [dist.new_group([r for r in range(world) if r % 2 == t]) for t in range(2)]
    spec = SCHEDULES[schedule]
    n_stages = 2 * (spec.stages_per_rank or 2)
    schedules: dict[int, Any] = {}
    received: set[str] = set()

    def parallelize(model: nn.Module) -> nn.Module:
        plan = stage_layers(model, n_stages, layers="blocks")
        ids = stages_of_rank(pp_rank, 2, n_stages, spec.style)
        modules = split_model(model, plan, stages=ids)
        stages = []
        for s, module in zip(ids, modules, strict=True):
            _parallelize_stage(
                module,
                plan[s],
                mesh,
                sequence_parallel=sequence_parallel,
                dtensor_out=dtensor_out,
                ckpt=ckpt,
                bf16=bf16,
            )
            if s > 0:
                module.register_forward_pre_hook(lambda _m, args: received.add(_received(args)))
            stages.append(PipelineStage(module, s, n_stages, "cpu", group=pp_group))
        cls = SCHEDULE_CLASSES[schedule]
        sched = cls(stages[0] if len(stages) == 1 else stages, MICROBATCHES, lm_loss)
        wrapped = StageModules(modules)
        schedules[id(wrapped)] = sched
        return wrapped

    check_parity(
        lambda: TinyGPT(N_BLOCKS),
        parallelize,
        token_batches(STEPS, BATCH),
        loss_fn=lm_loss,
        step=_schedule_step(schedules, autocast=bf16 and dp == 1),
        data_rank=dp_rank,
        data_world=dp,
        loss_group=same_tp[dist.get_rank() % 2],
        # bf16: plain SGD, so a rounding difference moves a parameter by lr * itself (Adam
        # would turn it into a whole lr-sized step of the other sign).
        **({"atol": 1e-2, "rtol": 1e-2, "make_optimizer": _sgd} if bf16 else {}),
    )
    return sorted(received)


HALF, FULL = f"seq {SEQ // 2}", f"seq {SEQ}"


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_pp_tp_trains_like_one_process(schedule: str, sequence_parallel: bool) -> None:
    results = run_on_ranks(4, _pp_tp_body, schedule, sequence_parallel=sequence_parallel)
    # Ranks 2 and 3 (pp rank 1) hold later stages only: what they receive is a plain
    # tensor, the rank's sequence shard under sequence parallelism.
    assert results[2] == results[3] == [f"Tensor {HALF if sequence_parallel else FULL}"]


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_dtensor_activations_cross_stage_boundaries(schedule: str) -> None:
    """Stage outputs that stay DTensors (sequence-sharded) arrive as DTensors with the same
    placements on the next stage's tp mesh, and their gradients flow back as DTensor
    gradients. ZBVZeroBubble also hands a DTensor between two stages of one rank (V
    placement) and splits the backward into I and W."""
    results = run_on_ranks(4, _pp_tp_body, schedule, sequence_parallel=True, dtensor_out=True)
    assert results[2] == results[3] == [f"DTensor {HALF}"]


def test_pp_tp_in_bf16() -> None:
    """bf16 compute (autocast; no fully_shard to cast) over tensor-parallel stages."""
    results = run_on_ranks(4, _pp_tp_body, "1F1B", sequence_parallel=True, bf16=True)
    assert results[2] == [f"Tensor {HALF}"]


def test_pp_tp_with_activation_checkpointing() -> None:
    results = run_on_ranks(4, _pp_tp_body, "Interleaved1F1B", sequence_parallel=True, ckpt=True)
    assert results[2] == [f"Tensor {HALF}"]


def test_pp_dp_tp_on_8_ranks_with_fully_shard() -> None:
    """pp 2 x dp_shard 2 x tp 2: fully_shard over the TP'd blocks and stage roots, 1F1B,
    sequence parallelism, checkpointed blocks."""
    results = run_on_ranks(
        8, _pp_tp_body, "1F1B", sequence_parallel=True, ckpt=True, dp=2, timeout=240
    )
    assert results[4:] == [[f"Tensor {HALF}"]] * 4


def _pp_dp_tp_variants() -> list[list[str]]:
    """More 8-rank layouts in one call (the 8-process pool is the expensive part): without
    sequence parallelism, interleaved; with bf16 compute."""
    return [
        _pp_tp_body("Interleaved1F1B", sequence_parallel=False, dp=2),
        _pp_tp_body("1F1B", sequence_parallel=True, dp=2, bf16=True),
    ]


def test_pp_dp_tp_on_8_ranks_without_sp_and_in_bf16() -> None:
    for rank, (no_sp, bf16) in enumerate(run_on_ranks(8, _pp_dp_tp_variants, timeout=300)):
        if rank >= 4:  # pp rank 1: the full activation, then the sequence shard
            assert no_sp == [f"Tensor {FULL}"] and bf16 == [f"Tensor {HALF}"], (no_sp, bf16)


# --- the wire format and the receiver's mesh (no pipeline) ---------------------------------


def test_dtensor_layouts_round_trip_through_the_metadata() -> None:
    metas = (
        TensorMeta((2, 3, 8), torch.float32, True, None),
        TensorMeta(
            (2, 2, 8),
            torch.bfloat16,
            True,
            DTensorLayout(("tp",), (2,), (Shard(1),), (2, 4, 8)),
        ),
        TensorMeta(
            (4,),
            torch.float32,
            False,
            DTensorLayout(("dp", "tp"), (2, 2), (Replicate(), Partial("avg")), (4,)),
        ),
        TensorMeta((3,), torch.int64, False, DTensorLayout((), (4,), (Partial(),), (3,))),
    )
    assert decode_meta(encode_meta(metas)) == metas
    # A change of layout alone is a change of metadata (the receiver is told again).
    moved = TensorMeta(
        (2, 2, 8), torch.bfloat16, True, DTensorLayout(("tp",), (2,), (Shard(2),), (2, 2, 16))
    )
    assert decode_meta(encode_meta((moved,))) == (moved,) != (metas[1],)


def test_dtensor_with_an_unsendable_placement_is_refused() -> None:
    strided = _StridedShard(1, split_factor=2)
    with pytest.raises(TypeError, match="cannot cross a pipeline stage boundary"):
        encode_layout(DTensorLayout(("tp",), (2,), (strided,), (2, 4)))


def test_receiver_without_a_matching_mesh_asks_for_get_mesh() -> None:
    resolver = MeshResolver(nn.Linear(2, 2), None)
    layout = DTensorLayout(("tp",), (2,), (Shard(1),), (2, 4, 8))
    with pytest.raises(RuntimeError, match=r"stage 1.*tp=2.*get_mesh="):
        resolver.rebuild([torch.zeros(2, 2, 8)], [layout], "stage 1")


def _get_mesh_body() -> tuple[list[Any], str, float]:
    """A stage without DTensor parameters rebuilds a received DTensor on get_mesh's mesh,
    and the gradient reaches the received local tensor."""
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    calls: list[Any] = []

    def get_mesh(names: tuple[str, ...], layout: Any) -> DeviceMesh:
        calls.append((names, layout))
        return mesh

    resolver = MeshResolver(nn.Linear(2, 2), get_mesh)
    layout = DTensorLayout(("tp",), (1,), (Shard(0),), (3, 2))
    leaf = torch.ones(3, 2, requires_grad=True)
    for _ in range(2):  # the second lookup is cached
        (x,) = resolver.rebuild([leaf], [layout], "stage 1")
    assert isinstance(x, DTensor) and x.device_mesh is mesh
    (x * 3).sum().backward()
    assert leaf.grad is not None
    wrong = MeshResolver(nn.Linear(2, 2), lambda names, layout: None)
    with pytest.raises(RuntimeError, match="returned None"):
        wrong.rebuild([leaf], [layout], "stage 1")
    return calls, str(x.placements), leaf.grad.sum().item()


def test_get_mesh_gives_the_mesh_of_received_dtensors() -> None:
    calls, placements, grad = run_on_ranks(1, _get_mesh_body)[0]
    assert calls == [(("tp",), None)]
    assert placements == "(Shard(dim=0),)" and grad == 18.0
