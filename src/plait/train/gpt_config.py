"""The configuration of plait's GPT (:class:`plait.train.model.GPT`) and its shape as a
:class:`~plait.train.model_spec.ModelSpec`.

Apart from the model, and free of torch, so that ``plait plan`` reads the GPT's shape
without importing torch; :mod:`plait.train.model` re-exports :class:`GPTConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.train.model_spec import ModelSpec, expert_hidden_default

if TYPE_CHECKING:
    from plait.experts import AuxLossType

__all__ = ["GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    tie_weights: bool = False
    # Mixture of experts (0 experts: a dense MLP in every block).
    experts: int = 0
    top_k: int = 2
    shared_experts: int = 0
    expert_hidden: int = 0  # 0: d_mlp // (top_k + shared_experts), as many active weights
    aux_loss_coeff: float = 0.0
    aux_loss_type: AuxLossType = "sequence"
    z_loss_coeff: float = 0.0
    bias_update_speed: float = 0.0  # 0: no auxiliary-loss-free bias

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k ({self.top_k}) must be in 1..experts ({self.experts})")

    @property
    def d_mlp(self) -> int:
        """The MLP's hidden width."""
        return 4 * self.d_model

    @property
    def d_expert(self) -> int:
        """Each expert's hidden width: a token's active MLP weights (its ``top_k`` experts
        and the shared ones) match the dense MLP's unless ``expert_hidden`` says otherwise."""
        return self.expert_hidden or expert_hidden_default(
            self.d_mlp, self.top_k, self.shared_experts
        )

    def spec(self) -> ModelSpec:
        """This GPT as the planner prices it and the layout rules see it (the one
        description of its shape): a GELU MLP of width ``4 d_model``, biased linears,
        LayerNorm with a bias, ``seq_len`` learned positions, ``vocab_size`` tokens, the head
        tied when ``tie_weights``; with experts, every block's MLP a mixture of ``experts``
        of width :attr:`d_expert`. Named ``gpt-{n_layer}x{d_model}``, with experts
        ``-moe{experts}x{d_expert}-top{top_k}`` and ``+{shared_experts}`` when there are
        some. Dropout and the balance settings change no shape and are not in it."""
        moe = self.experts > 0
        name = f"gpt-{self.n_layer}x{self.d_model}"
        if moe:
            name += f"-moe{self.experts}x{self.d_expert}-top{self.top_k}"
            name += f"+{self.shared_experts}" if self.shared_experts else ""
        return ModelSpec(
            name=name,
            layers=self.n_layer,
            d_model=self.d_model,
            heads=self.n_head,
            kv_heads=self.n_head,  # no grouped-query attention
            ffn_hidden=self.d_mlp,
            vocab=self.vocab_size,
            gated=False,
            tied=self.tie_weights,
            bias=True,
            norm_bias=True,
            positions=self.seq_len,
            experts=self.experts,
            top_k=self.top_k if moe else 1,
            shared_experts=self.shared_experts if moe else 0,
            expert_hidden=self.d_expert if moe else 0,
        )
