"""One worker of one fault-tolerant replica group (``--replica-groups``): the training loop
under torchft.

The group builds the model as any ``plait train`` run does (:class:`plait.train.loop.
_Session`: its pipeline stages, tensor parallelism, then ``fully_shard`` per block and each
stage's root over the group's ``--dp-shard`` x ``--cp`` ranks), reading its share of every
global batch (:mod:`plait.train.replicas`); each rank's peers in the other groups are the
ranks of the same number, holding the same shards. torchft is wired as torchtitan wires it
for HSDP:

* a ``torchft.Manager`` per group (its own gloo / NCCL process group across the groups,
  ``min_replica_size=1``) talks to the lighthouse; each step starts with a quorum of the
  groups alive;
* every ``FSDPModule`` (of every local stage) gets ``set_all_reduce_hook``: after the
  group's reduce-scatter, each gradient shard is averaged over the quorum's groups
  (torchft's ``ManagedProcessGroup``), and an MoE's token counts (its balance loss over
  the global batch, its bias) are summed over the groups too;
* the optimizer steps only when ``manager.should_commit()`` says every rank of the group
  got through the step (a group that died mid-step fails the others' all-reduce: they do
  not commit, and redo the step with the next quorum, without it);
* healing: the manager's state callables carry the model's and the optimizer's state
  dicts, snapshotted on the training thread at every step boundary. The quorum is
  synchronous (``use_async_quorum=False``): a group that comes back receives a live
  group's state and step count in the quorum, before its first forward, so it trains
  that step with the live group's weights, and its losses from there on are real ones
  (with torchft's default asynchronous quorum its first step back would run on its stale
  weights and contribute nothing).

The step a group trains is torchft's step count plus one: a group that comes back (or
resumes an older checkpoint) jumps to the live groups' step, and reads that step's data.
A group's checkpoints (``<run-dir>/group<g>``) hold its state and step; a restarted group
resumes from its own newest checkpoint first (any group alone can then go on), and heals
from a live group that is further on.

Started by :func:`plait.train.worker.worker_main`: under the local launcher
(:func:`plait.train.replicas.launch_replicas`: ``python -m plait.train.worker
CONFIG.json``), or through ``plait train`` under torchrun.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait import spmd
from plait.experts import set_load_balance_groups
from plait.fsdp import FSDPModule
from plait.train.config import TrainConfig
from plait.train.loop import TrainResult, _Session, model_flops_per_token
from plait.train.optimizer import lr_at, set_lr
from plait.train.replicas import (
    HOST_VARIABLE,
    LIGHTHOUSE_VARIABLE,
    START_VARIABLE,
    group_run_dir,
    lighthouse_status,
    replica_group,
)
from plait.train.reporter import Reporter
from plait.train.restart import restart_count, restarted
from plait.train.step_batch import global_loss

__all__ = ["HOLD_VARIABLE", "hold_marker", "train_replica"]

#: Test-only: ``STEP`` or ``STEP,STEP,...``: before each such step's quorum, the groups in
#: their first life leave a marker (``<run-dir>/replicas/hold-STEP``) and wait until another
#: group (one coming back) asks the lighthouse for a quorum, so that it rejoins at that step;
#: a group's life ``k >= 1`` asks for its first quorum only once the ``k``-th hold's marker is
#: there, so that it cannot join earlier (while the lighthouse still counts its dead life as
#: heartbeating): the steps trained alone are the same in every run.
HOLD_VARIABLE = "PLAIT_TEST_REPLICAS_REJOIN_AT_STEP"
_MAX_FAILED_STEPS = 5  # uncommitted steps in a row before the group gives up


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, advertising ``host`` (torchft advertises the
    machine's name, which may not resolve to where it listens)."""
    from torchft.checkpointing import HTTPTransport

    class Transport(HTTPTransport):  # type: ignore[misc]
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)


