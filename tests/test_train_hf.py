"""Hugging Face weights in and out of ``plait train`` (:mod:`plait.train.hf`).

A tiny transformers ``LlamaForCausalLM`` saved with ``save_pretrained`` (one file, and
sharded with an index) loads into plait's Llama with the same logits; loads into sharded
layouts (fully_shard, tensor parallelism, a pipeline) like into one process; a run started
``--init-from`` it and exported (``plait export``) reads back into transformers with the
logits of the run's checkpoint; what does not fit is refused, naming the tensor. The MoE
names are checked on plait's MoE against transformers' Mixtral block.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.train.config import ConfigError
from plait.train.export import export_run
from plait.train.hf import (
    LLAMA_RULES,
    MIXTRAL_RULES,
    HFCheckpointError,
    check_init_from,
    export_state,
    hf_source,
    load_hf_checkpoint,
    parse_size,
    rules_for,
    with_default_model_config,
)
from plait.train.llama import Llama, LlamaConfig

from harness import run_on_ranks
from train_helpers import TINY, assert_losses_close, run_train, train_on_rank

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

HF: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention
    "intermediate_size": 64,
    "vocab_size": 260,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 5000.0,  # not the default: the config's value must reach plait
}


def _save_hf(directory: Path, *, tied: bool, shard: str | None = None) -> Any:
    """A seeded random transformers Llama (norm gains not all ones) saved to ``directory``;
    returns the model, in eval mode."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**HF, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, **kwargs)
    return model


