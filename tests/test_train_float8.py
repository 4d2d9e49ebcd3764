"""``plait train --float8``: torchao's float8 linears (emulated on CPU), float8 all-gather
under ``fully_shard``.

The oracle is torch: the same run (model, init, batches, AdamW and schedule, torchao
config, scale precomputation) with torch's own ``fully_shard`` in place of plait's must
give the same losses and weights. One process equals ``dp_shard 2`` when its float8 casts
see the same tensors: tensorwise dynamic scaling takes each activation's and gradient's
scale from the tensor at hand (a rank's rows), so one process must split its batch into
the same two microbatches; the weights' scales are the whole weights' in both.
Configurations that cannot run are refused before any worker starts.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait.train import float8
from plait.train import parallelize as recipe
from plait.train.checkpointing import latest_checkpoint, load_weights
from plait.train.cli import main
from plait.train.config import ConfigError, TrainConfig
from plait.train.loop import Trainable, TrainResult, build_model
from plait.train.parallelize import build_mesh
from plait.train.resolve import resolve

from collective_spy import spy_collectives
from harness import run_on_ranks
from train_helpers import TINY, assert_losses_close, forbid_launch, run_train, train_on_rank

needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="needs torchao (the float8 extra)"
)

#: TINY is 32 wide (a multiple of 16): all 6 linears of each of its 4 blocks convert.
FLOAT8 = TINY.replace(float8=True)
LINEARS_PER_BLOCK = 6


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("float8")


# ----------------------------------------------------------------------------------------
# Training: plait's fully_shard beside torch's, one process beside two
# ----------------------------------------------------------------------------------------


def _train_with_torch_fsdp(cfg: TrainConfig, run_dir: str) -> tuple[TrainResult, int]:
    """``plait train`` on this rank with torch's ``fully_shard`` (and its policies) in the
    recipe instead of plait's; returns the result and how many modules torch sharded."""
    from torch.distributed import fsdp

    sharded = []

    def torch_fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module:
        sharded.append(module)
        return fsdp.fully_shard(module, **kwargs)

    with mock.patch.multiple(
        recipe,
        fully_shard=torch_fully_shard,
        MixedPrecisionPolicy=fsdp.MixedPrecisionPolicy,
        OffloadPolicy=fsdp.OffloadPolicy,
        CPUOffloadPolicy=fsdp.CPUOffloadPolicy,
    ):
        result = train_on_rank(cfg, run_dir)
    return result, len(sharded)


@functools.cache
def _plait_dp_shard2(tmp: Path) -> TrainResult:
    """plait's ``--float8 --dp-shard 2`` run (cached: two tests compare against it)."""
    return run_on_ranks(2, train_on_rank, FLOAT8.replace(dp_shard=2), str(tmp / "plait"))[0]


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of ``run_dir``'s last checkpoint, loaded into a plain one-process model."""
    model = build_model(resolve(FLOAT8, 1))
    path = latest_checkpoint(run_dir)
    assert path is not None
    load_weights(path, model)
    return model.state_dict()


@needs_torchao
def test_dp_shard2_matches_torch_fully_shard(shared_tmp: Path) -> None:
    plait = _plait_dp_shard2(shared_tmp)
    cfg = FLOAT8.replace(dp_shard=2)
    (ref, sharded), _ = run_on_ranks(2, _train_with_torch_fsdp, cfg, str(shared_tmp / "torch"))
    assert sharded == TINY.n_layer + 1  # torch sharded each block, then the root
    # The same casts, the same all-gathered float8 bytes and the same reduce-scatters in
    # the same order: nothing left to round differently.
    assert plait.losses == ref.losses
    assert plait.val_losses == ref.val_losses
    mine, theirs = _final_weights(plait.run_dir), _final_weights(ref.run_dir)
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=0, atol=0, msg=name)


@needs_torchao
def test_bf16_dp_shard2_matches_torch_fully_shard(tmp_path: Path) -> None:
    """torchtitan's setting: bf16 compute (fully_shard's mixed precision) around float8."""
    cfg = FLOAT8.replace(dp_shard=2, mp="bf16", steps=2)
    plait = run_on_ranks(2, train_on_rank, cfg, str(tmp_path / "plait"))[0]
    (ref, _), _ = run_on_ranks(2, _train_with_torch_fsdp, cfg, str(tmp_path / "torch"))
    assert plait.losses == ref.losses


