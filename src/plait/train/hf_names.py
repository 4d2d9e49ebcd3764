"""Hugging Face names of plait's parameters, and of a checkpoint directory's files.

A plait parameter and its transformers tensor(s) are related by rules over module paths
(:data:`LLAMA_RULES`, :data:`MIXTRAL_RULES`): a :class:`Rename` maps a module of plait to
a module of transformers and keeps the parameter's suffix, so ``.weight`` and ``.bias``
(Qwen2's q/k/v biases) and the per-head norms ``attn.q_norm`` / ``attn.k_norm`` (Qwen3's
``self_attn.q_norm``) map without a rule of their own. A :class:`Stack` fills one plait
parameter from one transformers tensor per expert: plait's routed experts are stacked
``(experts, in, out)`` (:class:`plait.experts.GroupedExperts`: ``x @ w``), transformers
keeps one ``nn.Linear`` ``(out, in)`` per expert, so each is transposed. A tied head
(``tie_word_embeddings``) is read from ``model.embed_tokens``.

Pure naming: nothing here reads or writes a file. Loading (:mod:`plait.train.hf_load`)
and saving (:mod:`plait.train.hf_save`) both ask :func:`hf_source`, so a name maps the
same way in and out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "LLAMA_RULES",
    "MIXTRAL_RULES",
    "WEIGHTS_FILE",
    "Rename",
    "Rule",
    "Source",
    "Stack",
    "hf_source",
    "is_tied",
    "parameter_shapes",
    "rules_for",
]

#: The files of a transformers model directory: its configuration, its weights in one
#: file, or the index naming each tensor's shard.
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Rename:
    """Module ``plait`` of plait is module ``hf`` of transformers; each parameter under it
    keeps its suffix (``weight``, ``bias``). ``{i}`` stands for a block index."""

    plait: str
    hf: str


@dataclass(frozen=True)
class Stack:
    """Parameter ``plait``, ``(experts, ...)``, stacks one transformers tensor ``hf`` per
    expert ``{j}``, each transposed when ``transpose`` (``nn.Linear``'s ``(out, in)`` into
    plait's ``(in, out)``)."""

    plait: str
    hf: str
    transpose: bool = True


Rule = Rename | Stack

_COMMON: tuple[Rule, ...] = (
    Rename("tok_emb", "model.embed_tokens"),
    Rename("ln_f", "model.norm"),
    Rename("head", "lm_head"),
    Rename("blocks.{i}.ln1", "model.layers.{i}.input_layernorm"),
    Rename("blocks.{i}.ln2", "model.layers.{i}.post_attention_layernorm"),
    Rename("blocks.{i}.attn.q", "model.layers.{i}.self_attn.q_proj"),
    Rename("blocks.{i}.attn.k", "model.layers.{i}.self_attn.k_proj"),
    Rename("blocks.{i}.attn.v", "model.layers.{i}.self_attn.v_proj"),
    Rename("blocks.{i}.attn.proj", "model.layers.{i}.self_attn.o_proj"),
    Rename("blocks.{i}.attn.q_norm", "model.layers.{i}.self_attn.q_norm"),
    Rename("blocks.{i}.attn.k_norm", "model.layers.{i}.self_attn.k_norm"),
    # A dense block's SwiGLU.
    Rename("blocks.{i}.mlp.gate", "model.layers.{i}.mlp.gate_proj"),
    Rename("blocks.{i}.mlp.up", "model.layers.{i}.mlp.up_proj"),
    Rename("blocks.{i}.mlp.down", "model.layers.{i}.mlp.down_proj"),
    # A MoE's shared experts (one SwiGLU; DeepSeek's names): w1 gate, w3 up, w2 down.
    Rename("blocks.{i}.mlp.shared_experts.w1", "model.layers.{i}.mlp.shared_experts.gate_proj"),
    Rename("blocks.{i}.mlp.shared_experts.w3", "model.layers.{i}.mlp.shared_experts.up_proj"),
    Rename("blocks.{i}.mlp.shared_experts.w2", "model.layers.{i}.mlp.shared_experts.down_proj"),
)

#: Llama, Mistral, Qwen2, Qwen3, and Qwen3-MoE's router and experts.
LLAMA_RULES: tuple[Rule, ...] = (
    *_COMMON,
    Rename("blocks.{i}.mlp.router.gate", "model.layers.{i}.mlp.gate"),
    Stack("blocks.{i}.mlp.experts.w1", "model.layers.{i}.mlp.experts.{j}.gate_proj.weight"),
    Stack("blocks.{i}.mlp.experts.w3", "model.layers.{i}.mlp.experts.{j}.up_proj.weight"),
    Stack("blocks.{i}.mlp.experts.w2", "model.layers.{i}.mlp.experts.{j}.down_proj.weight"),
)

#: Mixtral: ``block_sparse_moe``, experts' ``w1`` (gate), ``w3`` (up), ``w2`` (down).
MIXTRAL_RULES: tuple[Rule, ...] = (
    *_COMMON,
    Rename("blocks.{i}.mlp.router.gate", "model.layers.{i}.block_sparse_moe.gate"),
    Stack("blocks.{i}.mlp.experts.w1", "model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight"),
    Stack("blocks.{i}.mlp.experts.w3", "model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight"),
    Stack("blocks.{i}.mlp.experts.w2", "model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight"),
)


def rules_for(hf_config: Mapping[str, Any]) -> tuple[Rule, ...]:
    """The rules of the model a Hugging Face ``config.json`` dict describes."""
    kind = str(hf_config.get("model_type", "llama"))
    return MIXTRAL_RULES if kind == "mixtral" else LLAMA_RULES


@dataclass(frozen=True)
class Source:
    """Where a plait parameter comes from: one transformers tensor, or with ``stacked``
    one per expert (in expert order), each transposed when ``transpose``."""

    keys: tuple[str, ...]
    stacked: bool = False
    transpose: bool = False


# Compiled once per template: every parameter of every load and export asks every rule.
_PATTERNS: dict[str, re.Pattern[str]] = {}


def _pattern(template: str) -> re.Pattern[str]:
    found = _PATTERNS.get(template)
    if found is None:
        text = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)")
        found = _PATTERNS[template] = re.compile(text)
    return found