def _wait_for_groups(url: str, groups: int, seconds: float, predicate: str) -> None:
    """Poll the lighthouse until ``predicate`` holds of its status ("start": every group
    heartbeats; "rejoin": one group asks for a quorum and every group heartbeats), at most
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status = lighthouse_status(url)
        if status is not None:
            waiting, heartbeating = status
            if heartbeating >= groups and (predicate == "start" or waiting >= 1):
                return
        time.sleep(0.05)


def hold_marker(directory: Path, step: int) -> Path:
    """(test-only) The file in ``directory`` that says the live groups hold before ``step``
    (:data:`HOLD_VARIABLE`; torch's reference in the tests leaves the same)."""
    return directory / f"hold-{step}"


def _holds(cfg: TrainConfig) -> tuple[list[int], Path]:
    """(test-only) :data:`HOLD_VARIABLE`'s steps, and where their markers go."""
    holds = sorted(int(part) for part in os.environ.get(HOLD_VARIABLE, "").split(",") if part)
    return holds, Path(cfg.run_dir).parent / "replicas"


def _patience(cfg: TrainConfig) -> float:
    """Seconds a hold waits for a restarted group: imports, the model, its checkpoint."""
    return max(120.0, 3 * cfg.fault_timeout)


def _wait_for_file(path: Path, seconds: float) -> None:
    """Poll until ``path`` exists, at most ``seconds`` (then go on: the test's checks fail)."""
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


class _Replica:
    """The torchft side of one worker: manager, all-reduce hooks, healing state."""

    def __init__(self, session: _Session, cfg: TrainConfig, group: int, step: int) -> None:
        import torchft
        from torchft.process_group import ManagedProcessGroup

        self.session, self.cfg = session, cfg
        self.snapshot: dict[str, Any] = {}
        timeout = timedelta(seconds=cfg.fault_timeout)
        host = os.environ.get(HOST_VARIABLE) or socket.gethostname()
        pg_class = torchft.ProcessGroupNCCL if cfg.device == "cuda" else torchft.ProcessGroupGloo
        self.manager = torchft.Manager(
            pg=pg_class(timeout=timeout),
            load_state_dict=self._load,
            state_dict=lambda: dict(self.snapshot),
            min_replica_size=1,
            use_async_quorum=False,
            replica_id=f"plait_group{group}",
            lighthouse_addr=os.environ.get(LIGHTHOUSE_VARIABLE),
            hostname=host,
            timeout=timeout,
            quorum_timeout=timeout * 3,
            connect_timeout=timeout,
            checkpoint_transport=_transport(host, timeout),
            init_sync=False,  # every group builds the same seeded weights
        )
        if step:  # resumed from a checkpoint: torchft counts from there
            self.manager.load_state_dict({"step": step, "batches_committed": 0})
        managed = ManagedProcessGroup(self.manager)

        def all_reduce_hook(reduced: torch.Tensor) -> None:
            dist.all_reduce(reduced, group=managed, op=dist.ReduceOp.AVG)

        hooked = 0
        for stage in session.modules:  # this rank's pipeline stages (one without --pp)
            # Experts balance over the global batch: every group's tokens.
            set_load_balance_groups(stage, (managed,))
            for module in stage.modules():
                if isinstance(module, FSDPModule):
                    module.set_all_reduce_hook(all_reduce_hook)
                    hooked += 1
        assert hooked, "--replica-groups: no fully_shard module to hook"
        self.take_snapshot()

    def take_snapshot(self) -> None:
        """The state a healing group receives, taken here on the training thread between
        steps (torchft reads it from its own threads): views of the live shards and
        optimizer state, which change only in ``optimizer.step()``, once torchft has
        stopped serving the step's checkpoint (``should_commit``)."""
        self.snapshot = {
            "model": [stage.state_dict() for stage in self.session.modules],
            "optim": self.session.optimizer.state_dict(),
        }

    def _load(self, state: dict[str, Any]) -> None:
        for stage, values in zip(self.session.modules, state["model"], strict=True):
            stage.load_state_dict(values)
        self.session.optimizer.load_state_dict(state["optim"])

    def update(self) -> tuple[bool, float]:
        """After the backward (gradients averaged over the quorum by the hooks): clip, and
        step the optimizer if torchft commits. Returns (committed, gradient norm)."""
        committed = False

        def commit() -> bool:
            nonlocal committed
            committed = self.manager.should_commit()
            return committed

        norm = self.session.parts.update(commit)
        self.take_snapshot()
        return committed, float(norm)


def train_replica(cfg: TrainConfig) -> TrainResult:
    """Train ``cfg`` as one worker of replica group ``PLAIT_REPLICA_GROUP`` (module
    docstring), in ``<run-dir>/group<g>``."""
    group = replica_group()
    cfg = restarted(cfg.replace(run_dir=str(group_run_dir(cfg.run_dir, group))))
    life = restart_count()
    session = _Session(cfg, (group, cfg.replica_groups))
    start = session.resume() if cfg.resume else 0
    holds = _holds(cfg)
    steps, markers = holds
    if 0 < life <= len(steps):  # (test-only) rejoin at the survivors' hold, not before:
        # a group heartbeats from its manager's creation on, and the lighthouse waits for
        # every group heartbeating before it forms a quorum
        _wait_for_file(hold_marker(markers, steps[life - 1]), _patience(cfg))
    replica = _Replica(session, cfg, group, start)
    try:
        return _train(session, replica, cfg, start, life, holds)
    finally:
        replica.manager.shutdown(wait=False)


def _train(
    session: _Session,
    replica: _Replica,
    cfg: TrainConfig,
    start: int,
    life: int,
    holds: tuple[list[int], Path],
) -> TrainResult:
    manager, groups = replica.manager, cfg.replica_groups
    url = os.environ.get(LIGHTHOUSE_VARIABLE, "")
    last = cfg.stop_after or cfg.steps
    result = TrainResult(session.run_dir, start)
    rank0 = _rank() == 0
    report = Reporter(
        cfg, start, enabled=rank0, restart=life, flops_per_token=model_flops_per_token(cfg)
    )

    def validate(step: int) -> None:
        result.val_losses[step] = session.validate()
        report.validation(step, result.val_losses[step])

    if start == 0 and life == 0:
        validate(0)
    if os.environ.get(START_VARIABLE):  # the first quorum waits for every group
        _wait_for_groups(url, int(os.environ[START_VARIABLE]), cfg.fault_timeout, "start")
    steps, markers = holds
    failed = 0
    while manager.current_step() < last:
        if manager.current_step() + 1 in steps and life == 0:  # (test-only)
            if rank0:
                markers.mkdir(parents=True, exist_ok=True)
                hold_marker(markers, manager.current_step() + 1).touch()
            _wait_for_groups(url, groups, _patience(cfg), "rejoin")
        manager.start_quorum()  # heals this group if it is behind
        step = manager.current_step() + 1
        if step > last:  # healed to the end of the run
            break
        began = time.perf_counter()
        set_lr(session.optimizer, lr_at(step - 1, session.parts.optim))
        session.faults.step = step
        local = session.stepper.train(session.batch("train", step - 1))
        session.faults.step = 0
        committed, norm = replica.update()
        spmd.check("end of a training step")
        loss = global_loss(local, session.parts.execution.layout)[0]
        if not committed:
            failed += 1
            error = manager.errored()
            why = f": {error.original_exception}" if error is not None else ""
            if rank0:
                print(
                    f"plait train: group {cfg.run_dir}: step {step} not committed{why}; redoing it",
                    file=sys.stderr,
                    flush=True,
                )
            if failed > _MAX_FAILED_STEPS:
                raise RuntimeError(f"step {step} failed {failed} times in a row{why}")
            continue
        failed = 0
        elapsed = time.perf_counter() - began
        result.losses.append(loss)
        record = session.step_record(step, loss, norm, elapsed)
        report.step({**record, "groups_in_step": manager.num_participants()})
        validating, saving = session.due(step, last)  # no snapshots (check_snapshots)
        if validating:
            validate(step)
        if saving:
            report.checkpoint(*session.checkpointer.save(step))
    report.written(max(start, last), session.checkpointer.close())
    if last < cfg.steps:
        report.stopped(last)
    report.finish(session.checkpointer.staged_bytes)
    return result
