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
For a mixture of experts ``N`` is the *active* count: a token goes through its ``top_k``
routed experts, the shared ones and the router, not through all experts.

A mixture-of-experts block (``plait.experts.MoE`` in place of the MLP) is counted in three
parts: what tensor parallelism splits (attention, the shared experts), what it replicates
(norms, the attention's row-wise bias, the router's gate: plait's recipe leaves the router
whole on every tp rank) and the routed experts, which expert parallelism splits instead
(tensor parallelism splits their rows, not their matrices, and ``fully_shard`` shards them
over its tp ranks too: :mod:`plait.plan.shards`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.plan.spec import ModelSpec
from plait.train import presets as train_presets
from plait.train.gpt_config import GPTConfig
from plait.train.llama import LlamaConfig, LlamaConfigError

# Re-exported: the rule is the trainer's (plait.train.model_spec), the CLI asks it here.
from plait.train.model_spec import expert_hidden_default as expert_hidden_default

__all__ = [
    "PRESET_ALIASES",
    "ParamCounts",
    "attention_flops_per_token",
    "expert_hidden_default",
    "flops_per_token",
    "from_hf_config",
    "gpt",
    "param_counts",
    "preset",
    "preset_names",
]

#: The planner's names for Llama 3.1 (its calibration and published-run rows use them): the
#: ``plait train`` presets of those names (Meta's published config.json), whose ``source``
#: the printed commands build.
PRESET_ALIASES = {"llama3-8b": "llama3.1-8b", "llama3-70b": "llama3.1-70b"}
PRESET_ALIASES["llama3-405b"] = "llama3.1-405b"


def preset_names() -> list[str]:
    """Every name ``preset`` takes: the planner's aliases and ``plait train``'s presets."""
    return [*PRESET_ALIASES, *train_presets.PRESETS]


@functools.cache
def preset(name: str) -> ModelSpec:
    """The preset ``name`` (case-insensitive): one of ``plait train``'s
    (:mod:`plait.train.presets`: Llama, Qwen, Mistral, Mixtral, Qwen3-MoE), read as its
    config.json is, or a :data:`PRESET_ALIASES` name of one. ValueError listing the known
    ones."""
    key = name.lower()
    source = PRESET_ALIASES.get(key, key)
    if source not in train_presets.PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(preset_names())}")
    spec = from_hf_config(train_presets.PRESETS[source])
    return dataclasses.replace(spec, name=key, source=source)


def gpt(
    n_layer: int,
    n_head: int,
    d_model: int,
    seq_len: int,
    vocab: int = 256,
    tied: bool = False,
    *,
    experts: int = 0,
    top_k: int = 2,
    shared_experts: int = 0,
    expert_hidden: int = 0,
) -> ModelSpec:
    """plait's GPT (:mod:`plait.train.model`) from ``plait train``'s flags: GELU MLP of
    width ``4 d_model``, biased linears, LayerNorm, learned positions, byte vocabulary.
    With ``experts`` > 0 every block's MLP is a mixture of experts as ``plait train
    --experts`` builds it (``expert_hidden`` 0: :func:`expert_hidden_default`). The spec is
    the trainer's own (``GPTConfig.spec``); ValueError in flag words for what it refuses."""
    if n_head < 1 or d_model % n_head:
        raise ValueError(f"--d-model {d_model} must be a positive multiple of --n-head {n_head}")
    if experts > 0 and not 1 <= top_k <= experts:
        # The spec's refusal in its words (GPTConfig, built first, would say it in its own).
        hidden = expert_hidden or expert_hidden_default(4 * d_model, top_k, shared_experts)
        plus = f"+{shared_experts}" if shared_experts else ""
        name = f"gpt-{n_layer}x{d_model}-moe{experts}x{hidden}-top{top_k}{plus}"
        raise ValueError(f"{name}: --top-k {top_k} must be in 1..--experts {experts}")
    config = GPTConfig(
        vocab_size=vocab,
        seq_len=seq_len,
        n_layer=n_layer,
        n_head=n_head,
        d_model=d_model,
        tie_weights=tied,
        experts=experts,
        top_k=top_k,
        shared_experts=shared_experts,
        expert_hidden=expert_hidden,
    )
    return config.spec()


_HF_KEYS = {  # ModelSpec field: config.json key
    "d_model": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "ffn_hidden": "intermediate_size",
    "vocab": "vocab_size",
}


