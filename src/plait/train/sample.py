"""``plait sample``: text generated from a run's checkpoint, in one process.

The checkpoint may come from any layout (sharded, replicated, pipelined): DCP reassembles
full tensors for the plain model built here from the run's saved configuration. The prompt
is encoded, and the continuation decoded, by the run's tokenizer (``--tokenizer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch.nn import functional as F

from plait.train.checkpointing import (
    latest_checkpoint,
    load_weights,
    read_info,
    verify_checkpoint,
)
from plait.train.config import ConfigError, from_mapping
from plait.train.loop import build_model
from plait.train.materialize import empty_model
from plait.train.parallelize import Model
from plait.train.tokenizer import load_tokenizer

__all__ = ["generate", "load_model", "sample_command"]


def load_model(checkpoint: Path) -> Model:
    """The whole model of ``checkpoint`` (the GPT, or the Llama of its ``--model-config``),
    on CPU, in eval mode (its files checked first)."""
    verify_checkpoint(checkpoint)
    cfg = from_mapping(read_info(checkpoint).config)
    model = empty_model(lambda: build_model(cfg))  # no draws: the checkpoint fills it
    load_weights(checkpoint, model, verify=False)
    return model.eval()


@torch.no_grad()
def generate(
    model: Model,
    prompt: Sequence[int],
    n_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    vocab: int = 256,
    stop: int | None = None,
) -> list[int]:
    """Up to ``n_tokens`` token ids continuing the ids ``prompt`` (bytes for the byte
    tokenizer; temperature 0: always the likeliest), drawn among the first ``vocab`` ids
    (the tokenizer's: a model's vocabulary may be larger). Ends early, leaving it out, at
    the id ``stop`` (the tokenizer's eos)."""
    generator = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt) or [ord("\n")]], dtype=torch.long)  # (1, T)
    start = idx.shape[1]
    for _ in range(n_tokens):
        logits = model(idx[:, -model.seq_len :])[:, -1, :vocab]  # (1, vocab)
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        if stop is not None and int(nxt) == stop:
            break
        idx = torch.cat([idx, nxt], dim=1)
    return idx[0, start:].tolist()


def sample_command(
    run_dir: str,
    checkpoint: str | None,
    prompt: str,
    tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
) -> str:
    """The prompt and its continuation, as text: the run's tokenizer encodes the prompt
    (an empty one starts from its bos or eos, or a newline) and decodes the continuation
    (for bytes: undecodable ones replaced); sampling stops early at the tokenizer's eos."""
    path = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir)
    if path is None:
        raise ConfigError(f"--run-dir {run_dir} holds no checkpoint; train first (plait train)")
    model = load_model(path)
    tokenizer = load_tokenizer(from_mapping(read_info(path).config).tokenizer)
    ids = tokenizer.encode(prompt)
    if not ids:
        start = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
        ids = [start] if start is not None else tokenizer.encode("\n")
    vocab, stop = tokenizer.vocab_size, tokenizer.eos_id
    out = generate(model, ids, tokens, temperature, top_k, seed, vocab=vocab, stop=stop)
    return prompt + tokenizer.decode(out)