def _plait_from(directory: Path, seq_len: int = 16) -> Llama:
    model = Llama(LlamaConfig.from_file(directory / "config.json"), seq_len).eval()
    load_hf_checkpoint([model], directory)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untied model in one ``model.safetensors``."""
    directory = tmp_path_factory.mktemp("hf-llama")
    _save_hf(directory, tied=False)
    return directory


# ----------------------------------------------------------------------------------------
# Names
# ----------------------------------------------------------------------------------------


def test_name_rules() -> None:
    def key(name: str, shape: tuple[int, ...] = (4, 4), **kw: Any) -> tuple[str, ...]:
        source = hf_source(LLAMA_RULES, name, shape, **kw)
        assert source is not None, name
        return source.keys

    assert key("blocks.3.attn.q.weight") == ("model.layers.3.self_attn.q_proj.weight",)
    # Suffixes carry over: Qwen2's biases, Qwen3's per-head norms.
    assert key("blocks.0.attn.k.bias") == ("model.layers.0.self_attn.k_proj.bias",)
    assert key("blocks.1.attn.q_norm.weight") == ("model.layers.1.self_attn.q_norm.weight",)
    assert key("blocks.1.mlp.down.weight") == ("model.layers.1.mlp.down_proj.weight",)
    assert key("head.weight") == ("lm_head.weight",)
    assert key("head.weight", tied=True) == ("model.embed_tokens.weight",)
    assert key("blocks.0.mlp.router.gate.weight") == ("model.layers.0.mlp.gate.weight",)
    # Stacked experts: one tensor per expert (Qwen3-MoE and Mixtral names), transposed.
    qwen = hf_source(LLAMA_RULES, "blocks.2.mlp.experts.w2", (3, 8, 4))
    assert qwen is not None and qwen.stacked and qwen.transpose
    assert qwen.keys == tuple(f"model.layers.2.mlp.experts.{j}.down_proj.weight" for j in range(3))
    mixtral = hf_source(MIXTRAL_RULES, "blocks.0.mlp.experts.w3", (2, 4, 8))
    assert mixtral is not None
    assert mixtral.keys[1] == "model.layers.0.block_sparse_moe.experts.1.w3.weight"
    assert hf_source(LLAMA_RULES, "pos_emb.weight", (4, 4)) is None  # the GPT's
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2KiB") == 2048
    with pytest.raises(ConfigError, match="--max-shard-size"):
        parse_size("lots")


# ----------------------------------------------------------------------------------------
# Logits equal to transformers'
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tied", "shard"), [(False, None), (True, "20KB"), (False, "20KB")])
def test_logits_match_transformers(tmp_path: Path, tied: bool, shard: str | None) -> None:
    reference = _save_hf(tmp_path, tied=tied, shard=shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    model = _plait_from(tmp_path)
    idx = torch.randint(0, HF["vocab_size"], (2, 16))
    with torch.no_grad():
        expected = reference(idx).logits
        torch.testing.assert_close(model(idx), expected, rtol=0, atol=1e-5)
    assert (model.head is not None and model.tok_emb is not None) and (
        model.head.weight is model.tok_emb.weight
    ) == tied


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_loads_into_cuda_parameters(hf_dir: Path) -> None:
    cpu = _plait_from(hf_dir)
    model = Llama(LlamaConfig.from_file(hf_dir / "config.json"), 16).cuda().eval()
    load_hf_checkpoint([model], hf_dir)
    idx = torch.randint(0, HF["vocab_size"], (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(idx.cuda()).cpu(), cpu(idx), rtol=0, atol=1e-4)


def test_casts_half_precision(tmp_path: Path, hf_dir: Path) -> None:
    """bf16 weights load into float32 parameters (cast, values kept)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(hf_dir / "model.safetensors"))
    save_file({k: v.bfloat16() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    model = _plait_from(tmp_path)
    assert model.tok_emb is not None
    expected = state["model.embed_tokens.weight"].bfloat16().float()
    assert model.tok_emb.weight.dtype == torch.float32
    torch.testing.assert_close(model.tok_emb.weight.detach(), expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------


def _rewrite(src: Path, dst: Path, change: Any) -> Path:
    """A copy of checkpoint ``src`` with its tensors passed through ``change(dict)``."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    state = change(load_file(str(src / "model.safetensors")))
    save_file(state, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_refusals(tmp_path: Path, hf_dir: Path) -> None:
    fresh = Llama(LlamaConfig.from_file(hf_dir / "config.json"), 16)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}

    def drop(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        del state["model.layers.1.mlp.up_proj.weight"]
        return state

    def extra(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(32, 32)
        state["model.rotary_emb.inv_freq"] = torch.zeros(4)  # harmless: recomputed
        return state

    def reshape(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state["model.norm.weight"] = torch.ones(31)
        return state

    def integer(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state["model.norm.weight"] = state["model.norm.weight"].to(torch.int32)
        return state

    cases = {
        "no tensor model.layers.1.mlp.up_proj.weight": drop,
        r"no place for tensor model.layers.2.self_attn.q_proj.weight \(model.safetensors\)": extra,
        r"model.norm.weight \(model.safetensors\) has shape \[31\].*needs \[32\]": reshape,
        "model.norm.weight.*is I32": integer,
    }
    for i, (message, change) in enumerate(cases.items()):
        bad = _rewrite(hf_dir, tmp_path / f"bad{i}", change)
        with pytest.raises(HFCheckpointError, match=message):
            load_hf_checkpoint([fresh], bad)
    for k, v in fresh.state_dict().items():  # nothing was copied by a refused load
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    with pytest.raises(HFCheckpointError, match="neither model.safetensors"):
        load_hf_checkpoint([fresh], tmp_path)


def test_init_from_checks(tmp_path: Path, hf_dir: Path) -> None:
    """--init-from: refused for the GPT and for another model's shapes; without
    --model-config the directory's config.json is the model's."""
    with pytest.raises(ConfigError, match="trains plait's GPT"):
        check_init_from(TINY.replace(init_from=str(hf_dir)))
    defaulted = with_default_model_config(TINY.replace(init_from=str(hf_dir)))
    assert defaulted.model_config == str(hf_dir / "config.json")
    assert check_init_from(defaulted) == []
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**HF, "intermediate_size": 96}))
    with pytest.raises(ConfigError, match="intermediate_size 64 .--model-config: 96"):
        check_init_from(TINY.replace(init_from=str(hf_dir), model_config=str(other)))
    theta = tmp_path / "theta.json"
    theta.write_text(json.dumps({**HF, "rope_theta": 10000.0}))
    warnings = check_init_from(TINY.replace(init_from=str(hf_dir), model_config=str(theta)))
    assert len(warnings) == 1 and "rope_theta is 5000.0 there but 10000.0" in warnings[0], warnings
    with pytest.raises(ConfigError, match="--max-shard-size|no config.json"):
        with_default_model_config(TINY.replace(init_from=str(tmp_path)))


# ----------------------------------------------------------------------------------------
# Sharded layouts, training, export
# ----------------------------------------------------------------------------------------


def _train_cfg(hf_dir: Path) -> Any:
    return with_default_model_config(
        TINY.replace(init_from=str(hf_dir), steps=2, grad_clip=0.5, seq_len=32)
    )


@pytest.fixture(scope="module")
def reference_run(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return run_train(_train_cfg(hf_dir), 1, tmp_path_factory.mktemp("hf-run"))


#: Layout -> (ranks, settings). dp_shard x tp: fully_shard over tensor-parallel shards
#: (strided placements).
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "dp_shard2": (2, {"dp_shard": 2}),
    "tp2": (2, {"tp": 2, "dp_shard": 1}),
    "pp2": (2, {"pp": 2, "dp_shard": 1, "schedule": "1F1B"}),
    "dp_shard2_tp2": (4, {"dp_shard": 2, "tp": 2}),
}


def test_init_from_loads_the_weights(hf_dir: Path, tmp_path: Path) -> None:
    """A session started --init-from holds the checkpoint's weights, not random ones."""
    from plait.train.loop import _Session
    from plait.train.resolve import resolve

    cfg = resolve(_train_cfg(hf_dir).replace(run_dir=str(tmp_path)), 1)
    session = _Session(cfg)
    expected = _plait_from(hf_dir, seq_len=32).state_dict()
    loaded = session.modules[0].state_dict()
    assert loaded.keys() == expected.keys()
    for key, value in loaded.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_layouts_load_alike(
    name: str, hf_dir: Path, reference_run: Any, tmp_path: Path
) -> None:
    ranks, layout = LAYOUTS[name]
    cfg = _train_cfg(hf_dir).replace(**layout)
    for result in run_on_ranks(ranks, train_on_rank, cfg, str(tmp_path)):
        first = [result.val_losses[0]]
        assert_losses_close(first, [reference_run.val_losses[0]])
        assert_losses_close(result.losses, reference_run.losses)


def test_export_roundtrip(
    reference_run: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run exported (sharded) reads into transformers with its checkpoint's logits, and
    back into plait with the same weights. Neither loading draws initial values (the
    model is built empty and the checkpoint fills it)."""
    from plait.train import param_init
    from plait.train.checkpointing import latest_checkpoint
    from plait.train.sample import load_model

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("drew an initial value that the checkpoint overwrites")

    checkpoint = latest_checkpoint(reference_run.run_dir)
    assert checkpoint is not None
    with monkeypatch.context() as patched:
        patched.setattr(param_init, "initial_value", refuse)
        trained = load_model(checkpoint)
        out = export_run(reference_run.run_dir, tmp_path / "export", max_shard_size="30KB")
    assert (out / "model.safetensors.index.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["torch_dtype"] == "float32"
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    idx = torch.randint(0, HF["vocab_size"], (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(exported(idx).logits, trained(idx), rtol=0, atol=1e-5)
    again = _plait_from(out, seq_len=32)
    for (name, a), b in zip(trained.named_parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    with pytest.raises(ConfigError, match="not empty"):
        export_run(reference_run.run_dir, out)
    with pytest.raises(ConfigError, match="--step 1: .* has no checkpoint"):
        export_run(reference_run.run_dir, tmp_path / "e2", step=1)


def test_export_copies_the_tokenizer(
    reference_run: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run with a tokenizer exports tokenizer.json and the settings files beside it."""
    from plait.train import checkpointing

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"model": {}}')
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"eos_token": "x"}')
    real = checkpointing.read_info

    def with_tokenizer(path: Path) -> Any:
        info = real(path)
        config = {**info.config, "tokenizer": str(tmp_path / "tok" / "tokenizer.json")}
        return checkpointing.CheckpointInfo(info.step, info.world_size, config)

    monkeypatch.setattr(checkpointing, "read_info", with_tokenizer)
    out = export_run(reference_run.run_dir, tmp_path / "out")
    assert (out / "tokenizer.json").read_text() == '{"model": {}}'
    assert (out / "tokenizer_config.json").is_file()
    assert not (out / "special_tokens_map.json").exists()
    assert (out / "model.safetensors").is_file()  # 5GB shards: one file


def test_commands(
    reference_run: Any, hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """plait export, and plait train --init-from without --model-config."""
    from plait.cli import main

    out = tmp_path / "out"
    assert main(["export", "--run-dir", str(reference_run.run_dir), "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert main(["export", "--run-dir", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    launched: list[Any] = []
    monkeypatch.setattr("plait.train.cli.launch", launched.append)
    flags = ["--run-dir", str(tmp_path / "run"), "--nproc", "1", "--device", "cpu"]
    assert main(["train", "--init-from", str(hf_dir), "--seq-len", "32", *flags]) == 0
    (cfg,) = launched
    assert cfg.init_from == str(hf_dir) and cfg.model_config == str(hf_dir / "config.json")
    assert cfg.model_hash  # resolved from the directory's config.json
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**HF, "num_hidden_layers": 3}))
    wrong = ["--model-config", str(other), "--init-from", str(hf_dir), *flags]
    assert main(["train", *wrong]) == 2


def test_export_refuses_a_gpt_run(tmp_path: Path) -> None:
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    checkpoint.mkdir(parents=True)
    info = {"step": 1, "world_size": 1, "config": TINY.to_dict()}
    (checkpoint / "plait.json").write_text(json.dumps(info))
    with pytest.raises(ConfigError, match="trained plait's GPT"):
        export_run(tmp_path / "run", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        export_run(tmp_path / "nothing", tmp_path / "out")


# ----------------------------------------------------------------------------------------
# Mixture of experts
# ----------------------------------------------------------------------------------------


#: model_type -> (transformers config and model classes, settings beside HF's).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),  # q/k norms
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"head_dim": 8, "num_experts": 4, "moe_intermediate_size": 24, "mlp_only_layers": []},
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_match_transformers(tmp_path: Path, family: str) -> None:
    """Biases, per-head norms and stacked experts load by the same rules; exported, they
    give the checkpoint's tensors back."""
    from safetensors.torch import load_file

    config_class, model_class, extra = FAMILIES[family]
    settings = {**HF, "num_experts_per_tok": 2, **extra}
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**settings)
    reference = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():  # non-zero biases, norm gains not all ones
        for name, p in reference.named_parameters():
            if name.endswith("bias"):
                p.normal_()
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    reference.save_pretrained(tmp_path)
    # As transformers wrote it: Qwen3-MoE's expert count as num_local_experts (its
    # published configs say num_experts; plait reads both).
    saved = json.loads((tmp_path / "config.json").read_text())
    model = _plait_from(tmp_path)
    idx = torch.randint(0, HF["vocab_size"], (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), reference(idx).logits, rtol=0, atol=1e-5)
    exported = export_state(model, rules_for(saved))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert exported.keys() == tensors.keys()
    for key, value in tensors.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0, msg=key)


