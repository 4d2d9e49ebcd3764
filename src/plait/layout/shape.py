"""What the rules need of a model and its sequences (:class:`ModelShape`): training builds
one from its GPT or Llama configuration, the planner from its model specs, so both ask the
rules about the same sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ModelShape", "cp_shard"]


@dataclass(frozen=True)
class ModelShape:
    """What the rules need of a model and its sequences: the sizes tensor parallelism
    splits and the blocks a pipeline splits.

    ``from_flags``: the model is plait's GPT, shaped by ``plait train``'s model flags
    (``--n-layer``, ``--n-head``, ``--d-model``, ``--experts``), so messages may suggest
    changing them; ``tokens``: what messages call the vocabulary's entries; ``experts``:
    routed experts per mixture-of-experts block (0: a dense model).
    """

    layers: int
    heads: int
    kv_heads: int
    d_model: int
    d_mlp: int
    vocab: int
    seq_len: int
    from_flags: bool = False
    tokens: str = "tokens"
    experts: int = 0


def cp_shard(model: ModelShape, cp: int) -> ModelShape:
    """``model`` as one ``cp`` rank sees it: each sequence ``cp`` times shorter."""
    return dataclasses.replace(model, seq_len=model.seq_len // cp) if cp > 1 else model
