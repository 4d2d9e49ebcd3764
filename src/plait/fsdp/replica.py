"""A ``replicate`` unit's parameters: a ``fully_shard`` unit whose shard group is this rank.

With one rank per shard, sharding is the identity: there is nothing to gather and nothing
to pad, and the "sharded" parameter is the parameter itself, left on the module as the user
made it (a plain tensor, or the TP code's DTensor), which is what the optimizer, state
dicts and ``clip_grad_norm_`` keep seeing. What forward and backward use (the "unsharded"
parameter) is the parameter itself too, unless ``mp_policy.param_dtype`` differs from its
dtype or ``CPUOffloadPolicy`` keeps it on the CPU: then a copy in ``param_dtype`` on the
compute device, cast at each unshard and swapped onto the modules, whose gradient the unit
reduces into the parameter's ``.grad``, as ``fully_shard`` does.

Gradients are reduced by the same :class:`~plait.fsdp.reduce.GradientReduction` as
``fully_shard``'s, in buckets: each (unsharded) parameter's post-accumulate-grad hook tells
the unit's state (``replica_state``), which counts it towards its bucket.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from plait.fsdp.collectives import Groups
from plait.fsdp.group import FSDPParamGroup, ShardedState
from plait.fsdp.param import FSDPParam, Location, ParamPolicy
from plait.fsdp.settings import UnitSettings
from plait.fsdp.tp import unsharded_tp_spec
from plait.hooks import outside_graphs, traced
from plait.mesh import make_dtensor

__all__ = ["ReplicaGroup", "ReplicaParam"]


class ReplicaParam(FSDPParam):
    """A parameter of a ``replicate`` unit (see the module docstring).

    ``copies``: forward and backward use a copy (``unsharded``, created by the unit) rather
    than the parameter itself. The gather-side methods of :class:`FSDPParam` are never
    called on a replica: its unit neither gathers nor lays out shards.
    """

    def __init__(self, param: nn.Parameter, locations: list[Location], policy: ParamPolicy) -> None:
        # Not FSDPParam.__init__: nothing is sharded, padded or wrapped here.
        self.locations = locations
        self.fqn = locations[0].fqn
        self.policy = policy
        self.dim = self.start = self.gather_offset = 0
        self.even = True  # no padding: gradients concatenate as they are
        self.accumulated: torch.Tensor | None = None
        self.describe(param)

    def original(self) -> nn.Parameter:  # type: ignore[override]
        """The parameter this replica stands for: the module's own (no weak reference,
        which ``torch.utils.swap_tensors`` would refuse: :func:`plait.fsdp.param.swappable`)."""
        return self.sharded

    def describe(self, param: nn.Parameter) -> None:
        """Take ``param`` as this parameter: at construction, and again after
        ``module._apply`` or a replacement changed its data, dtype or device."""
        if self.policy.offload and not isinstance(param, DTensor) and param.device.type != "cpu":
            with torch.no_grad():  # CPUOffloadPolicy: the parameter lives on the CPU
                cpu = param.detach().to("cpu")
                pin = self.policy.pin_memory and torch.cuda.is_available()
                param.data = cpu.pin_memory() if pin else cpu
        self.sharded = param
        self.tp_spec = param._spec if isinstance(param, DTensor) else None
        local = self.local_value()
        self.global_shape = param.shape
        self.shape = local.shape
        self.local_shape = tuple(local.shape)
        self.numel = self.padded_numel = self.local_numel = local.numel()
        self.padded = local  # what this rank holds: the parameter's (local) data
        self.device = self.policy.device if self.policy.offload else local.device
        self._set_dtypes(local.dtype)
        self.copies = self.param_dtype != self.dtype or self.device != local.device
        self.unsharded = None if self.copies else param

    def _set_dtypes(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.param_dtype, self.reduce_dtype = self.policy.dtypes_for(dtype)
        tp = self.tp_spec
        self.unsharded_spec = None if tp is None else unsharded_tp_spec(tp, self.param_dtype)

    def local_value(self) -> torch.Tensor:
        """The parameter's values on this rank (a TP parameter's local tensor), detached."""
        param = self.sharded
        return (param._local_tensor if isinstance(param, DTensor) else param).detach()

    def reset_sharded(self) -> None:
        """After ``module._apply`` (``.to``, ``.double()``...): describe the parameter again."""
        current = self.locations[0].module._parameters.get(self.locations[0].name)
        if current is self.sharded:
            self.describe(self.sharded)

    def adopt_replacement(self) -> bool:
        """Take in a parameter the user assigned on the modules after ``replicate`` (before
        the first forward); True when one was, so the unit lays itself out again."""
        loc = self.locations[0]
        current = loc.module._parameters.get(loc.name)
        if current is self.sharded or current is None:
            return False
        if not isinstance(current, nn.Parameter):
            raise RuntimeError(
                f"replicate: parameter {loc.fqn!r} was replaced by {type(current).__name__} "
                "after replicate; assign an nn.Parameter, or load values with load_state_dict"
            )
        self.set_on_modules(current)
        self.describe(current)
        return True

    def stash_grad(self) -> None:
        """No-sync steps. With a copy, as ``fully_shard`` (into a reduce-dtype accumulator
        when the dtypes differ); without, the gradient stays in the parameter's ``.grad``,
        accumulated by autograd in the parameter's dtype, where DDP leaves it too."""
        if self.copies:
            super().stash_grad()

    def copy_grad_in(self, grad: torch.Tensor | None, dest: torch.Tensor) -> None:
        """Write ``grad`` into ``dest`` (1, numel), zeros if None."""
        if grad is None:
            dest.zero_()
        else:
            dest.copy_(grad.reshape(dest.shape))

    def accumulate_sharded_grad(self, reduced: torch.Tensor) -> None:
        """Add the reduced gradient (numel elements, a view of the bucket) to ``.grad``,
        laid out as the parameter; it stays a view of the bucket when nothing is cast."""
        local = reduced[: self.numel].view(self.shape)
        target = self.padded
        if local.dtype != self.dtype or local.device != target.device:
            local = self.grad_to(local, target.device)
        grad = self.sharded.grad
        if grad is None:
            tp = self.tp_spec
            self.sharded.grad = local if tp is None else make_dtensor(local, tp)
        else:
            (grad._local_tensor if isinstance(grad, DTensor) else grad).add_(local)


