"""``plait train`` builds its model on the meta device, parallelizes it, and only then gives
this rank's pieces storage and values (:mod:`plait.train.materialize`): no rank ever holds
the whole model, and every layout starts from the single-process run's values.

Each test runs ``plait train``'s own setup (``plait.train.loop``) and stops it right after
the model is materialized: what a run would start training from, gathered to full tensors
by whole-model name. The oracle is the model a user builds on one CPU with the same seed
(``torch.manual_seed(seed); build_model(cfg)``): bitwise the same parameters and buffers.
"""

from __future__ import annotations

import importlib.util
import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait.train import loop, param_init
from plait.train.checkpointing import saved_names
from plait.train.config import TrainConfig
from plait.train.llama import rope_inv_freq
from plait.train.loop import build_model
from plait.train.materialize import materialize
from plait.train.model import GPT, GPTConfig
from plait.train.parallelize import Stage

from harness import run_on_ranks
from train_helpers import TINY, run_train

MOE = TINY.replace(experts=4, top_k=2)

#: A tiny Mixtral (every block a mixture of experts) with a tied head and llama3 rope
#: scaling (frequencies that are not the plain powers).
MIXTRAL: dict[str, Any] = {
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}
#: A dense Llama with a tied head and biased attention (every parameter kind but experts).
LLAMA = {
    **{k: v for k, v in MIXTRAL.items() if not k.startswith("num_") or "heads" in k},
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "attention_bias": True,
}


class _Materialized(Exception):
    """Raised right after the model is materialized, to stop the run there."""


def _full_values(stages: list[Stage]) -> dict[str, torch.Tensor]:
    """This rank's parameters (gathered over their meshes) and buffers, by whole-model
    name. Collective: the ranks of a stage visit its parameters in the same order."""
    values: dict[str, torch.Tensor] = {}
    for stage in stages:
        names = saved_names(stage.module)
        for name, p in stage.module.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            values[names.get(name, name)] = full.detach().clone()
        for name, b in stage.module.named_buffers():
            values[f"buffer {name}"] = b.detach().clone()
    return values


def setup_values(cfg: TrainConfig, world: int, run_dir: str) -> dict[str, Any]:
    """Run ``plait train``'s setup of ``cfg`` on ``world`` ranks (this process's world)
    until the model is materialized. Returns what this rank saw: ``values`` (gathered, by
    whole-model name), ``cfg`` (as resolved), ``meta`` (the model handed to parallelize had
    only meta parameters), ``overlap`` (a draw began while an earlier full value was still
    alive), ``draws`` and ``largest`` (numel of the largest value drawn), and ``local``
    and ``whole`` (this rank's parameter elements, and the whole model's)."""
    seen: dict[str, Any] = {"overlap": False, "draws": 0, "largest": 0}
    alive: list[weakref.ref[torch.Tensor]] = []
    real_parallelize, real_materialize = loop.parallelize, loop.materialize
    real_draw = param_init.initial_value

    def parallelize(model: nn.Module, cfg: TrainConfig, *args: Any) -> list[Stage]:
        seen["meta"] = all(p.device.type == "meta" for p in model.parameters())
        seen["whole"] = sum(p.numel() for p in model.parameters())
        seen["cfg"] = cfg
        return real_parallelize(model, cfg, *args)  # type: ignore[arg-type]

    def draw(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen["overlap"] |= any(ref() is not None for ref in alive)
        value = real_draw(*args, **kwargs)
        alive.append(weakref.ref(value))
        seen["draws"] += 1
        seen["largest"] = max(seen["largest"], value.numel())
        return value

    def stop(stages: list[Stage], *args: Any) -> None:
        real_materialize(stages, *args)
        seen["local"] = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel()
            for s in stages
            for p in s.module.parameters()
        )
        seen["values"] = _full_values(stages)
        raise _Materialized

    loop.parallelize, loop.materialize = parallelize, stop  # type: ignore[assignment]
    param_init.initial_value = draw
    try:
        run_train(cfg, world, Path(run_dir))
    except _Materialized:
        return seen
    finally:
        loop.parallelize, loop.materialize = real_parallelize, real_materialize
        param_init.initial_value = real_draw
    raise AssertionError("the run never materialized its model")


def _on_rank(cfg: TrainConfig, run_dir: str) -> dict[str, Any]:
    return setup_values(cfg, dist.get_world_size(), run_dir)


