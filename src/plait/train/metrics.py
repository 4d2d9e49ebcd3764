"""Per-step metrics: the run directory's ``metrics.jsonl``, and peak memory per rank.

One JSON object per line, in step order. Training steps carry ``loss`` (global batch),
``lr``, ``grad_norm``, ``step_time`` (seconds, evaluation and checkpoints excluded),
``tokens_per_s``, ``tokens`` (seen so far) and ``mfu`` (model FLOPs utilisation, a
fraction: :mod:`plait.train.flops`), and with mixture-of-experts blocks
``expert_load`` (tokens routed to each expert of each block in the step, summed over the
global batch: a list per block) and ``expert_imbalance`` (the worst block's max / mean);
validation records carry ``val_loss``. The last record of a session holds
``peak_memory`` (bytes, one per rank: :func:`peak_memory_bytes`) and ``memory_kind``
(``"allocated"``: CUDA's peak allocated; ``"rss"``: the process's peak resident set). All
carry ``step``: the number of optimizer steps completed, so validation at step 0 is the
untrained model. A resumed run first drops the records after its checkpoint's step, so the
file always describes one consistent run. Events between the steps are rows with an
``event`` field: ``"checkpoint"`` (:class:`plait.train.checkpointer.SaveReport`: how long
training waited for it, its staging copy's bytes), ``"checkpoint_written"`` (an
asynchronous checkpoint's write finished: ``write_s``) and ``"restart"`` (the run restarted
after a failed worker, and which steps were redone: :mod:`plait.train.restart`); readers of
the training steps select the rows with a ``loss``.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait import spmd
from plait.mesh import collective_device

__all__ = [
    "MetricsLog",
    "gather_peak_memory",
    "gather_per_rank",
    "peak_memory_bytes",
    "read_metrics",
]

FILENAME = "metrics.jsonl"


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of the run's metrics file (empty if there is none yet)."""
    path = Path(run_dir) / FILENAME
    if not path.is_file():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _kept(record: dict[str, Any], resume_step: int) -> bool:
    """Whether a session resuming at ``resume_step`` keeps an earlier session's
    ``record``: those up to that step, except that a session resuming at step 0 (restarted
    before the first checkpoint: :mod:`plait.train.restart`) validates the untrained model
    again, so the earlier step-0 validation goes."""
    if resume_step == 0 and "val_loss" in record:
        return False
    return bool(record["step"] <= resume_step)


class MetricsLog:
    """Appends records to ``<run_dir>/metrics.jsonl``; used by rank 0 only.
    ``resume_step``: the step a resumed (or restarted) session continues from, whose
    earlier records it keeps (:func:`_kept`); None: a new run, the file starts empty."""

    def __init__(self, run_dir: str | Path, resume_step: int | None) -> None:
        self.path = Path(run_dir) / FILENAME
        kept = [] if resume_step is None else read_metrics(run_dir)
        kept = [r for r in kept if _kept(r, resume_step or 0)]
        with open(self.path, "w") as f:  # rewritten: a resumed run's later records go
            f.writelines(json.dumps(r) + "\n" for r in kept)
        self.records: list[dict[str, Any]] = kept
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, **record: Any) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def peak_memory_bytes(device: str) -> int:
    """This process's peak memory: allocated CUDA memory on GPU, else resident set size."""
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def gather_peak_memory(device: str) -> list[int]:
    """Every rank's :func:`peak_memory_bytes`, indexed by rank (collective)."""
    return gather_per_rank(peak_memory_bytes(device), "the peak memory report")


def gather_per_rank(value: int, what: str) -> list[int]:
    """Every rank's ``value``, indexed by rank (collective; ``what`` names it in errors)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    world = dist.group.WORLD
    mine = torch.tensor([value], dtype=torch.int64, device=collective_device(world))
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    spmd.record("all_gather", mine, world, what)
    spmd.wait(dist.all_gather(every, mine, group=world, async_op=True), f"all_gather of {what}")
    return [int(t.item()) for t in every]
