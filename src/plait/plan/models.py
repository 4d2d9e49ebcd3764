"""The models the planner knows: presets, Hugging Face configs, plait's GPT; their parameter
counts and FLOPs.

Parameters are counted by the part of plait's recipe that treats them differently
(:class:`ParamCounts`): block matrices that tensor parallelism splits, block vectors it
replicates (norm gains, row-wise output biases), and the root's embeddings, final norm and
head, which ``fully_shard`` keeps in the root unit.

FLOPs follow the usual convention (PaLM, Megatron, torchtitan): a training token costs
``6 N`` for the matrix multiplications of the ``N`` non-embedding parameters (the head
included, tied or not) plus ``12 L d T`` for attention scores and values (``L`` layers,
attention width ``d``, sequence ``T``; causal masking not discounted). MFU uses this count.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.plan.spec import ModelSpec

__all__ = [
    "PRESETS",
    "ParamCounts",
    "attention_flops_per_token",
    "flops_per_token",
    "from_hf_config",
    "gpt",
    "param_counts",
    "preset",
]

#: Llama 3.1 shapes as published (Meta's model cards / Hugging Face ``config.json``).
PRESETS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 128, 8, 53248, 128256),
}


def preset(name: str) -> ModelSpec:
    """The preset ``name`` (case-insensitive); ValueError listing the known ones."""
    if name.lower() not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name.lower()]


def gpt(
    n_layer: int, n_head: int, d_model: int, seq_len: int, vocab: int = 256, tied: bool = False
) -> ModelSpec:
    """plait's GPT (:mod:`plait.train.model`) from ``plait train``'s flags: GELU MLP of
    width ``4 d_model``, biased linears, LayerNorm, learned positions, byte vocabulary."""
    if n_head < 1 or d_model % n_head:
        raise ValueError(f"--d-model {d_model} must be a positive multiple of --n-head {n_head}")
    return ModelSpec(
        name=f"gpt-{n_layer}x{d_model}",
        layers=n_layer,
        d_model=d_model,
        heads=n_head,
        kv_heads=n_head,
        ffn_hidden=4 * d_model,
        vocab=vocab,
        gated=False,
        tied=tied,
        bias=True,
        norm_bias=True,
        positions=seq_len,
    )


_HF_KEYS = {  # ModelSpec field: config.json key
    "d_model": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "ffn_hidden": "intermediate_size",
    "vocab": "vocab_size",
}


def from_hf_config(config: str | Path | Mapping[str, Any]) -> ModelSpec:
    """A Llama-family decoder from a Hugging Face ``config.json`` (a path or its contents).

    Reads ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads`` (default: no grouped-query attention), ``intermediate_size``,
    ``vocab_size`` and ``tie_word_embeddings`` (default false). ValueError names a missing key.
    """
    if isinstance(config, Mapping):
        values, name = dict(config), str(config.get("_name_or_path", "hf-config"))
    else:
        path = Path(config)
        try:
            values = json.loads(path.read_text())
        except OSError as err:
            raise ValueError(f"--hf-config {path}: cannot read it ({err.strerror})") from err
        except json.JSONDecodeError as err:
            raise ValueError(f"--hf-config {path}: not valid JSON: {err}") from err
        name = path.parent.name or path.stem
    missing = [key for key in _HF_KEYS.values() if key not in values]
    if missing:
        raise ValueError(
            f"--hf-config: {', '.join(missing)} missing; a Llama-family config.json has "
            f"{', '.join(_HF_KEYS.values())}"
        )
    n = {field: int(values[key]) for field, key in _HF_KEYS.items()}
    return ModelSpec(
        name=name,
        layers=n["layers"],
        d_model=n["d_model"],
        heads=n["heads"],
        kv_heads=int(values.get("num_key_value_heads") or n["heads"]),
        ffn_hidden=n["ffn_hidden"],
        vocab=n["vocab"],
        tied=bool(values.get("tie_word_embeddings", False)),
    )


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by how plait's recipe treats them (numbers of elements)."""

    block_split: int  # one block's matrices (and column-wise biases): split by tp
    block_replicated: int  # one block's norms and row-wise output biases: whole on every tp rank
    embedding: int  # token embedding (split by vocabulary under tp)
    positions: int  # learned positions (split by position under sequence parallelism)
    final_norm: int
    head: int  # 0 when tied to the embedding

    def total(self, layers: int) -> int:
        block = self.block_split + self.block_replicated
        return layers * block + self.embedding + self.positions + self.final_norm + self.head


def param_counts(m: ModelSpec) -> ParamCounts:
    """Count ``m``'s parameters (see :class:`ParamCounts`)."""
    d, f = m.d_model, m.ffn_hidden
    kv = m.kv_heads * (d // m.heads)  # width of k and of v
    attn = d * d + 2 * d * kv + d * d  # q, k, v, output projection
    mlp = (3 if m.gated else 2) * d * f
    split_bias = (d + 2 * kv + f) if m.bias else 0  # q, k, v and the first MLP linear
    replicated_bias = 2 * d if m.bias else 0  # the two row-wise output projections
    norm = d * (2 if m.norm_bias else 1)
    return ParamCounts(
        block_split=attn + mlp + split_bias,
        block_replicated=replicated_bias + 2 * norm,
        embedding=m.vocab * d,
        positions=m.positions * d,
        final_norm=norm,
        head=0 if m.tied else m.vocab * d,
    )


def attention_flops_per_token(m: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs of one layer's attention scores and weighted values, per token."""
    return 4.0 * seq_len * m.d_model


def flops_per_token(m: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token (module docstring): ``6 N + 12 L d T``."""
    c = param_counts(m)
    matmul = m.layers * c.block_split + m.vocab * m.d_model  # the head, tied or not
    return 6.0 * matmul + 3 * m.layers * attention_flops_per_token(m, seq_len)
