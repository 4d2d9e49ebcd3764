"""Hugging Face weights in and out of ``plait train``: safetensors checkpoints of the Llama
family (Llama, Mistral, Qwen2/3, and the mixture-of-experts Mixtral and Qwen3-MoE).

The library's one door to them; each concept lives in its own module and is re-exported
here unchanged:

* **Names** (:mod:`plait.train.hf_names`): the rules relating a plait parameter to its
  transformers tensor(s) (:data:`LLAMA_RULES`, :data:`MIXTRAL_RULES`, :class:`Rename`,
  :class:`Stack`, :func:`hf_source`, :func:`rules_for`, :func:`parameter_shapes`).
* **Loading** (:mod:`plait.train.hf_load`): :func:`load_hf_checkpoint` copies a
  checkpoint into each rank's shards after every rank has checked it against the whole
  model; :class:`HFCheckpointError` names the tensor, its file and the fix.
* **Saving** (:mod:`plait.train.hf_save`): :func:`export_state` (a whole model's tensors
  under transformers' names) and :func:`parse_size` (``--max-shard-size``).
* **--init-from** (:mod:`plait.train.init_from`): :func:`check_init_from` and
  :func:`with_default_model_config`, run before any worker starts.

The ``plait export`` command (``export_run``) is not here: it builds the model as
training does, so it imports :mod:`plait.train.loop`, which imports this module; it
lives above both, in :mod:`plait.train.export`.
"""

from __future__ import annotations

from plait.train.hf_load import HFCheckpointError, load_hf_checkpoint
from plait.train.hf_names import (
    LLAMA_RULES,
    MIXTRAL_RULES,
    Rename,
    Source,
    Stack,
    hf_source,
    parameter_shapes,
    rules_for,
)
from plait.train.hf_save import export_state, parse_size
from plait.train.init_from import check_init_from, with_default_model_config

__all__ = [
    "LLAMA_RULES",
    "MIXTRAL_RULES",
    "HFCheckpointError",
    "Rename",
    "Source",
    "Stack",
    "check_init_from",
    "export_state",
    "hf_source",
    "load_hf_checkpoint",
    "parameter_shapes",
    "parse_size",
    "rules_for",
    "with_default_model_config",
]
