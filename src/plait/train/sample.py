"""``plait sample``: text generated from a run's checkpoint, in one process.

The checkpoint may come from any layout (sharded, replicated, pipelined): DCP reassembles
full tensors for the plain model built here from the run's saved configuration.
"""

from __future__ import annotations

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
from plait.train.parallelize import Model

__all__ = ["generate", "load_model", "sample_command"]

BYTES = 256  # the byte tokenizer's vocabulary


def load_model(checkpoint: Path) -> Model:
    """The whole model of ``checkpoint`` (the GPT, or the Llama of its ``--model-config``),
    on CPU, in eval mode (its files checked first)."""
    verify_checkpoint(checkpoint)
    cfg = from_mapping(read_info(checkpoint).config)
    model = build_model(cfg)
    load_weights(checkpoint, model, verify=False)
    return model.eval()


@torch.no_grad()
def generate(
    model: Model, prompt: bytes, n_tokens: int, temperature: float, top_k: int, seed: int
) -> bytes:
    """``n_tokens`` bytes continuing ``prompt`` (temperature 0: always the likeliest). The
    tokens are bytes: a model with a larger vocabulary samples among its first 256."""
    generator = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt) or [ord("\n")]], dtype=torch.long)  # (1, T)
    start = idx.shape[1]
    for _ in range(n_tokens):
        logits = model(idx[:, -model.seq_len :])[:, -1, :BYTES]  # (1, 256)
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return bytes(idx[0, start:].tolist())


def sample_command(
    run_dir: str,
    checkpoint: str | None,
    prompt: str,
    tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
) -> str:
    """The prompt and its continuation, as text (undecodable bytes replaced)."""
    path = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir)
    if path is None:
        raise ConfigError(f"--run-dir {run_dir} holds no checkpoint; train first (plait train)")
    model = load_model(path)
    out = generate(model, prompt.encode(), tokens, temperature, top_k, seed)
    return prompt + out.decode("utf-8", errors="replace")