def hf_source(
    rules: Sequence[Rule], name: str, shape: Sequence[int], *, tied: bool = False
) -> Source | None:
    """The transformers tensor(s) of plait parameter ``name`` of shape ``shape`` (the
    global one), or None when no rule names it. ``tied``: the head shares the embedding."""
    if tied and name == "head.weight":
        return Source(("model.embed_tokens.weight",))
    module, _, suffix = name.rpartition(".")
    for rule in rules:
        if isinstance(rule, Rename):
            match = _pattern(rule.plait).fullmatch(module)
            if match:
                return Source((f"{rule.hf.format(**match.groupdict())}.{suffix}",))
        else:
            match = _pattern(rule.plait).fullmatch(name)
            if match and len(shape) == 3:
                keys = tuple(rule.hf.format(j=j, **match.groupdict()) for j in range(shape[0]))
                return Source(keys, stacked=True, transpose=rule.transpose)
    return None


def parameter_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``model`` by name (a tied head included), with its global shape:
    what :func:`plait.train.hf_load.load_hf_checkpoint` checks a checkpoint against."""
    return {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}


def is_tied(modules: Iterable[nn.Module]) -> bool:
    """Whether the head of the model ``modules`` make up shares the token embedding: its
    config says so, or one module holds both and they are the same tensor."""
    for m in modules:
        cfg = getattr(m, "cfg", None)
        if getattr(cfg, "tie_word_embeddings", False):
            return True
        head, emb = getattr(m, "head", None), getattr(m, "tok_emb", None)
        if head and emb and head.weight is emb.weight:
            return True
    return False
