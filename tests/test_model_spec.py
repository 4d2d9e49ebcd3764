"""The model described once (:mod:`plait.train.model_spec`): each family produces the
``ModelSpec`` that ``plait train`` builds from and ``plait plan`` prices, and the layout
rules' ``ModelShape`` is derived from it in one place.

* plait's GPT: ``GPTConfig.spec`` is what ``plait.plan.models.gpt`` returns (pinned to
  literal specs), and prices the parameters of the model ``plait train`` builds;
* the Llama family: ``LlamaConfig.spec`` of every preset prices the parameters of the
  model built on the meta device (Qwen2's q, k and v biases aside: the spec has no field
  for them), and ``from_hf_config`` reads a trainable config as the trainer does;
* ``resolve.model_shape`` is ``model_spec(cfg).shape(...)``, and a MoE with dense blocks
  makes tp divide every MLP width it splits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.layout import check_tp
from plait.plan import ModelSpec as PlanModelSpec
from plait.plan.models import expert_hidden_default as plan_expert_hidden_default
from plait.plan.models import from_hf_config, gpt, param_counts
from plait.plan.search import model_shape as plan_model_shape
from plait.plan.spec import ModelSpec as SpecModelSpec
from plait.plan.spec import Workload
from plait.plan.train_plan import model_of_config
from plait.train.config import TrainConfig
from plait.train.llama import LlamaConfig
from plait.train.loop import build_model
from plait.train.model import GPTConfig
from plait.train.model_spec import ModelSpec, expert_hidden_default
from plait.train.presets import PRESETS
from plait.train.resolve import gpt_config, model_shape, model_spec

GPT_FIELDS = {"gated": False, "bias": True, "norm_bias": True}

#: (GPTConfig fields, plan.models.gpt arguments, the spec both give).
GPT_CASES = [
    (
        {"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 128},
        ((4, 4, 128, 128), {}),
        ModelSpec("gpt-4x128", 4, 128, 4, 4, 512, 256, positions=128, **GPT_FIELDS),
    ),
    (
        {"n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 32, "experts": 8, "top_k": 2},
        ((2, 4, 64, 32), {"experts": 8, "top_k": 2}),
        ModelSpec(
            "gpt-2x64-moe8x128-top2",
            2,
            64,
            4,
            4,
            256,
            256,
            positions=32,
            experts=8,
            top_k=2,
            expert_hidden=128,  # 4 x 64 / 2: as many active weights as the dense MLP
            **GPT_FIELDS,
        ),
    ),
    (
        {"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 64, "experts": 8, "top_k": 2}
        | {"shared_experts": 1},
        ((4, 4, 128, 64), {"experts": 8, "top_k": 2, "shared_experts": 1}),
        ModelSpec(
            "gpt-4x128-moe8x170-top2+1",
            4,
            128,
            4,
            4,
            512,
            256,
            positions=64,
            experts=8,
            top_k=2,
            shared_experts=1,
            expert_hidden=170,  # 512 // 3
            **GPT_FIELDS,
        ),
    ),
    (
        {"n_layer": 48, "n_head": 64, "d_model": 7168, "seq_len": 2048}
        | {"vocab_size": 50368, "tie_weights": True},
        ((48, 64, 7168, 2048), {"vocab": 50368, "tied": True}),
        ModelSpec(
            "gpt-48x7168", 48, 7168, 64, 64, 28672, 50368, tied=True, positions=2048, **GPT_FIELDS
        ),
    ),
    (
        {"n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 16, "experts": 4, "top_k": 1}
        | {"shared_experts": 2, "expert_hidden": 48},
        ((2, 2, 64, 16), {"experts": 4, "top_k": 1, "shared_experts": 2, "expert_hidden": 48}),
        ModelSpec(
            "gpt-2x64-moe4x48-top1+2",
            2,
            64,
            2,
            2,
            256,
            256,
            positions=16,
            experts=4,
            top_k=1,
            shared_experts=2,
            expert_hidden=48,
            **GPT_FIELDS,
        ),
    ),
]


def test_the_spec_is_the_train_layers_and_the_planner_re_exports_it() -> None:
    assert PlanModelSpec is SpecModelSpec is ModelSpec
    assert plan_expert_hidden_default is expert_hidden_default


@pytest.mark.parametrize(("fields", "args", "expected"), GPT_CASES)
def test_gpt_config_spec_is_the_planners_gpt(
    fields: dict[str, int], args: tuple[tuple[int, ...], dict[str, int]], expected: ModelSpec
) -> None:
    positional, keywords = args
    assert GPTConfig(**fields).spec() == expected
    assert gpt(*positional, **keywords) == expected


def test_gpt_keeps_its_refusals_in_flag_words() -> None:
    with pytest.raises(ValueError, match="--d-model 66 must be a positive multiple of --n-head 4"):
        gpt(2, 4, 66, 32)
    with pytest.raises(
        ValueError, match=r"gpt-2x64-moe2x85-top3: --top-k 3 must be in 1..--experts 2"
    ):
        gpt(2, 4, 64, 32, experts=2, top_k=3)


def _built_parameters(cfg: TrainConfig) -> int:
    """Parameters of the model ``plait train`` builds from ``cfg`` (on the meta device)."""
    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())


def _priced(spec: ModelSpec) -> int:
    return param_counts(spec).total(spec.layers)


@pytest.mark.parametrize(
    "moe",
    [
        {},
        {"experts": 4, "top_k": 2},
        {"experts": 4, "top_k": 1, "shared_experts": 1, "expert_hidden": 48},
    ],
)
def test_the_gpt_spec_prices_the_gpt_plait_train_builds(moe: dict[str, int]) -> None:
    cfg = TrainConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=300, **moe)
    spec = model_spec(cfg)
    assert spec == gpt_config(cfg).spec() and spec.vocab == 300  # the resolved vocabulary
    assert _priced(spec) == _built_parameters(cfg)


def _llama_bias_parameters(llama: LlamaConfig) -> int:
    """What a Llama's spec does not describe: its attention's biases (Qwen2's q, k, v)."""
    spec = llama.spec()
    qkv = spec.q_width + 2 * spec.kv_width if llama.qkv_bias else 0
    proj = spec.d_model if llama.proj_bias else 0
    return spec.layers * (qkv + proj)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_spec_prices_the_model_plait_train_builds(preset: str) -> None:
    llama = LlamaConfig.from_hf(PRESETS[preset])
    spec = llama.spec()
    built = _built_parameters(TrainConfig(model_config=preset, seq_len=64))
    assert _priced(spec) + _llama_bias_parameters(llama) == built
    # The planner reads the preset's config.json as the trainer does.
    assert from_hf_config(PRESETS[preset]) == llama.spec(name="hf-config")


def test_qwen2_attention_biases_are_the_one_gap() -> None:
    llama = LlamaConfig.from_hf(PRESETS["qwen2.5-0.5b"])
    assert llama.qkv_bias and _llama_bias_parameters(llama) == 24 * (896 + 2 * 128)


def test_interleaved_dense_blocks_are_counted() -> None:
    """Qwen3-MoE's ``decoder_sparse_step`` 2: every other block dense. The spec counts
    them all (not only the leading one), so its parameters are the built model's and tp
    must divide the dense MLP's width."""
    values = {**PRESETS["tiny-qwen3-moe"], "mlp_only_layers": [], "decoder_sparse_step": 2}
    values["num_hidden_layers"] = 4
    llama = LlamaConfig.from_hf(values)
    assert llama.moe_layers == (1, 3)
    spec = llama.spec()
    assert (spec.experts, spec.dense_layers, spec.moe_layers) == (8, 2, 2)
    with torch.device("meta"):
        from plait.train.llama import Llama

        built = sum(p.numel() for p in Llama(llama, 64).parameters())
    assert _priced(spec) == built
    assert spec.shape(64).d_mlp == llama.intermediate_size


def test_a_config_plait_cannot_train_is_read_by_the_planner() -> None:
    """DeepSeek-V3's keys (shared experts, leading dense blocks) are the planner's own."""
    deepseek = {
        "model_type": "deepseek_v3",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 768,
        "vocab_size": 1000,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_intermediate_size": 64,
        "num_experts_per_tok": 2,
    }
    spec = from_hf_config(deepseek)
    assert (spec.experts, spec.shared_experts, spec.dense_layers, spec.expert_hidden) == (
        8,
        1,
        1,
        64,
    )
    # Both kinds of block split by tp: the gcd of the dense MLP's and the shared experts'.
    assert spec.shape(128).d_mlp == 64
    assert check_tp(spec.shape(128), 2, False) == []
    wide = dataclasses.replace(spec, ffn_hidden=770)  # 770 = 2 x 5 x 7 x 11, 64 = 2^6
    assert wide.shape(128).d_mlp == 2
    assert [r.message for r in check_tp(wide.shape(128), 4, False)] == [
        "--tp 4 splits the MLP width 2 4 ways, but 2 does not divide by 4: use --tp 2"
    ]


@pytest.mark.parametrize(
    "cfg",
    [
        TrainConfig(n_layer=2, n_head=4, d_model=64, seq_len=64),
        TrainConfig(n_layer=2, n_head=4, d_model=64, seq_len=64, vocab_size=512),
        TrainConfig(n_layer=2, n_head=4, d_model=64, seq_len=64, experts=4, top_k=2),
        TrainConfig(n_layer=2, n_head=4, d_model=64, seq_len=64, experts=4, shared_experts=1),
        TrainConfig(model_config="tiny-llama", seq_len=64),
        TrainConfig(model_config="tiny-mixtral", seq_len=64),
        TrainConfig(model_config="tiny-qwen3-moe", seq_len=64),
    ],
)
def test_train_and_plan_derive_the_same_shape(cfg: TrainConfig) -> None:
    spec = model_spec(cfg)
    gpt_flags = not cfg.model_config
    tokens = "byte tokens" if gpt_flags else "tokens"
    assert model_shape(cfg) == spec.shape(cfg.seq_len, from_flags=gpt_flags, tokens=tokens)
    plan = plan_model_shape(spec, Workload(cfg.seq_len, 8))
    assert dataclasses.replace(model_shape(cfg), from_flags=False, tokens="tokens") == plan
    assert model_of_config(cfg) == spec


def test_a_moe_with_dense_blocks_splits_their_mlp() -> None:
    """tiny-qwen3-moe: block 0 dense (SwiGLU of 128), blocks 1-2 MoE without shared
    experts: tp must divide the dense width, which the shape states as it is."""
    shape = model_shape(TrainConfig(model_config="tiny-qwen3-moe", seq_len=64))
    assert (shape.d_model, shape.d_mlp, shape.experts) == (64, 128, 8)
    without = model_shape(TrainConfig(model_config="tiny-mixtral", seq_len=64))
    assert without.d_mlp == without.d_model  # every block MoE: no MLP width tp splits


def test_the_plan_of_a_model_config_keeps_its_name_and_source() -> None:
    spec = model_of_config(TrainConfig(model_config="tiny-qwen3", seq_len=64))
    assert (spec.name, spec.source, spec.head_dim, spec.qk_norm, spec.tied) == (
        "tiny-qwen3",
        "tiny-qwen3",
        32,
        True,
        True,
    )
    gpt_spec = model_of_config(TrainConfig(n_layer=2, n_head=4, d_model=64, seq_len=64))
    assert (gpt_spec.name, gpt_spec.source, gpt_spec.vocab) == ("gpt-2x64", "", 256)