@needs_torchao
def test_resume_is_exact(shared_tmp: Path) -> None:
    """Stopped after step 2 and resumed: the float8 weights' shards load back in place."""
    cfg, run_dir = FLOAT8.replace(dp_shard=2), str(shared_tmp / "resumed")
    first = run_on_ranks(2, train_on_rank, cfg.replace(stop_after=2), run_dir)[0]
    rest = run_on_ranks(2, train_on_rank, cfg.replace(resume=True), run_dir)[0]
    assert first.losses + rest.losses == _plait_dp_shard2(shared_tmp).losses


@needs_torchao
def test_tp2_dp_shard2_matches_torch_fully_shard(tmp_path: Path) -> None:
    """Tensor parallelism under fully_shard with float8 all-gather: the gathered float8
    weight is rebuilt as the tp-local DTensor the tp styles expect."""
    cfg = FLOAT8.replace(tp=2, dp_shard=2, n_layer=2, steps=2)  # 4 ranks: kept short
    plait = run_on_ranks(4, train_on_rank, cfg, str(tmp_path / "plait"))[0]
    (ref, _), *_ = run_on_ranks(4, _train_with_torch_fsdp, cfg, str(tmp_path / "torch"))
    assert plait.losses == ref.losses


@needs_torchao
def test_one_process_matches_dp_shard2(shared_tmp: Path) -> None:
    # Two microbatches: each float8 cast of an activation or gradient sees one rank's rows.
    one = run_train(FLOAT8.replace(microbatches=2), 1, shared_tmp / "one")
    two = _plait_dp_shard2(shared_tmp)
    # Only the float32 sums differ (gradient accumulation vs reduce-scatter), as in every
    # composition of test_train.py.
    assert_losses_close(two.losses, one.losses)
    mine, reference = _final_weights(two.run_dir), _final_weights(one.run_dir)
    for name, value in reference.items():
        torch.testing.assert_close(mine[name], value, rtol=0, atol=1e-6, msg=name)


@needs_torchao
def test_tp2_matches_one_process(shared_tmp: Path) -> None:
    """Tensor parallelism alone: its ranks share the rows, and a float8 cast of a sharded
    tensor takes the whole tensor's scale (DTensor reduces the max), so only float32
    roundings differ from one process."""
    one = run_train(FLOAT8, 1, shared_tmp / "one-whole")
    tp = run_on_ranks(2, train_on_rank, FLOAT8.replace(tp=2), str(shared_tmp / "tp"))[0]
    assert_losses_close(tp.losses, one.losses)


@needs_torchao
def test_checkpoint_holds_plain_tensors(shared_tmp: Path) -> None:
    """A --float8 run's checkpoint loads where torchao's classes are not allowed (plait
    sample, plait export, a run without --float8): its weights were saved unwrapped."""
    run_dir = _plait_dp_shard2(shared_tmp).run_dir
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        weights = _final_weights(run_dir)
    finally:
        torch.serialization.add_safe_globals(allowed)
    assert weights["blocks.0.attn.q.weight"].abs().sum() > 0


# ----------------------------------------------------------------------------------------
# Float8 all-gather is on under plait's fully_shard, its scales precomputed
# ----------------------------------------------------------------------------------------


def _gathers_float8(cfg: TrainConfig) -> dict[str, Any]:
    from torchao.float8 import fsdp_utils

    cfg = resolve(cfg, dist.get_world_size())
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    world = dist.get_world_size()
    # Bytes each block's all-gather must move: float8 linear weights 1 per element, the
    # rest (biases, norms) fp32.
    expected = []
    for block in model.blocks:
        float8_weights = {
            id(m.weight) for m in block.modules() if type(m) is nn.Linear and m.weight.ndim == 2
        }
        expected.append(
            sum(p.numel() * (1 if id(p) in float8_weights else 4) for p in block.parameters())
        )
    parts = Trainable(model, cfg, build_mesh(cfg))
    module = parts.modules[0]
    weights = [
        m.weight for m in module.modules() if isinstance(m, nn.Linear) and type(m) is not nn.Linear
    ]
    wrapped = [type(w._local_tensor).__name__ for w in weights if isinstance(w, DTensor)]
    inputs = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))

    casts: list[int] = []
    original = fsdp_utils.hp_tensor_to_float8_dynamic

    def counted(*args: Any, **kwargs: Any) -> Any:
        casts.append(1)
        return original(*args, **kwargs)

    with mock.patch.object(fsdp_utils, "hp_tensor_to_float8_dynamic", counted):
        with spy_collectives("all_gather_single") as calls:
            loss = module(inputs).float().pow(2).mean()
        loss.backward()
        first_casts = len(casts)  # the pre-all-gather hooks' own scale computations
        parts.update()  # the optimizer step, then the scales for the next gathers
        scales_ok = True
        for w in weights:
            local = w._local_tensor
            amax = local._tensor.abs().max().double()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            expected_scale = (torch.finfo(torch.float8_e4m3fn).max / amax).float()
            scales_ok &= bool(torch.equal(local._precomputed_scale, expected_scale))
        casts.clear()
        module(inputs).float().pow(2).mean().backward()
        later_casts = len(casts)
    return {
        "converted": len(weights),
        "head": type(module.head).__name__,
        "wrapped": wrapped,
        "gathered": [(dtype, numel) for dtype, numel in calls["all_gather_single"]],
        "expected": [(torch.uint8, n) for n in expected],
        "world": world,
        "first_casts": first_casts,
        "later_casts": later_casts,
        "scales_ok": scales_ok,
    }


