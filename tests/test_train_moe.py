"""``plait train --experts``: mixture-of-experts blocks, alone and with expert parallelism
(``--ep``) composed with fully_shard, HSDP, tensor parallelism, pipelines, activation
checkpointing and gradient accumulation, trains like one process; checkpoints saved at one
``ep`` resume at another; what cannot be split is refused before launch.

Every layout must give the single-process run's losses (same seed, same global batch) to
float32 rounding, and the very same expert load in every step: token counts are summed
over the data-parallel ranks before anything uses them, so balancing sees the global batch
at every layout. The runs use a tiny model for a few steps inside the harness's gloo
workers, with every balancing mechanism on (the sequence-wise balance loss, z-loss, the
auxiliary-loss-free bias) and gradient clipping active. The sequence-wise loss is what
makes pipelines and gradient accumulation exact too: a sequence's balance loss depends on
that sequence alone, however the batch is cut into microbatches.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plait.train.cli import main
from plait.train.config import TrainConfig
from plait.train.loop import TrainResult
from plait.train.metrics import read_metrics

from harness import run_on_ranks
from train_helpers import TINY, assert_losses_close, forbid_launch, run_train, train_on_rank

#: 4 routed experts (top-2) and a shared one in each of 4 blocks; clipping active.
MOE_TINY = TINY.replace(
    experts=4, top_k=2, shared_experts=1, bias_update_speed=0.01, grad_clip=0.5, steps=3
)

#: As ``test_train_tp``: a few float32 roundings of a loss near 5.
TOLERANCE = 5e-6


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("train_moe"))


@functools.cache
def _reference(tmp: str, steps: int = MOE_TINY.steps) -> tuple[TrainResult, list[Any]]:
    """The single-process run of MOE_TINY (cached): its result and expert loads."""
    run_dir = Path(tmp) / f"reference-{steps}"
    result = run_train(MOE_TINY.replace(steps=steps), 1, run_dir)
    return result, _loads(run_dir)


def _loads(run_dir: Path) -> list[Any]:
    return [r["expert_load"] for r in read_metrics(run_dir) if "expert_load" in r]


def _assert_close(actual: list[float], expected: list[float]) -> None:
    assert_losses_close(actual, expected, TOLERANCE)


#: (world size, layout). The issue's acceptance layouts: EP 2 x FSDP 2 (at 2 ranks the
#: experts' efsdp is 1; at 4 it is 2), EP 2 x TP 2 and PP 2 x EP 2.
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "ep2_dp_shard2": (2, {"ep": 2, "dp_shard": 2}),
    "ep2_dp_shard4_efsdp2": (4, {"ep": 2, "dp_shard": 4}),
    "ep2_tp2": (4, {"ep": 2, "dp_shard": 2, "tp": 2}),
    "ep2_tp2_no_sp": (4, {"ep": 2, "dp_shard": 2, "tp": 2, "sequence_parallel": False}),
    "pp2_ep2": (4, {"pp": 2, "ep": 2, "dp_shard": 2, "schedule": "1F1B"}),
    "hsdp_ep2": (4, {"dp_replicate": 2, "ep": 2, "dp_shard": 2}),
    "ep2_ac_full_accumulate2": (2, {"ep": 2, "dp_shard": 2, "ac": "full", "microbatches": 2}),
    "ep1_dp_shard2": (2, {"dp_shard": 2}),
    # The tp ranks split the routed rows (under fully_shard): with and without ep.
    "ep1_tp2": (4, {"dp_shard": 2, "tp": 2}),
    "ep2_tp2_ac_full": (4, {"ep": 2, "dp_shard": 2, "tp": 2, "ac": "full"}),
    "ep1_replicate2": (2, {"dp_replicate": 2, "dp_shard": 1}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(name: str, shared_tmp: str, tmp_path: Path) -> None:
    world, layout = LAYOUTS[name]
    results = run_on_ranks(world, train_on_rank, MOE_TINY.replace(**layout), str(tmp_path))
    expected, expected_loads = _reference(shared_tmp)
    for result in results:  # every rank reports the global loss
        _assert_close(result.losses, expected.losses)
        _assert_close(list(result.val_losses.values()), list(expected.val_losses.values()))
    # The same tokens went to the same experts in every step, counted over the global batch.
    assert _loads(tmp_path) == expected_loads


def test_expert_load_is_reported(shared_tmp: str) -> None:
    """metrics.jsonl has every step's load: k tokens-per-token routed per block, summed over
    the global batch, and the worst block's imbalance."""
    _, loads = _reference(shared_tmp)
    records = [r for r in read_metrics(Path(shared_tmp) / "reference-3") if "loss" in r]
    routed = MOE_TINY.batch_size * MOE_TINY.seq_len * MOE_TINY.top_k
    assert len(loads) == MOE_TINY.steps
    for record, load in zip(records, loads, strict=True):
        assert len(load) == MOE_TINY.n_layer and all(len(b) == MOE_TINY.experts for b in load)
        assert all(sum(block) == routed for block in load)
        worst = max(max(b) / (sum(b) / len(b)) for b in load)
        assert record["expert_imbalance"] == pytest.approx(worst)