def from_hf_config(config: str | Path | Mapping[str, Any]) -> ModelSpec:
    """A decoder from a Hugging Face ``config.json`` (a path or its contents), named by its
    ``_name_or_path`` (contents; default ``hf-config``) or its folder (a path), whose
    ``source`` is the path (contents: none). ValueError names a missing key.

    A config ``plait train`` can build (its ``model_type`` or ``architectures`` one of the
    Llama families :class:`~plait.train.llama.LlamaConfig` reads, with nothing it refuses) is
    the trainer's own description (``LlamaConfig.from_hf(values).spec()``: the family's
    defaults for keys the file leaves out, as plait train builds it). Any other, which the
    planner prices but plait cannot train (DeepSeek-V3's ``n_routed_experts``,
    ``n_shared_experts`` and ``first_k_dense_replace``, a rope scaling plait does not
    build, a config naming no family), is read here as a Llama's: ``hidden_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` (default: no
    grouped-query attention), ``intermediate_size``, ``vocab_size``,
    ``tie_word_embeddings`` (default false) and ``head_dim`` (default: ``hidden_size /
    num_attention_heads``; Qwen3's and Qwen3-MoE's ``model_type`` add their per-head query
    and key norms), and the routed experts of a mixture of experts where the config has
    them (:func:`_hf_moe`; DeepSeek's latent attention is not exact).
    """
    if isinstance(config, Mapping):
        values, name = dict(config), str(config.get("_name_or_path", "hf-config"))
    else:
        path = Path(config)
        values = train_presets.read_config(path, f"--hf-config {path}", ValueError)
        name = path.parent.name or path.stem
    missing = [key for key in _HF_KEYS.values() if key not in values]
    if missing:
        raise ValueError(
            f"--hf-config: {', '.join(missing)} missing; a Llama-family config.json has "
            f"{', '.join(_HF_KEYS.values())}"
        )
    source = "" if isinstance(config, Mapping) else str(config)
    if "model_type" in values or "architectures" in values:
        try:
            return LlamaConfig.from_hf(values).spec(name=name, source=source)
        except LlamaConfigError:
            pass  # a family or a feature plait does not build: the planner's own reading
    return _generic(values, name, source)


def _generic(values: Mapping[str, Any], name: str, source: str) -> ModelSpec:
    """The planner's reading of a config.json ``plait train`` cannot build
    (:func:`from_hf_config`)."""
    n = {field: int(values[key]) for field, key in _HF_KEYS.items()}
    kind = values.get("model_type")
    spec = ModelSpec(
        name=name,
        layers=n["layers"],
        d_model=n["d_model"],
        heads=n["heads"],
        kv_heads=int(values.get("num_key_value_heads") or n["heads"]),
        ffn_hidden=n["ffn_hidden"],
        vocab=n["vocab"],
        tied=bool(values.get("tie_word_embeddings", False)),
        head_dim=int(values.get("head_dim") or 0),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
    )
    return dataclasses.replace(spec, source=source, **_hf_moe(values, n["ffn_hidden"]))