@needs_torchao
def test_fully_shard_gathers_float8_weights() -> None:
    result = run_on_ranks(2, _gathers_float8, FLOAT8.replace(dp_shard=2))[0]
    assert result["converted"] == TINY.n_layer * LINEARS_PER_BLOCK
    assert result["head"] == "Linear"  # the output head stays in high precision
    assert set(result["wrapped"]) == {"WeightWithDynamicFloat8CastTensor"}
    # Forward: the root's all-gather (fp32, plain), then one per block, as bytes with the
    # linear weights in float8 (a quarter of their fp32 size).
    root, *blocks = result["gathered"]
    assert root[0] == torch.float32
    assert blocks == result["expected"]
    # Before the first optimizer step each weight's pre-all-gather hook computes its scale
    # (an all-reduce of its max), at the forward's gather and the backward's (the blocks
    # reshard after forward); after the step, every scale was precomputed in one.
    assert result["first_casts"] == 2 * result["converted"]
    assert result["scales_ok"]
    assert result["later_casts"] == 0


def test_convert_skips_unaligned_linears_and_routers() -> None:
    pytest.importorskip("torchao.float8")
    cfg = resolve(FLOAT8.replace(d_model=48, n_head=3, experts=4, top_k=2, shared_experts=1), 1)
    model = build_model(cfg)
    swapped = float8.convert(model.blocks, cfg)
    kept = {
        name
        for name, m in model.named_modules()
        if type(m) is nn.Linear  # left in high precision
    }
    # d_model 48 and the shared expert's hidden width convert; each router (4 experts:
    # not a multiple of 16, and a router anyway) and the head do not.
    assert kept == {"head", *(f"blocks.{i}.mlp.router.gate" for i in range(cfg.n_layer))}
    assert swapped == cfg.n_layer * (4 + 3)  # q, k, v, proj; the shared expert's 3


# ----------------------------------------------------------------------------------------
# Refused before launch
# ----------------------------------------------------------------------------------------


def test_unaligned_model_width_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    forbid_launch(monkeypatch, "a worker was started for an impossible configuration")
    assert main(["train", "--float8", "--d-model", "40", "--n-head", "2"]) == 2
    err = capsys.readouterr().err
    assert "--float8: the model width 40 is not a multiple of 16" in err, err


def test_tensor_parallel_shares_must_stay_aligned() -> None:
    """Under --tp a rank multiplies its share of a linear's width: both dims over tp must
    stay multiples of 16 (torch._scaled_mm refuses others on the GPU; emulated on the CPU,
    anything would run)."""
    pytest.importorskip("torchao.float8")
    assert float8._eligible(nn.Linear(48, 64), "blocks.0.attn.q")
    assert not float8._eligible(nn.Linear(48, 64), "blocks.0.attn.q", tp=2)  # 24 a share
    assert float8._eligible(nn.Linear(64, 96), "blocks.0.attn.q", tp=2)
    with pytest.raises(ConfigError, match="model width 48 over --tp 2 is not a multiple of 32"):
        resolve(FLOAT8.replace(d_model=48, n_head=2, tp=2), 2)


def test_gpu_without_float8_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *args: (8, 0))
    with pytest.raises(ConfigError, match=r"--float8: this GPU has compute capability 8\.0"):
        resolve(FLOAT8.replace(device="cuda"), 1)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *args: (9, 0))
    assert resolve(FLOAT8.replace(device="cuda"), 1).float8  # an H100 passes


def test_missing_torchao_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec

    def without_torchao(name: str, *args: Any) -> Any:
        return None if name == "torchao" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_torchao)
    message = (
        r"--float8 needs the torchao package, which is not installed: "
        r"pip install 'plait\[float8\]' \(or drop --float8\)"
    )
    with pytest.raises(ConfigError, match=message):
        resolve(FLOAT8, 1)
    # A worker that gets that far (the package gone after the check) says the same.
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=message):
        float8.convert([nn.Linear(16, 16)], FLOAT8)
