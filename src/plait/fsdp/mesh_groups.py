"""A unit whose parameters live on several meshes: one parameter group per mesh.

``shard_placement_fn`` may put parameters of one ``fully_shard`` call on different meshes
(``placement.py``): a mixture-of-experts block shards its experts over ``efsdp`` (beside
their ``ep`` sharding) and the rest over ``dp``. :class:`MeshGroups` is such a unit: an
:class:`FSDPParamGroup` per mesh, each with its own process groups, all-gather and
reduce-scatter, driven together. The unit's state and hooks see one parameter group:
every operation is applied to each group in order (the same order on every rank, so
collectives match), so prefetching, ``reshard_after_forward``, mixed precision, CPU
offload and gradient-sync settings (one ``UnitSettings``, shared) hold for all of them.

Gradient division is per group, as in torch: each group averages over its own ranks
(``gradient_divide_factor`` set on the module applies to every group instead).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from plait.fsdp.group import FSDPParamGroup, ShardedState

__all__ = ["MeshGroups"]


class _Reductions:
    """The groups' reductions seen as one (what the unit's state asks of ``reduction``)."""

    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self._groups = groups

    @property
    def open(self) -> bool:
        return any(g.reduction.open for g in self._groups)

    def zero_missing(self) -> None:
        for g in self._groups:
            g.reduction.zero_missing()


class MeshGroups(FSDPParamGroup):
    """One unit's parameter groups on different meshes, driven as one parameter group.

    ``meshes[i]`` is the mesh of ``groups[i]``; ``groups[0]`` is the group on the unit's own
    mesh when it has one (its process groups are the unit's ``groups``).
    """

    def __init__(self, groups: list[FSDPParamGroup], meshes: list[DeviceMesh]) -> None:
        # No FSDPParamGroup.__init__: every operation below goes to the groups.
        self.members = groups
        self.meshes = meshes
        self.params = [p for g in groups for p in g.params]
        self.settings = groups[0].settings
        self.groups = groups[0].groups  # the unit's own mesh's process groups
        self.reduction = _Reductions(groups)  # type: ignore[assignment]

    @property
    def owner(self) -> str:
        return self.members[0].owner

    @owner.setter
    def owner(self, value: str) -> None:
        for g, mesh in zip(self.members, self.meshes, strict=True):
            g.owner = f"{value} [mesh {mesh.mesh_dim_names or mesh}]"

    @property
    def sharded_state(self) -> ShardedState:
        return self.members[0].sharded_state

    @sharded_state.setter
    def sharded_state(self, value: ShardedState) -> None:
        for g in self.members:
            g.sharded_state = value

    @property
    def world(self) -> int:
        return self.members[0].world

    @property
    def busy(self) -> bool:
        return any(g.busy for g in self.members)

    # --- every operation, on every group in order ---------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        for g in self.members:
            g.unshard(async_op=True)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        for g in self.members:
            g.wait_for_unshard()

    def lay_out(self) -> None:
        for g in self.members:
            g.lay_out()

    def adopt_flat_storage(self) -> None:
        for g in self.members:
            g.adopt_flat_storage()

    def prepare_post_forward(self, enabled: bool) -> None:
        for g in self.members:
            g.prepare_post_forward(enabled)

    def reshard(self, post_forward: bool = False) -> None:
        for g in self.members:
            g.reshard(post_forward)

    def adopt_replacements(self) -> None:
        for g in self.members:
            g.adopt_replacements()

    def adopt_materialised(self) -> None:
        for g in self.members:
            g.adopt_materialised()

    def stash_grads(self) -> None:
        for g in self.members:
            g.stash_grads()

    def reduce_grads(self) -> None:
        for g in self.members:
            g.reduce_grads()

    def finish_reduce(self) -> None:
        for g in self.members:
            g.finish_reduce()

    def reduce_across(self) -> bool:
        pending = [g.reduce_across() for g in self.members]  # every one, in order
        return any(pending)

    def discard_inflight(self) -> None:
        for g in self.members:
            g.discard_inflight()
