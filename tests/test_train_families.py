"""``plait train --model-config`` beyond Llama: Qwen2, Qwen3, Mistral, Mixtral and
Qwen3-MoE built from their ``config.json``, and presets by name.

Each family's forward equals transformers' own model with the same weights (random, fp32,
seeded; copied across by a small explicit name map); a tiny Mixtral trains at ep 2 x
dp_shard 2 and a tiny Qwen3 at tp 2 like one process; presets resolve, and ``tiny-llama``
trains and records its config.json in the run directory; what cannot be built is refused
by name.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.train.checkpointing import check_settings, list_checkpoints
from plait.train.config import ConfigError
from plait.train.llama import FAMILIES, Llama, LlamaConfig, LlamaConfigError
from plait.train.loop import model_settings
from plait.train.metrics import read_metrics
from plait.train.presets import PRESETS, RUN_FILE, config_bytes
from plait.train.resolve import resolve

from harness import run_on_ranks
from train_helpers import TINY, assert_losses_close, run_train, train_on_rank

transformers = pytest.importorskip("transformers")

#: What every tiny config shares: two blocks of width 32, grouped-query attention.
BASE: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 320,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}

#: Per family: transformers' config and model class names, and the tiny config.json.
TINY_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # A sliding window on block 1 (from max_window_layers), wider than the sequence.
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": True}),
    "qwen3_bias": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8, "attention_bias": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 32}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_hidden_layers": 3,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "mlp_only_layers": [0],
            "norm_topk_prob": False,
            "head_dim": 8,
        },
    ),
}


def _values(name: str) -> dict[str, Any]:
    """The config.json of ``name``'s tiny model (its model_type without the suffix)."""
    kind = name.removesuffix("_bias")
    return {"model_type": kind, "architectures": [FAMILIES[kind]], **BASE, **TINY_CONFIGS[name][2]}


