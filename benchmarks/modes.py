"""The benchmark modes: one entry per way of training the GPT model.

Each mode builds the model from the same seed, the same per-rank data and the same AdamW
step; only the parallel wrapping differs. plait modes name their torch counterpart, and
the report gives their ratio to it. Later capabilities add their modes and suites here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness import BenchConfig, Mode, Step
from plait.replicate import replicate
from plait.train.model import GPT, lm_loss


def _batch(cfg: BenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed local batch of random byte sequences (inputs, next-token targets)."""
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    tokens = torch.randint(0, cfg.gpt.vocab_size, (cfg.batch, cfg.gpt.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _model(cfg: BenchConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg.gpt)


def training_step(model: nn.Module, cfg: BenchConfig) -> Step:
    """Forward, loss, backward and an AdamW step on this rank's local batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = _batch(cfg)

    def step() -> None:
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _single(cfg: BenchConfig) -> Step:
    return training_step(_model(cfg), cfg)


def _replicate(cfg: BenchConfig) -> Step:
    return training_step(replicate(_model(cfg)), cfg)


def _torch_ddp(cfg: BenchConfig) -> Step:
    from torch.nn.parallel import DistributedDataParallel

    return training_step(DistributedDataParallel(_model(cfg)), cfg)


MODES: dict[str, Mode] = {
    m.name: m
    for m in [
        Mode("single", _single, single_process=True),
        Mode("replicate", _replicate, torch_counterpart="torch_ddp"),
        Mode("torch_ddp", _torch_ddp),
    ]
}

SUITES: dict[str, list[str]] = {
    "replicate": ["single", "replicate", "torch_ddp"],
}
