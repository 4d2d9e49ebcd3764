"""``plait train --model-config``: a Llama-family model built from a Hugging Face
``config.json``. Its forward matches a reference written out with plain tensor ops; it
trains at dp_shard 2, tp 2 and pp 2 like one process; configurations it cannot train are
refused before launch."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.train.checkpointing import check_settings, list_checkpoints
from plait.train.config import ConfigError
from plait.train.export import export_run
from plait.train.llama import Llama, LlamaConfig, LlamaConfigError, rope_inv_freq
from plait.train.loop import model_settings
from plait.train.resolve import resolve

from harness import run_on_ranks
from train_helpers import TINY, assert_losses_close, run_train, train_on_rank

HF: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def _write(path: Path, **changes: Any) -> str:
    values = {**HF, **changes}
    values = {k: v for k, v in values.items() if v is not ...}  # ...: drop the key
    path.write_text(json.dumps(values))
    return str(path)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """``x`` (B, H, T, d) rotated: pair (i, i + d/2) turned by ``pos * theta^(-2i/d)``."""
    d, t = x.shape[-1], x.shape[-2]
    half = d // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * freq[None, :]  # (T, d/2)
    cos, sin = ang.cos().float(), ang.sin().float()
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def _reference_block(block: Any, x: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    b, t, _ = x.shape
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_head
    a = _rms(x, block.ln1.weight, cfg.rms_norm_eps)
    q = (a @ block.attn.q.weight.T).view(b, t, h, d).transpose(1, 2)
    k = (a @ block.attn.k.weight.T).view(b, t, kv, d).transpose(1, 2)
    v = (a @ block.attn.v.weight.T).view(b, t, kv, d).transpose(1, 2)
    q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
    heads = []
    for i in range(h):  # query head i reads kv head i // (h / kv)
        j = i // (h // kv)
        s = q[:, i] @ k[:, j].transpose(-1, -2) / math.sqrt(d)  # (B, T, T)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(s.softmax(-1) @ v[:, j])
    y = torch.stack(heads, dim=2).reshape(b, t, h * d)
    x = x + y @ block.attn.proj.weight.T
    m = _rms(x, block.ln2.weight, cfg.rms_norm_eps)
    gate, up = m @ block.mlp.gate.weight.T, m @ block.mlp.up.weight.T
    return x + (gate * torch.sigmoid(gate) * up) @ block.mlp.down.weight.T


@pytest.mark.parametrize("tied", [False, True])
def test_forward_matches_reference(tied: bool) -> None:
    cfg = LlamaConfig.from_hf({**HF, "tie_word_embeddings": tied})
    torch.manual_seed(0)
    model = Llama(cfg, seq_len=16)
    with torch.no_grad():  # non-trivial norm gains
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert model.tok_emb is not None and model.ln_f is not None and model.head is not None
        x = model.tok_emb(idx)
        block = model.blocks[0]
        torch.testing.assert_close(block(x), _reference_block(block, x, cfg), rtol=0, atol=1e-6)
        for blk in model.blocks:
            x = _reference_block(blk, x, cfg)
        w = model.tok_emb.weight if tied else model.head.weight
        logits = _rms(x, model.ln_f.weight, cfg.rms_norm_eps) @ w.T
        assert (model.head.weight is model.tok_emb.weight) == tied
        torch.testing.assert_close(model(idx), logits, rtol=0, atol=1e-5)


def test_positions_shift_the_rotation() -> None:
    """Global positions (context parallelism) reach every attention's rotary embedding."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_hf(HF), seq_len=16)
    idx = torch.randint(0, 256, (1, 16))
    whole = model(idx)
    model.positions = torch.arange(0, 32, 2)  # every other position
    assert all(b.attn.positions is model.positions for b in model.blocks)
    stretched = model(idx)
    # Token 0 sees only itself (any position alike); later tokens see keys twice as far.
    torch.testing.assert_close(stretched[:, 0], whole[:, 0])
    assert not torch.allclose(stretched[:, 1:], whole[:, 1:])
    model.positions = None
    torch.testing.assert_close(model(idx), whole)
    assert whole.shape == (1, 16, 256)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _write(tmp_path_factory.mktemp("llama") / "config.json")


