"""The shape of a decoder-only transformer, described once (:class:`ModelSpec`): what
``plait train`` builds and ``plait plan`` prices.

Each model family produces its spec in one place (plait's GPT:
``plait.train.model.GPTConfig.spec``; the Llama family: ``plait.train.llama.LlamaConfig.spec``;
a ``TrainConfig``'s model: ``plait.train.resolve.model_spec``), and what the layout rules
need of a model (:class:`plait.layout.ModelShape`) is derived from a spec here only
(:meth:`ModelSpec.shape`), so the trainer and the planner ask the rules about the same sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.layout import ModelShape, moe_tp_width

__all__ = ["ModelSpec", "expert_hidden_default"]


def expert_hidden_default(ffn_hidden: int, top_k: int, shared_experts: int) -> int:
    """Each expert's width when not given: as many active MLP weights per token as the dense
    MLP of width ``ffn_hidden`` (``plait train``'s rule, ``GPTConfig.d_expert``)."""
    return max(1, ffn_hidden // (top_k + shared_experts))


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (Llama family or plait's GPT).

    ``ffn_hidden``: the MLP's inner width; ``gated``: a SwiGLU MLP (three matrices, Llama)
    rather than two (GPT); ``kv_heads``: grouped-query attention (``heads`` for none);
    ``tied``: the head shares the embedding's weight; ``bias`` / ``norm_bias``: linear and
    norm layers have biases (GPT: LayerNorm and biased linears; Llama: RMSNorm, none);
    ``head_dim``: the heads' width where it is not ``d_model / heads`` (Qwen3); ``qk_norm``:
    per-head RMSNorms of queries and keys (Qwen3); ``source``: what ``plait train
    --model-config`` builds it from (a preset or a config.json; empty for plait's GPT).

    Mixture of experts (``experts`` > 0, plait's ``plait.experts.MoE``): every block after
    the first ``dense_layers`` replaces its MLP by a router (a bias-free ``d_model x
    experts`` gate), ``experts`` routed SwiGLU experts of width ``expert_hidden`` (each
    token goes to ``top_k`` of them, dropless) and ``shared_experts`` shared ones (one
    SwiGLU of width ``expert_hidden x shared_experts`` every token goes through). The
    leading dense blocks keep the MLP of ``ffn_hidden`` / ``gated``. Without experts the
    other MoE fields are ignored.
    """

    name: str
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    gated: bool = True
    tied: bool = False
    bias: bool = False
    norm_bias: bool = False
    positions: int = 0  # rows of a learned position embedding (plait's GPT: seq_len), else 0
    experts: int = 0  # routed experts per MoE block; 0: a dense model
    top_k: int = 1
    shared_experts: int = 0
    expert_hidden: int = 0
    dense_layers: int = 0  # leading blocks with a dense MLP (DeepSeek-V3: 3)
    head_dim: int = 0  # each attention head's width; 0: d_model / heads
    qk_norm: bool = False  # per-head RMSNorms of queries and keys (Qwen3)
    # What ``plait train --model-config`` takes to build exactly this model (a preset name
    # or a config.json path); "" for plait's GPT (its --n-layer / --n-head / --d-model).
    source: str = ""

    @property
    def dim_head(self) -> int:
        """Each attention head's width (``head_dim``, by default ``d_model / heads``)."""
        return self.head_dim or self.d_model // self.heads

    @property
    def q_width(self) -> int:
        """The width of the queries (and of the attention's output): ``heads x head_dim``."""
        return self.heads * self.dim_head

    @property
    def kv_width(self) -> int:
        """The width of the keys, and of the values: ``kv_heads x head_dim``."""
        return self.kv_heads * self.dim_head

    def __post_init__(self) -> None:
        if self.experts < 0 or self.shared_experts < 0 or self.dense_layers < 0:
            raise ValueError(f"{self.name}: experts, shared experts and dense layers must be >= 0")
        if self.experts:
            if not 1 <= self.top_k <= self.experts:
                raise ValueError(
                    f"{self.name}: --top-k {self.top_k} must be in 1..--experts {self.experts}"
                )
            if self.expert_hidden < 1:
                raise ValueError(f"{self.name}: --expert-hidden must be at least 1 with experts")
            if self.dense_layers >= self.layers:
                raise ValueError(
                    f"{self.name}: --dense-layers {self.dense_layers} leaves no MoE block of "
                    f"{self.layers}: use fewer than {self.layers}"
                )

    @property
    def moe_layers(self) -> int:
        """Blocks whose MLP is a mixture of experts (0 for a dense model)."""
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def tp_mlp_width(self) -> int:
        """The feed-forward width tensor parallelism must divide (``ModelShape.d_mlp``):
        the gcd of every MLP width it splits, so that ``tp`` divides it exactly when it
        divides each. Those are the dense MLP's ``ffn_hidden`` where some block has one
        (every block without experts, the ``dense_layers`` with them) and a MoE block's
        shared experts' ``expert_hidden x shared_experts`` (its routed experts are split by
        ``ep``, not ``tp``). A MoE model with neither has no MLP width to split: then
        ``d_model``, already a split (:func:`plait.layout.moe_tp_width`)."""
        if not self.experts:
            return self.ffn_hidden
        moe = moe_tp_width(self.expert_hidden, self.shared_experts, self.d_model)
        if not self.dense_layers:
            return moe
        return math.gcd(moe, self.ffn_hidden) if self.shared_experts else self.ffn_hidden

    def shape(
        self, seq_len: int, *, from_flags: bool = False, tokens: str = "tokens"
    ) -> ModelShape:
        """What the layout rules need of this model on sequences of ``seq_len`` tokens (the
        one derivation, for ``plait train`` and ``plait plan`` alike): the sizes tensor
        parallelism splits (the MLP's: :attr:`tp_mlp_width`), the blocks, the routed
        experts. ``from_flags`` / ``tokens``: how messages name the model's flags and its
        vocabulary (:class:`~plait.layout.ModelShape`)."""
        return ModelShape(
            self.layers,
            self.heads,
            self.kv_heads,
            self.d_model,
            self.tp_mlp_width,
            self.vocab,
            seq_len,
            from_flags=from_flags,
            tokens=tokens,
            experts=self.experts,
        )
