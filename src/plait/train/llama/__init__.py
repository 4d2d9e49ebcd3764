"""A Llama-family decoder for ``plait train``, shaped by a Hugging Face ``config.json``.

Pre-norm blocks of RMSNorm, grouped-query causal self-attention with rotary position
embeddings (separate q, k, v and output projections, biases only where the family has
them) and a SwiGLU MLP (``gate``, ``up``, ``down``) or a mixture of SwiGLU experts
(:class:`plait.experts.MoE`); a final RMSNorm and a head, tied to the token embedding or
not. The structure mirrors :class:`plait.train.model.GPT`, so ``plait train``'s recipe
applies unchanged: blocks in ``self.blocks`` (each with ``ln1``, ``attn`` with ``q``,
``k``, ``v``, ``proj``, ``ln2`` and ``mlp``), ``tok_emb``, ``ln_f`` and ``head`` falsy on
pipeline stages without them, and ``positions``: the tokens' global positions under
context parallelism, which the rotary embedding uses. Attention reads its query and
key/value head counts from the projections' widths, so tensor parallelism's local heads
work with the same code.

The families it builds (:data:`FAMILIES`, by the config's ``model_type``, else its
``architectures``), each as transformers defines it, keys it leaves out taking that
family's defaults:

* ``llama`` (``LlamaForCausalLM``): as above; ``attention_bias`` gives q, k, v and the
  output projection biases.
* ``mistral`` (``MistralForCausalLM``): a Llama; its ``sliding_window`` must be null or
  at least the trained sequence length (no window is applied).
* ``qwen2`` (``Qwen2ForCausalLM``): q, k and v with biases (``attn.q.bias`` ...), the output
  projection without; a sliding window only where ``use_sliding_window`` says so.
* ``qwen3`` (``Qwen3ForCausalLM``): per-head RMSNorms on queries and keys before the
  rotary embedding (``attn.q_norm``, ``attn.k_norm``, of ``head_dim``), an explicit
  ``head_dim``, ``attention_bias`` (all four projections).
* ``mixtral`` (``MixtralForCausalLM``): every block's MLP a :class:`plait.experts.MoE` at
  ``blocks.{i}.mlp`` (``num_local_experts`` SwiGLU experts of ``intermediate_size``,
  ``num_experts_per_tok`` chosen by a softmax router, their weights renormalised to sum 1,
  no shared experts, ``router_aux_loss_coef`` weighting the balance loss).
* ``qwen3_moe`` (``Qwen3MoeForCausalLM``): qwen3's attention; MoE blocks of ``num_experts``
  experts of ``moe_intermediate_size`` (weights renormalised when ``norm_topk_prob``) every
  ``decoder_sparse_step``-th block, dense SwiGLU blocks (``intermediate_size``) in
  ``mlp_only_layers``.

Other model types (e.g. ``qwen2_moe``: its gated shared expert), rope scaling other than
none or ``"llama3"``, activations other than SiLU and MLP biases are refused, the message
naming the key. The balance loss is plait's ``"global"`` one (per block, over each
forward's tokens on all data-parallel ranks: :mod:`plait.experts.balance`), not
transformers' single loss over all blocks' logits; so pipelines and gradient accumulation,
whose forwards see microbatches, move it slightly (the losses stay exact without it). No
router z-loss, no router jitter, no balancing bias; ``plait train``'s MoE flags are the
GPT's and do not apply.

Its modules, each importing only those before it: ``values`` (typed reads of a
config.json, :class:`LlamaConfigError`) <- ``families`` (:data:`FAMILIES`, their defaults
and differences) <- ``config`` (:class:`LlamaConfig`) <- ``rotary`` and ``rms_norm`` <-
``attention`` <- ``block`` (SwiGLU, MoE, the block) <- ``model`` (:class:`Llama`, whose
forward is :class:`plait.train.decoder.Decoder`'s, shared with the GPT). Import the names
from here: the split into modules is not part of the interface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plait.lazy import LazyExports
from plait.train.llama.config import LlamaConfig
from plait.train.llama.families import FAMILIES, families_help
from plait.train.llama.values import LlamaConfigError

if TYPE_CHECKING:
    # Public but not in __all__ (as before the split); the recipe imports LlamaBlock by name.
    from plait.train.llama.attention import LlamaAttention as LlamaAttention
    from plait.train.llama.block import LlamaBlock as LlamaBlock
    from plait.train.llama.block import SwiGLU as SwiGLU
    from plait.train.llama.block import moe_block as moe_block
    from plait.train.llama.model import Llama
    from plait.train.llama.rms_norm import RMSNorm
    from plait.train.llama.rotary import apply_rotary, rope_inv_freq

__all__ = [
    "FAMILIES",
    "Llama",
    "LlamaConfig",
    "LlamaConfigError",
    "RMSNorm",
    "apply_rotary",
    "families_help",
    "rope_inv_freq",
]

#: The modules and layers (they import torch), imported on first use (PEP 562): the config
#: above serves ``plait plan`` without torch.
_MODULES = {
    "plait.train.llama.attention": ("LlamaAttention",),
    "plait.train.llama.block": ("LlamaBlock", "SwiGLU", "moe_block"),
    "plait.train.llama.model": ("Llama",),
    "plait.train.llama.rms_norm": ("RMSNorm",),
    "plait.train.llama.rotary": ("apply_rotary", "rope_inv_freq"),
}
_LAZY = LazyExports(__name__, _MODULES)


def __getattr__(name: str) -> Any:
    return _LAZY.attribute(name)


def __dir__() -> list[str]:
    return _LAZY.names()
