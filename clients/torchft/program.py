"""The training program: one rank of one replica group of torchft fault-tolerant HSDP.

Written for torch, as a torchft user writes it: the model is sharded over the ranks of its
replica group with ``fully_shard`` (torch's FSDP2, imported from
``torch.distributed.fsdp``), a torchft ``Manager`` per group talks to the lighthouse,
and the gradients are averaged across replica groups by an all-reduce hook on every
``FSDPModule`` that all-reduces over torchft's ``ManagedProcessGroup`` (the wiring
torchtitan uses). The optimizer is wrapped in torchft's ``OptimizerWrapper``: its
``zero_grad`` starts the step's quorum, its ``step`` asks the manager whether to commit.
The manager's ``state_dict`` / ``load_state_dict`` callables cover the model and the
optimizer, so a group that comes back heals from a healthy one through torchft's HTTP
checkpoint transport.

On plait nothing here changes: ``driver.py`` loads this module with its
``torch.distributed.fsdp`` imports resolved to plait's names (``redirect.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torchft
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchft.checkpointing import HTTPTransport
from torchft.process_group import ManagedProcessGroup

IN, HIDDEN, OUT = 16, 32, 8
BATCH = 8


@dataclass(frozen=True)
class Plan:
    """What one life of one rank does (the orchestrator, ``check.py``, decides)."""

    group: int  # replica group: 0 or 1
    first_step: int  # 1, or the step at which a group that left comes back
    last_step: int  # the step after which this life ends (the group leaves or finishes)
    scramble: bool  # fill the parameters with random values before (re)joining
    lighthouse: str  # http://127.0.0.1:PORT
    timeout_s: float  # torchft's operation timeout (collectives, RPCs, checkpoint fetch)


@dataclass
class StepRecord:
    step: int
    loss: float
    participants: int  # manager.num_participants() for this step's quorum
    participating: bool  # False while this group heals (it contributes zero gradients)
    committed: bool
    manager_step: int  # manager.current_step() after the optimizer step
    weights: dict[str, list[float]]  # this rank's parameter shards after the step


class LoopbackHTTPTransport(HTTPTransport[Any]):
    """torchft's HTTP checkpoint transport, advertising 127.0.0.1 instead of the host name
    (the host name may resolve to a non-loopback address on other machines)."""

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        return f"http://127.0.0.1:{port}/checkpoint/"


def build_model() -> nn.Sequential:
    torch.manual_seed(0)  # every group and rank starts from the same weights
    return nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, OUT),
    )


def batch(group: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data for (replica group, rank in group, step)."""
    generator = torch.Generator().manual_seed(10_000 * group + 100 * rank + step)
    x = torch.randn(BATCH, IN, generator=generator)
    return x, torch.randn(BATCH, OUT, generator=generator)


def local_shards(model: nn.Module) -> dict[str, list[float]]:
    out = {}
    for name, param in model.named_parameters():
        data = param.to_local() if hasattr(param, "to_local") else param
        out[name] = data.detach().flatten().tolist()
    return out


def scramble(model: nn.Module, group: int, rank: int) -> None:
    """Overwrite this rank's parameter shards with random values (a group whose state is
    lost or stale, which must heal from a healthy peer)."""
    generator = torch.Generator().manual_seed(777 + 10 * group + rank)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.copy_(torch.randn(local.shape, generator=generator) * 3.0)


@dataclass
class Trained:
    steps: list[StepRecord]
    model_class: list[str]  # the class fully_shard made and its FSDP base
    param_type: str  # the type of the sharded parameters


def train(plan: Plan, before_step: Callable[[int], None]) -> Trained:
    """Run this life's steps; ``before_step(step)`` lets the orchestrator hold a step."""
    rank, timeout = dist.get_rank(), timedelta(seconds=plan.timeout_s)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    model = build_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if plan.scramble:
        scramble(model, plan.group, rank)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # The state a healing group receives, taken on this thread at step boundaries, when
    # every unit is sharded: torchft calls ``state_dict`` from its quorum thread, during
    # the forward, and torch's ``fully_shard`` reshards a unit in ``module.state_dict()``
    # (a pre-hook), which would free parameters the forward and backward are using.
    # (torchtitan's ModelWrapper caches its state dict likewise.) The values are views of
    # the live shards and optimizer state, which change only in ``optimizer.step()``,
    # after torchft stopped serving checkpoints for the step (``should_commit``).
    snapshot: dict[str, Any] = {}

    def take_snapshot() -> None:
        snapshot["model"] = model.state_dict()
        snapshot["optim"] = inner.state_dict()

    def state_dict() -> dict[str, Any]:
        return dict(snapshot)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"group{plan.group}",
        lighthouse_addr=plan.lighthouse,
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=timeout * 3,
        connect_timeout=timeout,
        checkpoint_transport=LoopbackHTTPTransport(timeout=timeout, num_chunks=0),
        init_sync=False,  # every group builds the same seeded weights
    )
    try:
        replicate_pg = ManagedProcessGroup(manager)
        replicate_pg.register("dp_replicate")

        def all_reduce_hook(reduced: torch.Tensor) -> None:
            dist.all_reduce(reduced, group=replicate_pg, op=dist.ReduceOp.AVG)

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(all_reduce_hook)
        optimizer = torchft.Optimizer(manager, inner)  # torchft.optim.OptimizerWrapper

        records = []
        take_snapshot()
        for step in range(plan.first_step, plan.last_step + 1):
            before_step(step)
            optimizer.zero_grad()  # starts this step's quorum (heals if needed)
            x, y = batch(plan.group, rank, step)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # the hook all-reduces across the replica groups
            participating = manager.is_participating()
            before = manager.current_step()
            optimizer.step()  # should_commit (applies a healed state dict), then step
            take_snapshot()
            records.append(
                StepRecord(
                    step=step,
                    loss=loss.item(),
                    participants=manager.num_participants(),
                    participating=participating,
                    committed=manager.current_step() > before,
                    manager_step=manager.current_step(),
                    weights=local_shards(model),
                )
            )
            error = manager.errored()
            if error is not None:  # torchft skipped this step: say why, and stop
                raise RuntimeError(
                    f"group {plan.group} step {step}: torchft reported "
                    f"{type(error.original_exception).__name__}: {error.original_exception}"
                )
        return Trained(
            steps=records,
            model_class=[f"{c.__module__}.{c.__qualname__}" for c in type(model).__mro__[:2]],
            param_type=type(next(model.parameters())).__name__,
        )
    finally:
        manager.shutdown(wait=False)