@pytest.fixture(scope="module")
def reference(config_file: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    run_dir = tmp_path_factory.mktemp("llama-reference")
    return run_train(TINY.replace(model_config=config_file, grad_clip=0.5), 1, run_dir)


LAYOUTS: dict[str, dict[str, Any]] = {
    "dp_shard2": {"dp_shard": 2},
    "tp2": {"tp": 2, "dp_shard": 1},
    "pp2": {"pp": 2, "dp_shard": 1, "schedule": "1F1B"},
    # 4 stages over 4 blocks with the ends weighing one: 1, 2, 1, 0 (a head-only last stage).
    "pp2_interleaved_end_blocks": {
        "pp": 2,
        "dp_shard": 1,
        "schedule": "Interleaved1F1B",
        "end_blocks": 1,
    },
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(
    name: str, config_file: str, reference: Any, tmp_path: Path
) -> None:
    cfg = TINY.replace(model_config=config_file, grad_clip=0.5, **LAYOUTS[name])
    results = run_on_ranks(2, train_on_rank, cfg, str(tmp_path))
    for result in results:
        # The tied matrix's gradient sums the embedding's and the head's parts in another
        # order under tp; by step 3 AdamW has grown that to ~3e-6 (an untied copy: 2e-2).
        assert_losses_close(result.losses, reference.losses, tol=1e-5)
        assert_losses_close(list(result.val_losses.values()), list(reference.val_losses.values()))


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(LlamaConfigError, match="num_key_value_heads"):
        LlamaConfig.from_hf({**HF, "num_key_value_heads": 3})
    with pytest.raises(LlamaConfigError, match="rope_scaling type 'yarn'"):
        LlamaConfig.from_hf({**HF, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    cases = {
        "intermediate_size": {"intermediate_size": ...},
        "vocab_size 128 is smaller than the 256": {"vocab_size": 128},
        "max_position_embeddings 16": {"max_position_embeddings": 16},
    }
    for i, (message, changes) in enumerate(cases.items()):
        path = _write(tmp_path / f"config{i}.json", **changes)
        with pytest.raises(ConfigError, match=message):
            resolve(TINY.replace(model_config=path), 1)  # TINY: seq_len 32
    with pytest.raises(ConfigError, match="cannot read"):
        resolve(TINY.replace(model_config=str(tmp_path / "absent.json")), 1)
    with pytest.raises(ConfigError, match="--dropout 0.1 with --model-config"):
        resolve(TINY.replace(model_config=_write(tmp_path / "ok.json"), dropout=0.1), 1)


def test_llama3_rope_scaling() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    cfg = LlamaConfig.from_hf({**HF, "rope_scaling": scaling})
    plain = LlamaConfig.from_hf(HF)
    scaled, base = rope_inv_freq(cfg), rope_inv_freq(plain)
    assert scaled[0] == base[0]  # high frequencies kept
    torch.testing.assert_close(scaled[-1], base[-1] / 8)  # low ones divided by the factor


def test_checkpoint_of_another_model_refused(
    config_file: str, reference: Any, tmp_path: Path
) -> None:
    """A checkpoint of the Llama loads only into the Llama of the same config.json."""
    latest = list_checkpoints(reference.run_dir)[-1]
    same = resolve(TINY.replace(model_config=config_file), 1)
    check_settings(latest, model_settings(same))
    other = _write(tmp_path / "config.json", intermediate_size=96)
    for cfg in (TINY.replace(model_config=other), TINY):  # another Llama, the GPT
        with pytest.raises(ConfigError, match="model_hash"):
            check_settings(latest, model_settings(resolve(cfg, 1)))


def test_sample_from_a_llama_run(reference: Any) -> None:
    """plait sample loads a Llama run's checkpoint and writes bytes."""
    from plait.train.checkpointing import latest_checkpoint
    from plait.train.sample import generate, load_model

    path = latest_checkpoint(reference.run_dir)
    assert path is not None
    model = load_model(path)
    out = generate(model, b"def ", 8, temperature=0.8, top_k=0, seed=0)
    assert len(out) == 8


@pytest.fixture(scope="module")
def tied_config(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _write(tmp_path_factory.mktemp("llama-tied") / "config.json", tie_word_embeddings=True)


@pytest.mark.parametrize("name", ["dp_shard2", "tp2"])
def test_tied_head_layouts_match_single_process(
    name: str, tied_config: str, tmp_path: Path
) -> None:
    """One matrix as embedding and head (Llama 3.2, Qwen2.5-0.5B): fully_shard puts it in
    one unit, tensor parallelism splits it by vocabulary for both uses."""
    cfg = TINY.replace(model_config=tied_config, grad_clip=0.5)
    reference = run_train(cfg, 1, tmp_path / "reference")
    results = run_on_ranks(2, train_on_rank, cfg.replace(**LAYOUTS[name]), str(tmp_path / name))
    for result in results:
        # The tied matrix's gradient sums the embedding's and the head's parts in another
        # order under tp; by step 3 AdamW has grown that to ~3e-6 (an untied copy: 2e-2).
        assert_losses_close(result.losses, reference.losses, tol=1e-5)


TIED_PIPELINES: dict[str, tuple[int, dict[str, Any]]] = {
    "pp2": (2, {"pp": 2, "dp_shard": 1, "schedule": "1F1B"}),
    "pp2_dp_shard2": (4, {"pp": 2, "dp_shard": 2, "schedule": "1F1B"}),
    # Tensor parallelism leaves the embedding's gradient replicated, the head's sharded.
    "pp2_tp2": (4, {"pp": 2, "dp_shard": 1, "tp": 2, "schedule": "1F1B"}),
    # V-shaped: the first and the last stage on rank 0, their gradients summed there.
    "pp2_zbv": (2, {"pp": 2, "dp_shard": 1, "schedule": "ZBVZeroBubble"}),
}


@pytest.mark.parametrize("name", list(TIED_PIPELINES))
def test_tied_head_with_a_pipeline_matches_single_process(
    name: str, tied_config: str, tmp_path: Path
) -> None:
    """The first stage's embedding and the last stage's head, two copies of the tied
    matrix, get the sum of their gradients (counted once by clipping): like one process."""
    cfg = TINY.replace(model_config=tied_config, grad_clip=0.5)
    reference = run_train(cfg, 1, tmp_path / "reference")
    world, layout = TIED_PIPELINES[name]
    results = run_on_ranks(world, train_on_rank, cfg.replace(**layout), str(tmp_path / name))
    for result in results:
        # Microbatches sum the gradients in another order (as for the untied pp2 layout).
        assert_losses_close(result.losses, reference.losses, tol=1e-5)
        assert_losses_close(list(result.val_losses.values()), list(reference.val_losses.values()))


def test_tied_head_pipeline_checkpoint_resumes_in_one_process(
    tied_config: str, tmp_path: Path
) -> None:
    """A pp 2 run's checkpoint (the tied matrix saved once, from either copy) continues in
    one process, and one process's continues at pp 2, with the uninterrupted losses."""
    cfg = TINY.replace(model_config=tied_config, grad_clip=0.5, steps=4, keep=5)
    full = run_train(cfg, 1, tmp_path / "full")
    pp2 = cfg.replace(**TIED_PIPELINES["pp2"][1])
    run_on_ranks(2, train_on_rank, pp2.replace(stop_after=2), str(tmp_path / "pp"))
    exported = export_run(tmp_path / "pp", tmp_path / "hf")  # one matrix, written once
    assert json.loads((exported / "config.json").read_text())["tie_word_embeddings"]
    one = run_train(cfg.replace(resume=True), 1, tmp_path / "pp")
    assert_losses_close(one.losses, full.losses[2:], tol=1e-5)
    run_train(cfg.replace(stop_after=2), 1, tmp_path / "one")
    back = run_on_ranks(2, train_on_rank, pp2.replace(resume=True), str(tmp_path / "one"))
    for result in back:
        assert_losses_close(result.losses, full.losses[2:], tol=1e-5)