# ----------------------------------------------------------------------------------------
# Checkpoints: saved at ep 2, resumed at ep 1 and at ep 4
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "layout"), [(1, {"ep": 1, "dp_shard": 1}), (4, {"ep": 4})])
def test_checkpoint_at_ep2_resumes_at_another_ep(
    world: int, layout: dict[str, Any], shared_tmp: str, tmp_path: Path
) -> None:
    steps = 4
    expected, expected_loads = _reference(shared_tmp, steps)
    saved = shared_tmp + "/saved-at-ep2"
    if not Path(saved).exists():  # the first parameter's run saves it, the second reuses it
        cfg = MOE_TINY.replace(steps=steps, stop_after=2, ep=2, dp_shard=2)
        run_on_ranks(2, train_on_rank, cfg, saved)
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    cfg = MOE_TINY.replace(steps=steps, resume=True, **layout)
    if world == 1:
        results = [run_train(cfg, 1, run_dir)]
    else:
        results = run_on_ranks(world, train_on_rank, cfg.replace(dp_shard=world), str(run_dir))
    for result in results:
        assert result.start_step == 2
        _assert_close(result.losses, expected.losses[2:])
    assert _loads(run_dir) == expected_loads


def test_checkpoint_with_experts_split_over_tp_resumes_in_one_process(
    shared_tmp: str, tmp_path: Path
) -> None:
    """Saved where the experts are sharded over efsdp x tp (ep 2 x tp 2 x dp_shard 2),
    resumed by one process: the uninterrupted losses and loads."""
    steps = 4
    expected, expected_loads = _reference(shared_tmp, steps)
    run_dir = tmp_path / "run"
    cfg = MOE_TINY.replace(steps=steps, stop_after=2, ep=2, dp_shard=2, tp=2)
    run_on_ranks(4, train_on_rank, cfg, str(run_dir))
    resumed = run_train(MOE_TINY.replace(steps=steps, resume=True), 1, run_dir)
    assert resumed.start_step == 2
    _assert_close(resumed.losses, expected.losses[2:])
    assert _loads(run_dir) == expected_loads


# ----------------------------------------------------------------------------------------
# Refusals name the flag, before any worker starts
# ----------------------------------------------------------------------------------------

