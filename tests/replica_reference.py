"""The reference of tests/test_train_replicas.py: one rank of one replica group, trained by
torch's ``fully_shard`` under torchft, as a torchft user writes it (torchtitan's wiring).

    replica_reference.py CONFIG.json OUT.json --group G --life L [--die-at STEP]
                         [--die-rank R] [--hold STEP[,STEP...]] [--after-hold STEP]
                         [--start-groups R] [--deadline SECONDS]

Run with ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` of the group and
``TORCHFT_LIGHTHOUSE``. The same model, data, loss, optimizer and learning rate as
``plait train`` (plait's GPT, batches and AdamW: the pieces that are not the parallelism),
sharded by ``torch.distributed.fsdp.fully_shard`` per block and the root over the group's
ranks; a torchft ``Manager`` per group (gloo, synchronous quorum, min_replica_size=1), an
all-reduce hook on every FSDPModule averaging over ``ManagedProcessGroup``, the optimizer
stepped when ``should_commit()``, the state for healing snapshotted at step boundaries.
``--die-at S``: rank ``--die-rank`` (0) SIGKILLs itself after the forward of step S;
``--hold``: before each such step, leave a marker ``hold-STEP`` beside OUT and wait until a
returning group asks for a quorum; ``--after-hold S``: ask for the first quorum once the
marker of hold ``S`` is there (plait's ``PLAIT_TEST_REPLICAS_REJOIN_AT_STEP``). Writes
every committed step's loss and participants. :func:`run_groups` runs two groups of two
such processes with a failure pattern (the test's and the failure drill's).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchft
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchft.checkpointing import HTTPTransport
from torchft.process_group import ManagedProcessGroup

from plait.train.config import from_mapping
from plait.train.data import load_data
from plait.train.loop import build_model
from plait.train.model import token_loss
from plait.train.optimizer import build_optimizer, lr_at, set_lr
from plait.train.replica_worker import hold_marker
from plait.train.replicas import _kill, _start_lighthouse, lighthouse_status
from plait.train.step_batch import step_batch


class Loopback(HTTPTransport):  # type: ignore[misc]
    def address(self) -> str:
        return f"http://127.0.0.1:{self._server.socket.getsockname()[1]}/checkpoint/"


def wait_lighthouse(groups: int, rejoin: bool) -> None:
    url = os.environ["TORCHFT_LIGHTHOUSE"]
    while True:  # the process's deadline (faulthandler) bounds this
        status = lighthouse_status(url)
        if status is not None and status[1] >= groups and (not rejoin or status[0] >= 1):
            return
        time.sleep(0.05)  # not a busy loop: the group it waits for needs the cores


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--life", type=int, required=True)
    parser.add_argument("--die-at", type=int, default=0)
    parser.add_argument("--die-rank", type=int, default=0)
    parser.add_argument("--hold", default="")
    parser.add_argument("--after-hold", type=int, default=0)
    parser.add_argument("--start-groups", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=240.0)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    holds = {int(step) for step in args.hold.split(",") if step}
    cfg = from_mapping(json.loads(args.config.read_text()))
    groups, timeout = cfg.replica_groups, timedelta(seconds=cfg.fault_timeout)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_data(cfg.corpus)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = build_optimizer([model], cfg)
    snapshot: dict[str, Any] = {}

    def take_snapshot() -> None:
        snapshot.update(model=model.state_dict(), optim=optimizer.state_dict())

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    while args.after_hold and not hold_marker(args.out.parent, args.after_hold).exists():
        time.sleep(0.05)  # before the manager: from then on the group heartbeats (deadline)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=load,
        state_dict=lambda: dict(snapshot),
        min_replica_size=1,
        use_async_quorum=False,
        replica_id=f"reference_group{args.group}",
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=timeout * 3,
        connect_timeout=timeout,
        checkpoint_transport=Loopback(timeout=timeout, num_chunks=0),
        init_sync=False,
    )
    managed = ManagedProcessGroup(manager)

    def hook(reduced: torch.Tensor) -> None:
        dist.all_reduce(reduced, group=managed, op=dist.ReduceOp.AVG)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(hook)
    take_snapshot()
    if args.start_groups:
        wait_lighthouse(args.start_groups, rejoin=False)
    records = []
    parts = groups * world
    tokens = cfg.batch_size // groups * cfg.seq_len
    while manager.current_step() < cfg.steps:
        if manager.current_step() + 1 in holds:
            hold_marker(args.out.parent, manager.current_step() + 1).touch()
            wait_lighthouse(groups, rejoin=True)
        manager.start_quorum()
        step = manager.current_step() + 1
        set_lr(optimizer, lr_at(step - 1, cfg))
        rows = data.batch("train", step - 1, cfg.batch_size, args.group * world + rank, parts)
        batch = step_batch(rows.inputs, rows.targets, rows.documents, cfg, None, tokens)
        loss = token_loss(model(batch.inputs, **batch.model_kwargs()), batch.targets) / tokens
        if step == args.die_at and rank == args.die_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        (loss * world).backward()
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        take_snapshot()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if committed:
            records.append(
                {"step": step, "loss": total.item(), "groups": manager.num_participants()}
            )
    if rank == 0:
        args.out.write_text(json.dumps(records))
    manager.shutdown(wait=False)
    dist.destroy_process_group()


Records = dict[int, tuple[float, int]]  # step -> (loss, groups in the step)


def _log(out: Path, group: int, life: int, rank: int) -> Path:
    """Where the process of ``rank`` in ``group``'s ``life`` writes its stderr: a failing
    rank's own traceback, quoted when it fails, not lost among its peers' expected ones."""
    return out / f"g{group}-l{life}-r{rank}.log"


def run_groups(
    config: Path, out: Path, kills: Sequence[tuple[int, int]], deadline: float
) -> dict[tuple[int, int], Records]:
    """Two groups of two ranks trained by this script, ``plait train``'s failure pattern:
    in life ``i`` of group 1 its rank ``kills[i][0]`` SIGKILLs itself in step
    ``kills[i][1]``, and life ``i + 1`` starts once it died; group 0 holds two steps after
    each kill for the next life to rejoin, which asks for its first quorum only then
    (``PLAIT_TEST_REPLICAS_REJOIN_AT_STEP``). Returns
    ``(group, life) -> records`` of rank 0, for group 0 and group 1's last life."""
    lighthouse, url = _start_lighthouse(out / "lighthouse.log")
    procs: dict[tuple[int, int], list[subprocess.Popen[bytes]]] = {}
    ends = time.monotonic() + deadline

    def start(group: int, life: int, *flags: str) -> None:
        port = str(9000 + (os.getpid() % 20000) + 10 * group + life)
        procs[group, life] = []
        for rank in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank))
            env.update(WORLD_SIZE="2", TORCHFT_LIGHTHOUSE=url, GLOO_SOCKET_IFNAME="lo")
            env.update(RUST_LOG="warn", OMP_NUM_THREADS="1")
            command = [sys.executable, __file__, str(config), str(out / f"g{group}-l{life}.json")]
            command += ["--group", str(group), "--life", str(life), "--deadline", str(deadline)]
            with _log(out, group, life, rank).open("wb") as log:  # the child keeps its copy
                procs[group, life].append(
                    subprocess.Popen(
                        [*command, *flags], env=env, stderr=log, start_new_session=True
                    )
                )

    holds = [step + 2 for _, step in kills]

    def dying(life: int) -> list[str]:
        flags = ["--after-hold", str(holds[life - 1])] if life else []
        if life == len(kills):
            return flags
        rank, step = kills[life]
        return [*flags, "--die-at", str(step), "--die-rank", str(rank)]

    try:
        start(0, 0, "--start-groups", "2", "--hold", ",".join(map(str, holds)))
        start(1, 0, "--start-groups", "2", *dying(0))
        for life in range(len(kills)):
            while all(p.poll() is None for p in procs[1, life]):
                if time.monotonic() > ends:
                    raise TimeoutError(f"the reference's group 1 never died in life {life}")
                time.sleep(0.05)
            _kill(procs[1, life])  # its other rank waits in the group's collectives
            start(1, life + 1, *dying(life + 1))
        for key in [(0, 0), (1, len(kills))]:
            for rank, proc in enumerate(procs[key]):
                code = proc.wait(timeout=max(ends - time.monotonic(), 1))
                if code:
                    tail = _log(out, *key, rank).read_text(errors="replace")[-6000:]
                    raise RuntimeError(
                        f"the reference's group {key[0]} (life {key[1]}) failed: its rank "
                        f"{rank} exited with {code}; the end of its stderr:\n{tail}"
                    )
    finally:
        _kill([p for ps in procs.values() for p in ps] + [lighthouse])
    found = {}
    for key in [(0, 0), (1, len(kills))]:
        records = json.loads((out / f"g{key[0]}-l{key[1]}.json").read_text())
        found[key] = {r["step"]: (r["loss"], r["groups"]) for r in records}
    return found


if __name__ == "__main__":
    main()
