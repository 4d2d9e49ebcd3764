"""What a framework's recipe keeps for backward, beyond the layout: :class:`Keeps`, one
row of :data:`RECIPE_KEEPS` per recipe (:class:`~plait.plan.spec.PlanLayout`'s ``recipe``).

Recipes. The memory model's counts (:mod:`plait.plan.activations`, :mod:`plait.plan.memory`)
are plait's (``"plait"``: what its runtime keeps, checked against real and dry runs).
``"megatron"`` counts what Megatron-LM keeps (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", arXiv 2205.05198, Table 2 and
section 4.2.2: ``s b h (34 / t + 5 a s / (h t))`` bytes per layer with sequence
parallelism and no recomputation): linear inputs are saved split by ``tp`` under
sequence parallelism (``2 d / tp``; re-gathered in backward), a fused SwiGLU saves its
input and output only (``3 f / tp``), the residual stream is in the compute dtype, and
with flash attention the ``5 a s / (h t)`` term (scores, softmax, dropout) is not saved,
so ``selective`` (core attention recomputed) saves what ``none`` does. Per token, in
bf16: ``(12 d + 4 k + 6 f) / tp`` bytes for a SwiGLU block, 32 of the paper's 34 for
GPT-3's (no dropout masks). Under ``fully_shard`` (``dp_shard`` > 1: Megatron-FSDP,
parameters, gradients and optimizer state sharded, ``optim_grads_params``) Megatron
reduce-scatters every microbatch's gradients into the sharded main-grad buffer
(``megatron/core/distributed/custom_fsdp/fully_sharded_data_parallel.py``:
``grad_reduce_every_bprop`` for ``optim_grads`` and ``optim_grads_params``): no
unsharded gradients are held across microbatches (``sharded_accumulation``).

Other frameworks' recipes: ``"torchtitan"`` (plait's counts; ``selective`` is
torchtitan's per-op policy, which saves every other matmul's output: wq, wv, w1, w2, the
attention output and the block input); ``"foundry"`` (llm-foundry's MPT under Composer's
FSDP: a fused cross-entropy, flash-attn's, the default ``loss_fn`` of
``ComposerMPTCausalLM``, saves the compute-dtype logits, no fp32 copy; gradient
accumulation without ``no_sync`` reduce-scatters every microbatch, so no unsharded fp32
gradients are held); ``"llama3"`` (Llama 3 paper, arXiv 2407.21783, section 3.3.2:
Megatron-like activations, gradients sharded ZeRO-2-like every microbatch, stage inputs
and outputs freed, one block fewer on the first and last stages).
``attention="materialized"`` adds the softmax's ``heads / tp x seq_len`` probabilities
per token (no flash kernel); ``moments=1`` is a one-moment optimizer (Lion).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.spec import Layout, recipe

__all__ = ["RECIPE_KEEPS", "Keeps", "recipe_keeps"]


@dataclass(frozen=True)
class Keeps:
    """What a framework's recipe keeps, beyond the layout (module docstring, "Recipes").

    * ``activations``: whose per-token count of saved activations applies: ``"plait"``,
      ``"megatron"`` (Korthikanti et al.), or ``"torchtitan"`` (plait's, but ``selective``
      is torchtitan's per-op policy);
    * ``attention``: ``"flash"`` (a fused kernel saves q, k, v, its output and per-row
      statistics: O(s) per token) or ``"materialized"`` (the softmax's ``heads/tp x s``
      probabilities per token, in the compute dtype, which the values' matmul saves too);
    * ``loss``: ``"lm_loss"`` (plait's and torch's ``cross_entropy`` under autocast: fp32
      log-probabilities per microbatch in flight, the compute-dtype logits and their fp32
      copy) or ``"fused_ce"`` (a fused cross-entropy kernel: the compute-dtype logits of
      each microbatch in flight and, in backward, their gradient; no fp32 full-vocabulary
      tensor);
    * ``moments``: optimizer moments per parameter (AdamW 2, Lion 1; fp32 unless
      :attr:`plait.plan.spec.Software.optimizer_states` says bf16);
    * ``sharded_accumulation``: gradient accumulation (microbatches, pipelines)
      reduce-scatters every microbatch's gradients into the sharded buffer (FSDP1 without
      ``no_sync``, ZeRO-2, Megatron-FSDP) instead of keeping unsharded gradients until
      the last;
    * ``stage_output``: a pipeline stage keeps its output tensor until its backward (False:
      freed once sent, Megatron's ``deallocate_output_tensor``, Llama 3 section 3.3.2);
    * ``end_stage_fewer``: blocks fewer on the first and last pipeline stages (Llama 3
      section 3.3.2: one, balancing the embedding and the head);
    * ``logits_held``: the logits stay referenced through the loss's backward (a training
      loop that keeps them in a variable; plait's stepper did until 2026-11), which starts
      with two fp32 full-vocabulary gradients (of the log-probabilities and of the logits'
      fp32 copy) beside the saved log-probabilities. Without it the loss's backward holds
      the saved log-probabilities and the two fp32 gradients only;
    * ``resharded_at_loss``: with blocks resharded after forward, none is gathered when
      the loss runs (plait's fully_shard frees the last block's parameters before).
    """

    activations: str = "plait"
    attention: str = "flash"
    loss: str = "lm_loss"
    moments: int = 2
    sharded_accumulation: bool = False
    stage_output: bool = True
    end_stage_fewer: int = 0
    logits_held: bool = False
    resharded_at_loss: bool = False

    def __post_init__(self) -> None:
        if self.activations not in ("plait", "megatron", "torchtitan"):
            raise ValueError(f"activations {self.activations!r}: plait, megatron, torchtitan")
        if self.attention not in ("flash", "materialized"):
            raise ValueError(f"attention {self.attention!r}: flash or materialized")
        if self.loss not in ("lm_loss", "fused_ce"):
            raise ValueError(f"loss {self.loss!r}: lm_loss or fused_ce")
        if self.moments not in (1, 2):
            raise ValueError(f"moments {self.moments}: 1 (Lion) or 2 (AdamW)")


#: Each recipe's :class:`Keeps` (module docstring, "Recipes"): ``recipe`` names a row of
#: this table (:func:`plait.plan.spec.recipe`).
RECIPE_KEEPS: dict[str, Keeps] = {
    "plait": Keeps(resharded_at_loss=True),
    "megatron": Keeps(activations="megatron", sharded_accumulation=True),
    "torchtitan": Keeps(activations="torchtitan"),
    "foundry": Keeps(loss="fused_ce", sharded_accumulation=True),
    "llama3": Keeps(
        activations="megatron", sharded_accumulation=True, stage_output=False, end_stage_fewer=1
    ),
}


def recipe_keeps(layout: Layout) -> Keeps:
    """What ``layout``'s recipe keeps (:data:`RECIPE_KEEPS`)."""
    name = recipe(layout)
    if name not in RECIPE_KEEPS:
        raise ValueError(f"recipe {name!r}: the memory model knows {', '.join(RECIPE_KEEPS)}")
    return RECIPE_KEEPS[name]