def _built_on_cpu(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The parameters and buffers of ``cfg``'s model built on this CPU, seeded as the run."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    values = {name: p.detach() for name, p in model.named_parameters()}
    values |= {f"buffer {name}": b for name, b in model.named_buffers()}
    return values


def _assert_same(results: list[dict[str, Any]]) -> None:
    """Every rank's values equal the CPU-built model's bitwise, and together cover it."""
    expected = _built_on_cpu(results[0]["cfg"])
    covered: set[str] = set()
    for rank, result in enumerate(results):
        for name, value in result["values"].items():
            assert name in expected, (rank, name)
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
        covered |= result["values"].keys()
    assert covered == expected.keys()


def test_setup_builds_on_meta_and_draws_one_parameter_at_a_time(tmp_path: Path) -> None:
    """The model the run builds is on the meta device up to parallelize (today's regression
    would build it whole on the CPU first), and materializing draws each parameter's full
    value only after the last one is gone: never more than one parameter's worth."""
    result = setup_values(MOE, 1, str(tmp_path))
    assert result["meta"]
    assert not result["overlap"]
    model = build_model(result["cfg"])
    params = dict(model.named_parameters())
    assert result["draws"] == len(params)
    assert result["largest"] == max(p.numel() for p in params.values())
    _assert_same([result])


#: (ranks, layout, model): GPT dense and with experts, a tied Llama (one matrix for both
#: uses, which to_empty would untie) and a tied Mixtral (copies on two pipeline ranks, and
#: on one with a V-shaped schedule).
LAYOUTS: dict[str, tuple[int, dict[str, Any], str]] = {
    "dp_shard2": (2, {"dp_shard": 2}, "gpt"),
    "dp_shard2_cpu_offload": (2, {"dp_shard": 2, "cpu_offload": True}, "gpt"),
    "dp_replicate2": (2, {"dp_replicate": 2}, "gpt"),
    "cp2": (2, {"cp": 2}, "gpt"),
    "ep2_dp_shard2": (2, {"ep": 2, "dp_shard": 2}, "moe"),
    "dp_shard2_tp2": (4, {"dp_shard": 2, "tp": 2}, "moe"),
    "pp2_dp_shard2": (4, {"pp": 2, "dp_shard": 2, "schedule": "1F1B"}, "gpt"),
    "llama": (1, {}, "llama"),
    "llama_dp_replicate2": (2, {"dp_replicate": 2}, "llama"),
    "mixtral_pp2": (2, {"pp": 2, "schedule": "1F1B"}, "mixtral"),
    "mixtral_pp2_zbv": (2, {"pp": 2, "schedule": "ZBVZeroBubble"}, "mixtral"),
    "mixtral_ep2_tp2": (4, {"ep": 2, "dp_shard": 2, "tp": 2}, "mixtral"),
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The config.json files of the Llama-family models, by name."""
    paths = {}
    for name, values in (("mixtral", MIXTRAL), ("llama", LLAMA)):
        paths[name] = tmp_path_factory.mktemp(name) / "config.json"
        paths[name].write_text(json.dumps(values))
    return {name: str(path) for name, path in paths.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_initial_values_are_the_single_process_ones(
    name: str, configs: dict[str, str], tmp_path: Path
) -> None:
    ranks, layout, model = LAYOUTS[name]
    base = {"gpt": TINY, "moe": MOE} | {k: TINY.replace(model_config=v) for k, v in configs.items()}
    results = run_on_ranks(ranks, _on_rank, base[model].replace(**layout), str(tmp_path))
    for result in results:
        assert result["meta"] and not result["overlap"]
        if layout.get("dp_shard", 1) > 1:  # each rank holds a share, not the whole model
            assert result["local"] < result["whole"]
    _assert_same(results)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_float8_weights_get_the_single_process_values(tmp_path: Path) -> None:
    cfg = TINY.replace(float8=True, dp_shard=2)
    _assert_same(run_on_ranks(2, _on_rank, cfg, str(tmp_path)))


def test_rotary_frequencies_are_recomputed_on_the_device(
    configs: dict[str, str], tmp_path: Path
) -> None:
    """inv_freq (a buffer the constructor computes) is computed again after to_empty:
    the llama3-scaled values of the config, not what the empty storage held."""
    result = setup_values(TINY.replace(model_config=configs["mixtral"]), 1, str(tmp_path))
    model = build_model(result["cfg"])
    expected = rope_inv_freq(model.cfg)  # type: ignore[arg-type]
    rotary = [v for k, v in result["values"].items() if k.endswith("inv_freq")]
    assert len(rotary) == MIXTRAL["num_hidden_layers"]
    for value in rotary:
        torch.testing.assert_close(value, expected, rtol=0, atol=0)


def test_a_checkpoint_run_draws_nothing(tmp_path: Path) -> None:
    """``--resume`` fills every parameter from the checkpoint: no random draws first."""
    cfg = TINY.replace(steps=1)
    run_train(cfg, 1, tmp_path)
    result = setup_values(cfg.replace(resume=True), 1, str(tmp_path))
    assert result["draws"] == 0 and result["meta"]


def test_init_weights_is_the_runs_rule() -> None:
    """A model built on the CPU after ``torch.manual_seed(s)`` and one re-initialised with
    ``init_weights(s)`` hold the same values; biases zero, gains one."""
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, experts=2, top_k=1)
    torch.manual_seed(5)
    built = GPT(cfg)
    torch.manual_seed(0)
    again = GPT(cfg)
    again.init_weights(5)
    for (name, a), b in zip(built.named_parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert torch.all(built.blocks[0].ln1.bias == 0) and torch.all(built.ln_f.weight == 1)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(2))


@pytest.mark.parametrize(
    ("part", "error"),
    [
        (_Scaled, "no initial value for parameter 'blocks.0.extra.scale': its module is a _Scaled"),
        (_Counted, "buffer 'blocks.0.extra.seen' of _Counted cannot be recomputed"),
    ],
)
def test_a_part_without_a_rule_is_refused_by_name(part: type[nn.Module], error: str) -> None:
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8)
    with torch.device("meta"):
        model = GPT(cfg)
        model.blocks[0].extra = part()
    with pytest.raises(RuntimeError, match=error):
        materialize([Stage(0, 1, model)], TINY.execution, seed=0)
