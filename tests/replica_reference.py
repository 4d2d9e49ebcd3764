"""The reference of tests/test_train_replicas.py: one rank of one replica group, trained by
torch's ``fully_shard`` under torchft, as a torchft user writes it (torchtitan's wiring).

    replica_reference.py CONFIG.json OUT.json --group G --life L [--die-at STEP]
                         [--hold STEP] [--start-groups R]

Run with ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` of the group and
``TORCHFT_LIGHTHOUSE``. The same model, data, loss, optimizer and learning rate as
``plait train`` (plait's GPT, batches and AdamW: the pieces that are not the parallelism),
sharded by ``torch.distributed.fsdp.fully_shard`` per block and the root over the group's
ranks; a torchft ``Manager`` per group (gloo, synchronous quorum, min_replica_size=1), an
all-reduce hook on every FSDPModule averaging over ``ManagedProcessGroup``, the optimizer
stepped when ``should_commit()``, the state for healing snapshotted at step boundaries.
``--die-at S``: rank 0 SIGKILLs itself after the forward of step S. Writes every
committed step's loss and participants.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
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
from plait.train.replicas import lighthouse_status
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--life", type=int, required=True)
    parser.add_argument("--die-at", type=int, default=0)
    parser.add_argument("--hold", type=int, default=0)
    parser.add_argument("--start-groups", type=int, default=0)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(240, exit=True)
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
        if manager.current_step() + 1 == args.hold:
            wait_lighthouse(groups, rejoin=True)
        manager.start_quorum()
        step = manager.current_step() + 1
        set_lr(optimizer, lr_at(step - 1, cfg))
        rows = data.batch("train", step - 1, cfg.batch_size, args.group * world + rank, parts)
        batch = step_batch(rows.inputs, rows.targets, rows.documents, cfg, None, tokens)
        loss = token_loss(model(batch.inputs, **batch.model_kwargs()), batch.targets) / tokens
        if step == args.die_at and rank == 0:
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


if __name__ == "__main__":
    main()