class ReplicaGroup(FSDPParamGroup):
    """The parameters of one ``replicate`` unit.

    Unsharding casts the parameters that need a copy (``ReplicaParam.copies``) into their
    copies and swaps those onto the modules; resharding swaps the parameters back and frees
    the copies' storage. Units without copies only change state: the modules hold the
    parameters throughout. ``grad_arrived(param)`` is called from each trainable
    parameter's post-accumulate-grad hook (on its copy, if any).
    """

    def __init__(
        self,
        params: list[ReplicaParam],
        groups: Groups,
        settings: UnitSettings,
        grad_arrived: Callable[[ReplicaParam], None],
    ) -> None:
        self.replicas = params
        self._grad_arrived = grad_arrived
        # Kept out of compiled graphs, as every plait backward hook.
        self._hook = outside_graphs(self._on_accumulated, backward=True)
        self._hooked: dict[int, tuple[torch.Tensor, RemovableHandle]] = {}  # id(param) ->
        self._by_tensor: dict[int, ReplicaParam] = {}  # id(hooked tensor) -> its param
        self._swaps: list[tuple[dict[str, nn.Parameter | None], str, ReplicaParam]] = []
        self._copy_dests: list[tuple[ReplicaParam, torch.Tensor]] = []
        super().__init__(list(params), groups, settings)
        self.owner = "a replicate unit"  # named by the root at lazy init (spmd reports)

    def lay_out(self) -> None:
        """(Re)create the copies and hooks from the parameters' current dtypes and devices:
        at construction and after ``module._apply``."""
        self.reduction.forget_layout()
        self._copy_dests = []
        for p in self.replicas:
            if p.copies:
                storage = torch.empty(p.shape, dtype=p.param_dtype, device=p.device)
                # ``.data`` twice: the copy and the cast's destination get their own version
                # counters, so a cast does not look like an in-place change of a tensor
                # autograd saved in forward.
                p.unsharded = p.new_unsharded(storage.data)
                self._copy_dests.append((p, storage.data))
                storage.untyped_storage().resize_(0)  # allocated at each unshard
        self._swaps = [
            (loc.module._parameters, loc.name, p)
            for p in self.replicas
            if p.copies
            for loc in p.locations
        ]
        self._hook_grads()

    def _hook_grads(self) -> None:
        """A post-accumulate-grad hook on what each trainable parameter's gradient lands on."""
        for p in self.replicas:
            target = p.unsharded if p.unsharded is not None else p.sharded
            old = self._hooked.get(id(p))
            if old is not None and old[0] is target:
                continue
            if old is not None:
                old[1].remove()
                self._by_tensor.pop(id(old[0]), None)
                del self._hooked[id(p)]
            if target.requires_grad:  # one unfrozen later is reduced at the end of backward
                self._by_tensor[id(target)] = p
                handle = target.register_post_accumulate_grad_hook(self._hook)
                self._hooked[id(p)] = (target, handle)

    def _on_accumulated(self, tensor: torch.Tensor) -> None:
        param = self._by_tensor.get(id(tensor))
        if param is not None:
            self._grad_arrived(param)

    # --- unshard / reshard: casts and swaps ------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Cast into the copies now (a local copy: there is nothing to wait for)."""
        del async_op
        self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        if self.sharded_state is ShardedState.UNSHARDED:
            return
        if self._copy_dests:
            with traced("plait.replicate.cast"), torch.no_grad():
                for p, dest in self._copy_dests:
                    dest.untyped_storage().resize_(dest.numel() * dest.element_size())
                    dest.copy_(p.local_value(), non_blocking=True)
                    p.follow_requires_grad()
            for parameters, name, p in self._swaps:
                parameters[name] = p.unsharded
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self, post_forward: bool = False) -> None:
        del post_forward
        if self.sharded_state is not ShardedState.UNSHARDED:
            return
        for parameters, name, p in self._swaps:
            parameters[name] = p.sharded
        for _, dest in self._copy_dests:
            dest.untyped_storage().resize_(0)
        self.sharded_state = ShardedState.SHARDED

    def prepare_post_forward(self, enabled: bool) -> None:
        del enabled  # nothing is kept after forward: there are no gathered rows

    def adopt_replacements(self) -> None:
        if self.sharded_state is ShardedState.SHARDED:
            relaid = [p.adopt_replacement() for p in self.replicas]  # every one
            if any(relaid):
                self.lay_out()

    def adopt_materialised(self) -> None:
        """Nothing to do: ``replicate`` broadcast real values at apply time."""

    def reduce_grads(self) -> None:
        """Launch the buckets not launched yet (hooks launched the others as their
        gradients arrived); ``finish_reduce`` waits for all of them."""
        self.reduction.start(self.owner)