def _hf_moe(values: Mapping[str, Any], ffn_hidden: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json, when it has routed experts: Mixtral's
    ``num_local_experts`` (experts as wide as ``intermediate_size``), Qwen-MoE's
    ``num_experts`` / DeepSeek's ``n_routed_experts`` with ``moe_intermediate_size``,
    ``num_experts_per_tok``, DeepSeek's ``n_shared_experts`` and ``first_k_dense_replace`` (or
    Qwen3-MoE's leading ``mlp_only_layers``)."""
    experts = next(
        (
            int(values[k])
            for k in ("num_local_experts", "n_routed_experts", "num_experts")
            if values.get(k)
        ),
        0,
    )
    if not experts:
        return {}
    return {
        "experts": experts,
        "top_k": int(values.get("num_experts_per_tok") or 1),
        "shared_experts": int(values.get("n_shared_experts") or 0),
        "expert_hidden": int(values.get("moe_intermediate_size") or ffn_hidden),
        "dense_layers": int(values.get("first_k_dense_replace") or 0)
        or _leading(values.get("mlp_only_layers") or []),
    }


def _leading(layers: list[int]) -> int:
    """How many leading blocks Qwen3-MoE's ``mlp_only_layers`` makes dense (``[0, 1]``: 2);
    dense blocks after a MoE block are not modelled (counted as MoE blocks)."""
    count = 0
    while count in layers:
        count += 1
    return count


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by how plait's recipe treats them (numbers of elements).

    ``block_*``: a block with a dense MLP; ``moe_*``: a mixture-of-experts block without
    its routed experts; ``expert``: one routed expert (``experts`` of them per MoE block,
    ``top_k`` active per token); blocks from ``dense_layers`` on are MoE blocks when
    ``experts`` > 0.
    """

    block_split: int  # one block's matrices (and column-wise biases): split by tp
    block_replicated: int  # one block's norms and row-wise output biases: whole on every tp rank
    embedding: int  # token embedding (split by vocabulary under tp)
    positions: int  # learned positions (split by position under sequence parallelism)
    final_norm: int
    head: int  # 0 when tied to the embedding
    moe_split: int = 0  # attention and shared experts (their matrices, column-wise biases)
    moe_replicated: int = 0  # norms, row-wise bias, the router's gate
    router: int = 0  # of moe_replicated: the gate (d_model x experts), a matrix
    expert: int = 0  # one routed expert's three matrices
    experts: int = 0
    top_k: int = 0
    dense_layers: int = 0

    def split_layers(self, layers: int) -> tuple[int, int]:
        """``(dense, moe)`` blocks among the first ``layers``."""
        if not self.experts:
            return layers, 0
        dense = min(self.dense_layers, layers)
        return dense, layers - dense

    @property
    def moe_block(self) -> int:
        """One MoE block, all its routed experts included."""
        return self.moe_split + self.moe_replicated + self.experts * self.expert

    def total(self, layers: int) -> int:
        """All parameters of a model of the first ``layers`` blocks."""
        dense, moe = self.split_layers(layers)
        block = self.block_split + self.block_replicated
        root = self.embedding + self.positions + self.final_norm + self.head
        return dense * block + moe * self.moe_block + root

    def active(self, layers: int) -> int:
        """Parameters one token goes through (its ``top_k`` routed experts of each MoE
        block, not all of them); :meth:`total` for a dense model."""
        _, moe = self.split_layers(layers)
        return self.total(layers) - moe * (self.experts - self.top_k) * self.expert

    def matmul_per_token(self, layers: int) -> int:
        """Matrix elements a token multiplies in ``layers`` blocks (the ``N`` of ``6 N``
        without the head): tp-split matrices, the router and ``top_k`` experts."""
        dense, moe = self.split_layers(layers)
        return dense * self.block_split + moe * (
            self.moe_split + self.router + self.top_k * self.expert
        )


def param_counts(m: ModelSpec) -> ParamCounts:
    """Count ``m``'s parameters (see :class:`ParamCounts`)."""
    d, f = m.d_model, m.ffn_hidden
    q, kv = m.q_width, m.kv_width  # width of q, and of k and of v
    attn = d * q + 2 * d * kv + q * d  # q, k, v, output projection
    mlp = (3 if m.gated else 2) * d * f
    split_bias = (q + 2 * kv + f) if m.bias else 0  # q, k, v and the first MLP linear
    replicated_bias = 2 * d if m.bias else 0  # the two row-wise output projections
    norm = d * (2 if m.norm_bias else 1)
    qk_norms = 2 * m.dim_head if m.qk_norm else 0  # one gain per head dimension, shared
    moe: dict[str, int] = {}
    if m.experts:
        # plait.experts: a bias-free gate and bias-free SwiGLU experts (shared ones: one
        # SwiGLU as wide as all of them); the attention keeps its biases.
        h = m.expert_hidden
        attn_bias = (q + 2 * kv) if m.bias else 0
        moe = {
            "moe_split": attn + attn_bias + 3 * d * h * m.shared_experts,
            "moe_replicated": (d if m.bias else 0) + 2 * norm + qk_norms + d * m.experts,
            "router": d * m.experts,
            "expert": 3 * d * h,
            "experts": m.experts,
            "top_k": m.top_k,
            "dense_layers": m.dense_layers,
        }
    return ParamCounts(
        block_split=attn + mlp + split_bias,
        block_replicated=replicated_bias + 2 * norm + qk_norms,
        embedding=m.vocab * d,
        positions=m.positions * d,
        final_norm=norm,
        head=0 if m.tied else m.vocab * d,
        **moe,
    )


def attention_flops_per_token(m: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs of one layer's attention scores and weighted values, per token."""
    return 4.0 * seq_len * m.q_width


def flops_per_token(m: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token (module docstring): ``6 N + 12 L d T``, ``N`` the active
    matrices."""
    c = param_counts(m)
    matmul = c.matmul_per_token(m.layers) + m.vocab * m.d_model  # the head, tied or not
    return 6.0 * matmul + 3 * m.layers * attention_flops_per_token(m, seq_len)