REFUSALS = [
    (["--experts", "4", "--ep", "3", "--dp-shard", "3"], "--ep 3 splits the 4 routed experts"),
    (["--ep", "2", "--dp-shard", "2"], "--ep 2 splits the routed experts, but the model has none"),
    (["--experts", "4", "--ep", "2", "--nproc", "3"], "--dp-shard 3 is not a multiple of 2"),
    (["--experts", "2", "--top-k", "3"], "--top-k 3"),
    (["--experts", "4", "--ep", "0"], "--ep 0: must be at least 1"),
    (["--experts", "-1"], "--experts -1: must be 0 or more"),
    (["--experts", "4", "--aux-loss-coeff", "-1"], "--aux-loss-coeff -1.0: must be 0 or more"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSALS)
def test_moe_refusals_name_the_flag(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    forbid_launch(monkeypatch, "a refused configuration must not start workers")
    assert main(["train", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_dp_shard_given_sets_the_number_of_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--experts 4 --top-k 2 --ep 2 --dp-shard 2`` needs no --nproc: two workers."""
    launched: list[TrainConfig] = []
    monkeypatch.setattr("plait.train.cli.launch", launched.append)
    argv = ["train", "--device", "cpu", "--experts", "4", "--top-k", "2", "--ep", "2"]
    assert main([*argv, "--dp-shard", "2", "--run-dir", "unused"]) == 0
    (cfg,) = launched
    assert (cfg.nproc, cfg.dp_shard, cfg.ep) == (2, 2, 2)


def test_experts_are_sharded_over_ep_and_efsdp() -> None:
    """At dp_shard 4 and ep 2, each rank holds a quarter of every expert weight (2 of the 4
    experts by ep, half of those by efsdp) on the experts' mesh; the rest of a block is on
    dp_shard."""
    for described in run_on_ranks(4, _describe_on_rank, MOE_TINY.replace(ep=2, dp_shard=4)):
        full, local = described["w1"]
        assert full[0] == 4 and local == (1, *full[1:])
        assert described["w1_mesh"] == ("efsdp", "ep")
        assert described["gate_mesh"] == ("dp_shard",)


@pytest.mark.parametrize("ep", [1, 2])
def test_tp_ranks_split_the_routed_rows(ep: int) -> None:
    """Under tp 2 x dp_shard 2 the tp ranks share each MoE's routed rows, and its experts
    are sharded over efsdp x tp (not replicated over tp): each rank holds a quarter of the
    experts' weights, one chunk of the rows per step."""
    cfg = MOE_TINY.replace(ep=ep, dp_shard=2, tp=2)
    for described in run_on_ranks(4, _describe_on_rank, cfg):
        full, local = described["w1"]
        assert local == (full[0] // 4, *full[1:])  # E / (ep x efsdp x tp) whole experts
        assert described["w1_mesh"] == (("efsdp", "ep") if ep > 1 else ("efsdp",))
        assert described["row_split"] == 2


#: 2 routed experts over 4 ranks: fewer experts than ranks to shard them.
FEW_EXPERTS = MOE_TINY.replace(experts=2, top_k=1)


@pytest.mark.parametrize("ep", [1, 2])
def test_fewer_experts_than_shard_ranks_shard_another_dim(ep: int, tmp_path: Path) -> None:
    """With 2 experts sharded over 4 ranks (ep 1: the unit's dp_shard 4; ep 2: one local
    expert over efsdp 2), the stacked weights are sharded on their second dim, not padded
    to an expert per rank on the first (torchtitan's Shard(1) rule; padding cost Mixtral
    2x its memory at 64 ranks), and training still equals one process."""
    cfg = FEW_EXPERTS.replace(ep=ep, dp_shard=4)
    for described in run_on_ranks(4, _describe_on_rank, cfg):
        full, local = described["w1"]
        assert local == (full[0] // ep, full[1] * ep // 4, full[2])
    expected = run_train(FEW_EXPERTS, 1, tmp_path / "reference")
    for result in run_on_ranks(4, train_on_rank, cfg, str(tmp_path / "run")):
        _assert_close(result.losses, expected.losses)
    assert _loads(tmp_path / "run") == _loads(tmp_path / "reference")


def _describe_on_rank(cfg: TrainConfig) -> dict[str, Any]:
    from plait.train.loop import Trainable, model_config
    from plait.train.model import GPT
    from plait.train.parallelize import build_mesh
    from plait.train.resolve import resolve

    cfg = resolve(cfg, dist.get_world_size())
    parts = Trainable(GPT(model_config(cfg)), cfg, build_mesh(cfg))
    moe = parts.modules[0].blocks[0].mlp
    w1, gate = moe.experts.w1, moe.router.gate.weight
    assert isinstance(w1, DTensor) and isinstance(gate, DTensor)
    group = moe.row_split
    return {
        "w1": (tuple(w1.shape), tuple(w1.to_local().shape)),
        "w1_mesh": w1.device_mesh.mesh_dim_names,
        "gate_mesh": gate.device_mesh.mesh_dim_names,
        "row_split": 1 if group is None else dist.get_world_size(group),
    }


def test_summary_prints_the_last_steps_expert_load() -> None:
    from plait.train.report import summary_table

    cfg = MOE_TINY.replace(nproc=2, dp_shard=2, ep=2, experts=4)
    steps = [
        {"step": 1, "loss": 5.0, "step_time": 0.1, "expert_load": [[1, 1, 1, 1]] * 2},
        {"step": 2, "loss": 4.0, "step_time": 0.1, "expert_load": [[4, 2, 1, 1], [2, 2, 2, 2]]},
    ]
    table = summary_table(cfg, steps, steps, [2**20, 2**20], "run")
    assert "expert load, block 0  4 2 1 1 (max/mean 2.00)" in table
    assert "expert load, block 1  2 2 2 2 (max/mean 1.00)" in table
    assert "experts over ep=2 x efsdp=1" in table