def _hf_model(name: str) -> Any:
    """transformers' model of ``name``, eager attention, every weight random (norm gains
    around 1, biases and routers too: a zero router would tie every expert)."""
    config_cls, model_cls, _ = TINY_CONFIGS[name]
    values = {k: v for k, v in _values(name).items() if k != "model_type"}
    config = getattr(transformers, config_cls)(**values, attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
            elif key.endswith("embed_tokens.weight"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.1)
    return model


#: plait's names of a block's modules -> transformers'.
_BLOCK_NAMES = {
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.proj": "self_attn.o_proj",
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
    "mlp.router.gate": "mlp.gate",
}


def _plait_state(hf: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """transformers' (in-memory) state dict ``hf`` under plait's names."""
    out = {
        "tok_emb.weight": hf["model.embed_tokens.weight"],
        "ln_f.weight": hf["model.norm.weight"],
        "head.weight": hf["lm_head.weight"],
    }
    for i in range(layers):
        theirs = f"model.layers.{i}"
        for ours, name in _BLOCK_NAMES.items():
            for kind in ("weight", "bias"):
                if f"{theirs}.{name}.{kind}" in hf:
                    out[f"blocks.{i}.{ours}.{kind}"] = hf[f"{theirs}.{name}.{kind}"]
        if f"{theirs}.mlp.experts.gate_up_proj" in hf:
            # (E, 2 I, C): gate rows then up rows, nn.Linear's (out, in); plait: (E, C, I).
            gate, up = hf[f"{theirs}.mlp.experts.gate_up_proj"].chunk(2, dim=1)
            down = hf[f"{theirs}.mlp.experts.down_proj"]  # (E, C, I)
            out[f"blocks.{i}.mlp.experts.w1"] = gate.transpose(1, 2)
            out[f"blocks.{i}.mlp.experts.w3"] = up.transpose(1, 2)
            out[f"blocks.{i}.mlp.experts.w2"] = down.transpose(1, 2)
    return out


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_forward_matches_transformers(name: str) -> None:
    cfg = LlamaConfig.from_hf(_values(name))
    hf = _hf_model(name)
    model = Llama(cfg, seq_len=16).eval()
    model.load_state_dict(_plait_state(hf.state_dict(), cfg.num_hidden_layers), strict=True)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(idx).logits
        actual = model(idx)
    assert actual.shape == expected.shape == (2, 16, cfg.vocab_size)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_family_structure() -> None:
    """What each family adds, under the names the checkpoint mapping uses."""
    params = {
        name: dict(Llama(LlamaConfig.from_hf(_values(name)), 16).named_parameters())
        for name in ("qwen2", "qwen3", "qwen3_bias", "mistral", "qwen3_moe")
    }
    qwen2 = params["qwen2"]
    assert {"blocks.0.attn.q.bias", "blocks.0.attn.k.bias", "blocks.0.attn.v.bias"} <= set(qwen2)
    assert "blocks.0.attn.proj.bias" not in qwen2 and "blocks.0.attn.q_norm.weight" not in qwen2
    assert params["qwen3"]["blocks.1.attn.q_norm.weight"].shape == (16,)
    assert params["qwen3"]["blocks.1.attn.k_norm.weight"].shape == (16,)
    assert "blocks.0.attn.q.bias" not in params["qwen3"]
    assert "blocks.0.attn.proj.bias" in params["qwen3_bias"]  # attention_bias: all four
    assert not any(key.endswith("bias") for key in params["mistral"])
    moe = params["qwen3_moe"]  # mlp_only_layers [0]: block 0 dense, 1 and 2 MoE
    assert "blocks.0.mlp.gate.weight" in moe and "blocks.0.mlp.router.gate.weight" not in moe
    assert moe["blocks.2.mlp.experts.w1"].shape == (4, 32, 16)
    cfg = LlamaConfig.from_hf(_values("qwen3_moe"))
    assert cfg.moe_layers == (1, 2) and cfg.moe_shape == (3, 4) and not cfg.norm_topk_prob
    mixtral = LlamaConfig.from_hf(_values("mixtral"))
    assert mixtral.moe_layers == (0, 1) and mixtral.norm_topk_prob
    assert mixtral.moe_intermediate_size == BASE["intermediate_size"]
    # Family defaults where config.json leaves keys out (as transformers' classes).
    assert LlamaConfig.from_hf({**BASE, "model_type": "qwen3"}).dim_head == 128
    bare = {k: v for k, v in _values("mixtral").items() if k not in ("rope_theta",)}
    assert LlamaConfig.from_hf(bare).rope_theta == 1e6
    sparse = {**_values("qwen3_moe"), "decoder_sparse_step": 2, "mlp_only_layers": []}
    assert LlamaConfig.from_hf(sparse).moe_layers == (1,)  # (i + 1) % 2 == 0
    # transformers 5's rope_parameters holds the theta (and the scaling).
    params_only = {k: v for k, v in BASE.items() if k != "rope_theta"}
    rope = {"rope_type": "default", "rope_theta": 5e5}
    assert LlamaConfig.from_hf({**params_only, "rope_parameters": rope}).rope_theta == 5e5


def _write(path: Path, values: dict[str, Any]) -> str:
    path.write_text(json.dumps(values))
    return str(path)


def test_refusals(tmp_path: Path) -> None:
    refused = {
        "model_type 'qwen2_moe' is not supported": {**BASE, "model_type": "qwen2_moe"},
        "architectures \\['GPT2LMHeadModel'\\] is not supported": {
            **BASE,
            "architectures": ["GPT2LMHeadModel"],
        },
        "rope_scaling type 'yarn'": {
            **_values("qwen3"),
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
        },
        "router_jitter_noise": {**_values("mixtral"), "router_jitter_noise": 0.1},
        "mlp_bias": {**BASE, "mlp_bias": True},
        "num_experts_per_tok \\(8\\) must be between 1 and the number of experts \\(4\\)": {
            **_values("mixtral"),
            "num_experts_per_tok": 8,
        },
    }
    for message, values in refused.items():
        with pytest.raises(LlamaConfigError, match=message):
            LlamaConfig.from_hf(values)
    mistral = _write(tmp_path / "mistral.json", {**_values("mistral"), "sliding_window": 16})
    with pytest.raises(ConfigError, match="--seq-len 32 exceeds the model's sliding_window 16"):
        resolve(TINY.replace(model_config=mistral), 1)  # TINY: seq_len 32
    with pytest.raises(LlamaConfigError, match="sliding_window 16"):
        Llama(LlamaConfig.from_hf({**_values("mistral"), "sliding_window": 16}), 32)
    # Qwen's window is off unless use_sliding_window says so.
    qwen = {**_values("qwen2"), "use_sliding_window": False, "sliding_window": 4}
    assert LlamaConfig.from_hf(qwen).sliding_window is None
    qwen = {**BASE, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1}
    assert LlamaConfig.from_hf(qwen).sliding_window == 4096  # transformers' default
    mixtral = _write(tmp_path / "mixtral.json", _values("mixtral"))
    with pytest.raises(ConfigError, match="--experts 4 with --model-config"):
        resolve(TINY.replace(model_config=mixtral, experts=4), 1)
    with pytest.raises(ConfigError, match="--ep 2 splits the routed experts, but the model has"):
        resolve(TINY.replace(model_config="tiny-llama", ep=2, dp_shard=2), 2)
    with pytest.raises(ConfigError, match="--ep 3 splits the 4 routed experts"):
        resolve(TINY.replace(model_config=mixtral, ep=3, dp_shard=3), 3)
    with pytest.raises(ConfigError, match="cannot read it .*tiny-llama"):
        resolve(TINY.replace(model_config="tiny-lama"), 1)


def test_presets_resolve() -> None:
    for name, values in PRESETS.items():
        cfg = LlamaConfig.from_hf(values)
        assert cfg.model_type == values["model_type"], name
        assert json.loads(config_bytes(name)) == values
    assert LlamaConfig.from_hf(PRESETS["mixtral-8x7b"]).moe_shape == (32, 8)
    assert LlamaConfig.from_hf(PRESETS["qwen3-30b-a3b"]).moe_shape == (48, 128)
    assert LlamaConfig.from_hf(PRESETS["llama3.1-70b"]).moe_shape is None
    assert LlamaConfig.from_hf(PRESETS["qwen3-0.6b"]).dim_head == 128
    # A big preset resolves for a layout without building anything (the planner's use).
    cfg = resolve(TINY.replace(model_config="qwen3-30b-a3b", ep=8, dp_shard=8), 8)
    digest = hashlib.sha256(config_bytes("qwen3-30b-a3b")).hexdigest()
    assert cfg.ep == 8 and cfg.model_hash == digest


def test_plan_reads_the_model_config() -> None:
    """``plait train --plan`` predicts the --model-config's model, not the GPT's flags."""
    from plait.plan.train_plan import model_of_config

    spec = model_of_config(TINY.replace(model_config="mixtral-8x7b"))
    shape = (spec.layers, spec.d_model, spec.kv_heads, spec.experts, spec.top_k)
    assert shape == (32, 4096, 8, 8, 2)


def test_tiny_llama_preset_trains(tmp_path: Path) -> None:
    """``--model-config tiny-llama`` trains; the run directory holds the config.json it
    trained (whose sha256 is the run's model_hash), and its checkpoint refuses another
    preset."""
    result = run_train(TINY.replace(model_config="tiny-llama", steps=2), 1, tmp_path)
    assert len(result.losses) == 2 and all(loss == loss for loss in result.losses)
    recorded = (tmp_path / RUN_FILE).read_bytes()
    assert recorded == config_bytes("tiny-llama")
    same = resolve(TINY.replace(model_config="tiny-llama"), 1)
    assert same.model_hash == hashlib.sha256(recorded).hexdigest()
    latest = list_checkpoints(tmp_path)[-1]
    check_settings(latest, model_settings(same))
    with pytest.raises(ConfigError, match="model_hash"):
        check_settings(latest, model_settings(resolve(TINY.replace(model_config="tiny-qwen3"), 1)))


#: A tiny Mixtral for the training runs: 4 experts (top-2) in each of 2 blocks.
MIXTRAL = {**_values("mixtral"), "intermediate_size": 32, "router_aux_loss_coef": 0.02}


@pytest.mark.parametrize(
    ("world", "layout"),
    [(2, {"ep": 2, "dp_shard": 2}), (4, {"ep": 2, "dp_shard": 2, "tp": 2})],  # tp: rows split
)
def test_mixtral_expert_parallel_matches_single_process(
    world: int, layout: dict[str, int], tmp_path: Path
) -> None:
    config = _write(tmp_path / "mixtral.json", MIXTRAL)
    cfg = TINY.replace(model_config=config, grad_clip=0.5)
    reference = run_train(cfg, 1, tmp_path / "reference")
    results = run_on_ranks(world, train_on_rank, cfg.replace(**layout), str(tmp_path / "ep"))
    for result in results:
        assert_losses_close(result.losses, reference.losses, 5e-6)
        assert_losses_close(list(result.val_losses.values()), list(reference.val_losses.values()))

    def loads(run_dir: Path) -> list[Any]:
        return [r["expert_load"] for r in read_metrics(run_dir) if "expert_load" in r]

    expected = loads(tmp_path / "reference")
    # Every step's global load: (blocks, experts), top-k picks of every token.
    assert len(expected) == cfg.steps
    assert all(len(step) == 2 and all(len(b) == 4 for b in step) for step in expected)
    assert all(sum(b) == cfg.batch_size * cfg.seq_len * 2 for step in expected for b in step)
    assert loads(tmp_path / "ep") == expected


def test_qwen3_tp2_matches_single_process(tmp_path: Path) -> None:
    """tp 2: each rank holds half the heads, so the query and key norms' gradients must be
    summed over the tp ranks (their gains stay one, replicated)."""
    values = {**_values("qwen3"), "vocab_size": 256, "tie_word_embeddings": False}
    cfg = TINY.replace(model_config=_write(tmp_path / "qwen3.json", values), grad_clip=0.5)
    reference = run_train(cfg, 1, tmp_path / "reference")
    results = run_on_ranks(2, train_on_rank, cfg.replace(tp=2, dp_shard=1), str(tmp_path / "tp"))
    for result in results:
        assert_losses_close(result.losses, reference.losses, 5e-6)
