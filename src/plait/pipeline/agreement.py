"""The pipeline ranks' agreement on a schedule, at its first run, and how a rank that fails
before that agreement tells the others.

At the first run of an order, just before this rank first sends or receives, every rank
of the pipeline group all-gathers its schedule name, number of microbatches, number of
stages and a checksum of its compute order (:meth:`Agreement.check`). If they differ,
every rank raises :class:`~plait.spmd.DivergenceError` naming each side: the ranks would
otherwise wait forever for messages the others never send. Errors a rank finds on its own
before then (bad arguments to ``step``) stay local.

A rank whose step fails after its arguments were accepted but before its first message
(its first forward raises, or produces outputs that contradict the stage's declared
``output_args``) cannot simply raise: its neighbours wait in this agreement for it. It
calls :meth:`Agreement.report_failure` instead, which joins the all-gather with its row
marked failed, the reason being in the job's key-value store
(:func:`~plait.pipeline.p2p.publish_abort`): every other rank then raises
:class:`~plait.pipeline.p2p.PipelineAbort` naming the rank that failed and why, and no
operation is left pending.

The failing rank joins only once every other rank of the group is known to be in the
agreement (each marks itself in the store while there): a peer that never comes (it
failed on its own, or the program diverged) would leave the all-gather pending on the
group and mismatch its next collective. It waits for that ``PLAIT_FAULT_TIMEOUT`` seconds
(default 10); after that it raises its own error alone, as before.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from plait import spmd
from plait.pipeline.p2p import PipelineAbort, abort_reason, publish_abort

__all__ = ["Agreement"]

logger = logging.getLogger(__name__)
_POLL = 0.01  # seconds between looks at the store while waiting for the other ranks


class Agreement:
    """The first-run check of one schedule's order on one rank.

    ``name``: the schedule's (``known_names`` are the names other ranks may run, to name
    them in errors); ``facts``: what every rank must agree on (the number of microbatches,
    of stages, the order's checksum); ``group`` / ``device``: the pipeline group and where
    its tensors live. ``agreed`` turns True once :meth:`check` passed.
    """

    def __init__(
        self,
        name: str,
        facts: Sequence[int],
        group: dist.ProcessGroup,
        device: torch.device,
        known_names: Iterable[str],
    ) -> None:
        self.name = name
        self.row = [_crc(name), *facts]
        self.group, self.device = group, device
        self.names = {_crc(n): n for n in known_names}
        self.n_ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = ",".join(map(str, dist.get_process_group_ranks(group)))
        self.here = [f"plait/pipeline_agreement/{ranks}/{r}" for r in range(self.n_ranks)]
        self.agreed = self.n_ranks == 1

    def check(self) -> None:
        """Raise DivergenceError unless every rank runs the same order, or PipelineAbort
        if a rank reports its failure here; one small all-gather."""
        self._gather(failure=0)
        self.agreed = True

    def report_failure(self, error: BaseException) -> None:
        """Tell the other ranks, waiting in this agreement, that this rank's step failed
        with ``error`` (see the module docstring); never raises: the caller raises
        ``error``."""
        store = spmd.default_store()
        try:
            store.set(self.here[self.rank], "1")
            deadline = time.monotonic() + float(os.environ.get("PLAIT_FAULT_TIMEOUT", "10"))
            others = [k for r, k in enumerate(self.here) if r != self.rank]
            while not store.check(others):
                if time.monotonic() > deadline:
                    logger.warning(
                        "plait: %s failed before the other pipeline ranks reached its first "
                        "step; they were not told (they may wait for this rank): %s",
                        self.name,
                        error,
                    )
                    return
                time.sleep(_POLL)
            where = f"pipeline rank {self.rank} (global rank {dist.get_rank()})"
            self._gather(publish_abort(f"{where} failed: {type(error).__name__}: {error}"))
        except Exception as failure:  # the group may be broken too: the original error counts
            logger.warning("plait: could not tell the other ranks of %s: %s", error, failure)
        finally:
            store.delete_key(self.here[self.rank])

    def _gather(self, failure: int) -> None:
        """All-gather every rank's row (plus a failure key, 0 if none); raise for another
        rank's failure, then for a disagreement."""
        local = torch.tensor([*self.row, failure], dtype=torch.int64, device=self.device)
        gathered = local.new_empty(self.n_ranks * local.numel())
        owner = f"the agreement check of {self.name}"
        store = spmd.default_store()
        store.set(self.here[self.rank], "1")  # a failing rank joins only if all are here
        try:
            spmd.record("all_gather", local, self.group, owner)
            work = dist.all_gather_single(gathered, local, group=self.group, async_op=True)
            spmd.wait(work, f"all_gather of {owner}")
            # Read before the marker goes: NCCL's wait only orders the stream, and the host
            # is here (for a failing rank to see) until the rows have arrived.
            rows = gathered.view(self.n_ranks, local.numel()).tolist()
        finally:
            store.delete_key(self.here[self.rank])
        failed = [(r, row[-1]) for r, row in enumerate(rows) if row[-1]]
        if failed and not failure:
            rank, key = failed[0]
            reason = abort_reason(key)
            source = dist.get_global_rank(self.group, rank)
            raise PipelineAbort(
                f"plait: the pipeline step stopped because {reason} (this rank was waiting "
                f"for the agreement on {self.name} with rank {source}, before its first "
                "message)",
                reason,
                source,
                key,
            )
        facts = [row[:-1] for row in rows]
        if not failure and any(row != facts[0] for row in facts):
            raise spmd.DivergenceError(self._disagreement(facts))

    def _disagreement(self, rows: list[list[int]]) -> str:
        sides = [
            f"pipeline rank {r} (global rank {dist.get_global_rank(self.group, r)}) runs "
            f"{self.names.get(crc, 'an unknown schedule')} with {m} microbatches over "
            f"{stages} stages (order checksum {checksum:08x})"
            for r, (crc, m, stages, checksum) in enumerate(rows)
        ]
        return (
            "plait: the ranks of the pipeline disagree on the schedule: "
            + "; ".join(sides)
            + ". Build the same schedule class, with the same n_microbatches and "
            "num_stages (and the same loaded order), on every rank of the pipeline group "
            "(otherwise they wait forever for messages the others never send)."
        )


def _crc(name: str) -> int:
    return zlib.crc32(name.encode())