class _MoEModel(torch.nn.Module):
    """Names a MoE as a Llama block's MLP: ``blocks.0.mlp``."""

    def __init__(self, moe: torch.nn.Module) -> None:
        super().__init__()
        block = torch.nn.Module()
        block.mlp = moe
        self.blocks = torch.nn.ModuleList([block])


def test_moe_matches_mixtral_block(tmp_path: Path) -> None:
    """plait's MoE loaded from a Mixtral checkpoint's layer computes transformers' block;
    exported, it gives the same tensors back."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from plait.experts import MoE

    dim, hidden, experts, top_k = 16, 24, 4, 2
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=dim,
        intermediate_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        vocab_size=260,
        max_position_embeddings=32,
    )
    mixtral = transformers.MixtralForCausalLM(config).float().eval()
    mixtral.save_pretrained(tmp_path / "mixtral")
    with safe_open(str(tmp_path / "mixtral" / "model.safetensors"), "pt") as f:
        layer = {k: f.get_tensor(k) for k in f.keys() if ".block_sparse_moe." in k}  # noqa: SIM118
    assert len(layer) == 1 + 3 * experts  # the router and each expert's w1, w2, w3
    (tmp_path / "moe").mkdir()
    save_file(layer, str(tmp_path / "moe" / "model.safetensors"))
    (tmp_path / "moe" / "config.json").write_text(json.dumps({"model_type": "mixtral"}))

    moe = MoE(dim, hidden, experts, top_k, route_norm=True)  # Mixtral renormalises top-k
    model = _MoEModel(moe).eval()
    load_hf_checkpoint([model], tmp_path / "moe")
    x = torch.randn(2, 8, dim)
    with torch.no_grad():
        expected = mixtral.model.layers[0].mlp(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        torch.testing.assert_close(moe(x), expected, rtol=0, atol=1e-5)
    back = export_state(model, MIXTRAL_RULES)
    assert back.keys() == layer.keys()
    for key, value in layer.items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0, msg=key)
