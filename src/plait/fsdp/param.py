"""One parameter managed by ``fully_shard``: its shard, its unsharded form, and the swap.

Layout (torch.chunk semantics along the shard dim ``d``, 0 unless ``shard_placement_fn``
says otherwise; "rows" below are the slices along ``d``): with ``world`` ranks a parameter
of ``rows`` rows is cut into chunks of ``chunk = ceil(rows / world)`` rows; rank ``r`` owns
rows ``[r * chunk, min((r + 1) * chunk, rows))``, which may be fewer than ``chunk`` (the
tail) or none at all. Each rank stores its rows, contiguous, at the start of a zero-padded
chunk of ``chunk`` rows' worth of elements, so that every rank contributes the same number
of elements to the unit's all-gather; padding is never seen by the user. (For ``d = 0`` that is
simply ``chunk`` rows, flattened; the common case has no padding at all.) ``rows.py`` holds
the arithmetic of that layout; ``replica.py`` the one-rank case ``replicate`` uses.

Between uses the module holds the **sharded parameter**: an ``nn.Parameter`` wrapping a
DTensor with placement ``Shard(d)`` whose local tensor is the unpadded view of the padded
chunk. While unsharded it holds the **unsharded parameter**: a plain ``nn.Parameter`` of
the full shape, created once by its unit as a view of the unit's unsharded buffer, whose
storage the unit frees (``resize_(0)``) at reshard and reallocates at unshard. Keeping the
same object alive lets autograd, which saved it during forward, see the re-gathered values
during backward.

A tensor-parallel parameter (a DTensor on a tp mesh) is sharded the same way, with its
TP-local tensor in the role of the full tensor above; tp.py says how its sharded and
unsharded forms are described.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeGuard, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils.weak import WeakIdKeyDictionary

from plait.fsdp.rows import copy_full_to_padded, copy_padded_to_full, shard_rows
from plait.fsdp.tp import (
    combined_mesh,
    local_grad,
    sharded_tp_spec,
    unsharded_tp_spec,
)
from plait.mesh import contiguous_strides, make_dtensor, own_storage


@dataclass(frozen=True)
class Location:
    """Where the module tree refers to a parameter (tied weights have several)."""

    module: nn.Module
    name: str
    fqn: str


def shard_spec(
    mesh: DeviceMesh, shape: torch.Size, dtype: torch.dtype, dim: int = 0
) -> DTensorSpec:
    """The (immutable, shareable) spec of a sharded parameter of global ``shape``.

    ``Shard(dim)`` on the last mesh dimension, ``Replicate()`` on any before it (HSDP).
    """
    meta = TensorMeta(shape, contiguous_strides(shape), dtype)
    placements = (*([Replicate()] * (mesh.ndim - 1)), Shard(dim))
    return DTensorSpec(mesh, placements, tensor_meta=meta)


class ShardPlacementError(ValueError, AssertionError):
    """``shard_placement_fn`` returned something that cannot shard the parameter.

    Also an ``AssertionError``, the type torch raises, so code written for torch catches it.
    """


def resolve_shard_dim(placement: object, param: torch.Tensor, fqn: str) -> int:
    """The non-negative dim that ``placement`` (a ``shard_placement_fn`` result) shards on.

    ``None`` means ``Shard(0)``; a negative dim counts from the end, as in torch.
    """
    if placement is None:
        return 0
    if type(placement) is not Shard:
        raise ShardPlacementError(
            f"fully_shard: shard_placement_fn returned {placement!r} for parameter {fqn!r}; "
            "expected Shard(dim), None, or ShardPlacement(Shard(dim) or None, mesh)"
        )
    dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.dim():
        raise ShardPlacementError(
            f"fully_shard: shard_placement_fn returned {placement} for parameter {fqn!r} of "
            f"shape {tuple(param.shape)}: Shard dim {placement.dim} is invalid for "
            f"{param.dim()}D tensor; return a dim in [{-param.dim()}, {param.dim()})"
        )
    return dim


@dataclass(frozen=True)
class ParamPolicy:
    """How a unit treats its parameters, resolved once at ``fully_shard`` time.

    ``param_dtype`` / ``reduce_dtype`` come from the mixed-precision policy (``None``: keep
    the parameter's own dtype); ``device`` is where compute happens (the all-gather and the
    unsharded parameters); with ``offload`` the shards and their gradients stay on the CPU.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    device: torch.device = torch.device("cpu")  # noqa: RUF009 - immutable
    offload: bool = False
    pin_memory: bool = False

    def dtypes_for(self, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype | None]:
        """``(param_dtype, reduce_dtype)`` of a parameter stored in ``dtype``: the policy's
        for floating parameters; non-float ones keep theirs and are never reduced."""
        if not (dtype.is_floating_point or dtype.is_complex):
            return dtype, None
        param_dtype = self.param_dtype or dtype
        return param_dtype, self.reduce_dtype or param_dtype


class FSDPParam:
    """A parameter of one unit and its three forms: sharded, padded chunk, unsharded.

    ``dtype`` is the original (sharded, optimizer) dtype; ``param_dtype`` the dtype of the
    all-gather and the unsharded parameter; ``reduce_dtype`` that of the gradient
    reduction (``None`` for non-float parameters, which never have gradients). These are
    fixed here, so freezing or unfreezing parameters later cannot change them.
    ``gather_offset`` is this parameter's byte offset in the unit's per-rank segment.
    """

    def __init__(
        self,
        param: nn.Parameter,
        locations: list[Location],
        mesh: DeviceMesh,
        rank: int,
        world: int,
        policy: ParamPolicy,
        dim: int = 0,
    ) -> None:
        self.locations = locations
        self.fqn = locations[0].fqn
        # The object modules held before fully_shard, to detect ties with other units; weak,
        # so the full-size tensor is freed unless something outside still uses it.
        self.original = weakref.ref(param)
        self.mesh = mesh
        self.policy = policy
        self.device = policy.device
        # A tensor-parallel parameter (a DTensor on a tp mesh, see tp.py): everything below
        # works on its TP-local tensor, which the dp ranks of one tp coordinate share.
        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        requires_grad = param.requires_grad
        self.global_shape = param.shape  # what the user sees: the whole parameter's shape
        local: torch.Tensor = param
        if isinstance(param, DTensor):
            self.spmd_mesh = combined_mesh(mesh, param.device_mesh)
            local = param._local_tensor
        self.shape = local.shape
        self.dim = dim
        self.rows = self.shape[dim]
        # The elements of one row: the dims before ``dim`` times those after it.
        self.row_numel = math.prod(self.shape[:dim]) * math.prod(self.shape[dim + 1 :])
        self.numel = local.numel()
        self.chunk_rows, self.start, self.local_rows = shard_rows(self.rows, rank, world)
        self.padded_numel = self.chunk_rows * self.row_numel
        self.local_shape = (*self.shape[:dim], self.local_rows, *self.shape[dim + 1 :])
        self.local_numel = self.local_rows * self.row_numel
        # No padding anywhere, and rows are outermost: the full tensor viewed as (world,
        # padded_numel) *is* the gathered layout, so copies between the two are single
        # kernels (always for dim 0; for another dim only when the dims before it are 1).
        outermost = math.prod(self.shape[:dim]) == 1 or world == 1
        self.even = self.chunk_rows * world == self.rows and outermost
        self.gather_offset = 0  # set by the unit once all its parameters are known
        self._set_dtypes(local.dtype)
        self.unsharded: nn.Parameter | None = None  # created on first unshard
        # Gradients accumulated without sync, kept in the reduce dtype (see stash_grad).
        self.accumulated: torch.Tensor | None = None

        self.padded = self._new_padded(local.detach(), rows_of_full=True)
        self.sharded = nn.Parameter(
            make_dtensor(self._local(self.padded), self.spec), requires_grad=requires_grad
        )
        self.set_on_modules(self.sharded)

    def _set_dtypes(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.param_dtype, self.reduce_dtype = self.policy.dtypes_for(dtype)
        if self.tp_spec is None:
            self.spec = shard_spec(self.mesh, self.shape, dtype, self.dim)
            self.unsharded_spec: DTensorSpec | None = None
        else:
            tp_spec = self.tp_spec
            self.spec = sharded_tp_spec(self.spmd_mesh, self.mesh.ndim, tp_spec, dtype, self.dim)
            self.unsharded_spec = unsharded_tp_spec(tp_spec, self.param_dtype)

    def _local(self, padded: torch.Tensor) -> torch.Tensor:
        """The unpadded local shard inside a padded chunk: its first ``local_numel``
        elements (a contiguous view)."""
        return padded.view(-1)[: self.local_numel].view(self.local_shape)

    def _own_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full-shape tensor (a view)."""
        return full.narrow(self.dim, self.start, self.local_rows)

    def _new_padded(self, source: torch.Tensor, *, rows_of_full: bool) -> torch.Tensor:
        """A zero-padded chunk (flat) holding this rank's rows of ``source`` (full or local)."""
        device = torch.device("cpu") if self.policy.offload else source.device
        if source.is_meta:
            device = source.device  # stays on meta until to_empty()
        if hasattr(type(source), "fsdp_pre_all_gather"):
            # A subclass with all-gather extensions (extensions.py) stays one: its hooks are
            # called on the local shard. (``new_zeros`` dispatches through the subclass.)
            padded = source.new_zeros(self.padded_numel, device=device)
            if not source.is_meta:
                with torch.no_grad():
                    rows = self._own_rows(source) if rows_of_full else source
                    self._local(padded).copy_(rows)
            return padded
        padded = torch.zeros(self.padded_numel, dtype=source.dtype, device=device)
        if self.policy.offload and self.policy.pin_memory and torch.cuda.is_available():
            padded = padded.pin_memory()
        if not source.is_meta:
            rows = self._own_rows(source) if rows_of_full else source
            with torch.no_grad():
                self._local(padded).copy_(rows)
        return padded

    @property
    def gather_nbytes(self) -> int:
        return self.padded_numel * self.param_dtype.itemsize

    # --- module view -------------------------------------------------------------------

    def set_on_modules(self, value: nn.Parameter) -> None:
        for loc in self.locations:
            loc.module._parameters[loc.name] = value

    def adopt_replacement(self) -> bool:
        """Take in a parameter the user assigned after ``fully_shard`` (before first use).

        The new value is a full (unsharded) tensor of the original shape, of which this rank
        keeps its chunk, or a DTensor laid out as the sharded parameter (what loaders that
        write parameters shard by shard assign, e.g. transformers' ``from_pretrained``),
        whose local tensor is taken in. Either way the module gets the sharded parameter
        back: an optimizer may already hold it. Returns True when the shard's storage was
        replaced instead (a real shard assigned while the unit is still on the meta device,
        where no optimizer can hold it yet): the unit must lay itself out again.
        """
        for loc in self.locations:
            current = loc.module._parameters.get(loc.name)
            if current is self.sharded:
                continue
            if self.same_layout(current) and self.padded.is_meta:
                if current._local_tensor.is_meta:
                    self.set_on_modules(self.sharded)
                    continue
                # on every location, then it becomes the shard (a DTensor nn.Parameter)
                self.set_on_modules(cast(nn.Parameter, current))
                self.reset_sharded()
                return True
            if self.same_layout(current):
                with torch.no_grad():
                    self._local(self.padded).copy_(current._local_tensor)
                self.sharded.requires_grad_(current.requires_grad)
                self.set_on_modules(self.sharded)
                continue
            if not isinstance(current, torch.Tensor) or isinstance(current, DTensor):
                raise RuntimeError(
                    f"fully_shard: parameter {loc.fqn!r} was replaced by "
                    f"{type(current).__name__} after fully_shard; assign a full tensor of "
                    f"shape {tuple(self.shape)} instead"
                )
            if self.tp_spec is not None:
                raise RuntimeError(
                    f"fully_shard: parameter {loc.fqn!r} is tensor-parallel and was replaced "
                    "after fully_shard; load new values with load_state_dict instead"
                )
            if current.shape != self.shape:
                raise RuntimeError(
                    f"fully_shard: parameter {loc.fqn!r} was replaced by a tensor of shape "
                    f"{tuple(current.shape)}, expected {tuple(self.shape)}"
                )
            with torch.no_grad():
                self._local(self.padded).copy_(self._own_rows(current))
            self.sharded.requires_grad_(current.requires_grad)
            self.set_on_modules(self.sharded)
        return False

    def same_layout(self, value: object) -> TypeGuard[DTensor]:
        """``value`` is a DTensor with the sharded parameter's mesh, placements and shape."""
        return (
            isinstance(value, DTensor)
            and value.device_mesh == self.spec.mesh
            and tuple(value.placements) == tuple(self.spec.placements)
            and value.shape == self.global_shape
            and value._local_tensor.shape == self.local_shape
        )

    def reset_sharded(self) -> None:
        """Re-point the sharded parameter at a padded chunk after ``module._apply``.

        ``to_empty``, ``.to(device)``, ``.double()`` and friends replace the local tensor
        inside the sharded DTensor; the padded chunk (what the all-gather sends) must
        follow, with the new values, device and dtype.
        """
        current = self.locations[0].module._parameters[self.locations[0].name]
        if not isinstance(current, nn.Parameter) or not isinstance(current, DTensor):
            return  # replaced by the user: adopt_replacement handles it at first use
        local = current._local_tensor
        padded = self.padded
        same = (local.data_ptr(), local.dtype, local.device)
        if same == (padded.data_ptr(), padded.dtype, padded.device):
            return
        self.sharded = current
        if local.dtype != self.dtype:
            self._set_dtypes(local.dtype)
        self.padded = self._new_padded(local, rows_of_full=False)
        # The parameter object stays (optimizers may hold it); only its local tensor moves.
        current._local_tensor = self._local(self.padded)
        current._spec = self.spec
        self.set_on_modules(current)
        self.unsharded = None
        if not self.policy.offload and not local.is_meta:
            self.device = local.device

    def move_padded(self, dest: torch.Tensor) -> None:
        """Move the padded chunk into ``dest`` (same shape); the sharded parameter follows."""
        with torch.no_grad():
            dest.copy_(self.padded)
        self.padded = dest = own_storage(dest)  # a piece of the unit's buffer, picklable
        self.sharded._local_tensor = self._local(dest)  # type: ignore[attr-defined]

    # --- unsharded storage ---------------------------------------------------------------

    def gather_input(self) -> torch.Tensor:
        """This rank's padded chunk as bytes, in ``param_dtype`` on the compute device."""
        chunk = self.padded.to(self.device, self.param_dtype, non_blocking=True)
        return chunk.view(-1).view(torch.uint8)

    def new_unsharded(self, data: torch.Tensor) -> nn.Parameter:
        """The unsharded parameter around ``data`` (the full, or full TP-local, tensor): a
        plain parameter, or for a tensor-parallel one a DTensor on its tp mesh (tp.py)."""
        value = data if self.unsharded_spec is None else make_dtensor(data, self.unsharded_spec)
        return nn.Parameter(value, self.sharded.requires_grad)

    def _unsharded_grad(self) -> torch.Tensor | None:
        """The unsharded parameter's gradient as a plain tensor of ``shape``."""
        grad = None if self.unsharded is None else self.unsharded.grad
        if grad is not None and self.tp_spec is not None:
            grad = local_grad(grad, self.tp_spec)
        return grad

    def zero_unsharded_grad(self) -> None:
        """Give the unsharded parameter a zero gradient (it exists: the unit unsharded)."""
        assert self.unsharded is not None
        zeros = torch.zeros(self.shape, dtype=self.unsharded.dtype, device=self.device)
        self.unsharded.grad = self.new_unsharded(zeros).data

    def follow_requires_grad(self) -> None:
        """The unsharded parameter follows the sharded one being frozen or unfrozen."""
        unsharded = self.unsharded
        if unsharded is not None and unsharded.requires_grad != self.sharded.requires_grad:
            unsharded.requires_grad_(self.sharded.requires_grad)

    # --- data movement between the full layout and the per-rank padded layout ------------

    def copy_out(self, gathered: torch.Tensor, dest: torch.Tensor) -> None:
        """Fill ``dest`` (the unsharded data) from ``gathered``: (world, gather_nbytes) bytes."""
        copy_padded_to_full(gathered.view(self.param_dtype), dest, self.chunk_rows, self.dim)

    def stash_grad(self) -> None:
        """Move the unsharded gradient into the reduce-dtype accumulator (no-sync steps).

        Autograd accumulates ``.grad`` in the parameter dtype; with bf16 parameters that
        would lose precision over microbatches, so accumulation happens here instead.
        """
        grad = None if self.unsharded is None else self.unsharded.grad
        if grad is None or grad.dtype == self.reduce_dtype:
            return  # autograd keeps accumulating into .grad, already in the right dtype
        grad = self._unsharded_grad()
        assert grad is not None and self.unsharded is not None and self.reduce_dtype is not None
        if self.accumulated is None:
            self.accumulated = grad.to(self.reduce_dtype)
        else:
            self.accumulated.add_(grad)
        self.unsharded.grad = None

    def take_grad(self) -> torch.Tensor | None:
        """The unsharded gradient to reduce (with any no-sync accumulation), cleared here."""
        grad = self._unsharded_grad()
        if self.accumulated is not None:
            grad = self.accumulated if grad is None else self.accumulated.add_(grad)
            self.accumulated = None
        if self.unsharded is not None:
            self.unsharded.grad = None
        return grad

    def copy_grad_in(self, grad: torch.Tensor | None, dest: torch.Tensor) -> None:
        """Write ``grad`` into ``dest`` (world, padded_numel), zeros if None."""
        if grad is None:
            dest.zero_()
        else:
            copy_full_to_padded(grad, dest, self.chunk_rows, self.dim)

    grad_copy: torch.Event | None = None
    """The copy of the last reduced gradient to the host, while in flight."""

    def grad_to(self, local: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``local`` (a reduced gradient) in the parameter's dtype on ``device``.

        A copy from an accelerator to the host runs without blocking only into a fresh
        gradient that nothing reads before the reductions finish: not one added to an
        existing gradient (the host adds at once) nor one a post-accumulate-grad hook reads
        (an optimizer stepped in backward). :meth:`wait_grad_copy` then waits for it, before
        an optimizer step can read it (torch's rule for its offloaded gradients)."""
        source = local.device
        to_host = device.type == "cpu" and source.type != "cpu"
        hooked = bool(getattr(self.sharded, "_post_accumulate_grad_hooks", None))
        early = to_host and self.sharded.grad is None and not hooked
        local = local.to(device, self.dtype, non_blocking=early or not to_host)
        if early:
            self.grad_copy = torch.accelerator.current_stream(source).record_event()
        return local

    def wait_grad_copy(self) -> None:
        """Wait for the gradient's copy to the host, if one is in flight."""
        if self.grad_copy is not None:
            self.grad_copy.synchronize()
            self.grad_copy = None

    def accumulate_sharded_grad(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced chunk (padded_numel elements) to the sharded gradient."""
        local = reduced[: self.local_numel].view(self.local_shape)  # a piece of the output
        # ``reduced`` is on the compute device: only offloaded shards live elsewhere.
        if self.policy.offload or local.dtype != self.dtype:
            local = self.grad_to(local, self.padded.device)
        if self.sharded.grad is None:
            self.sharded.grad = make_dtensor(local, self.spec)
        else:
            grad = self.sharded.grad
            assert isinstance(grad, DTensor)
            grad._local_tensor.add_(local)
        # Autograd accumulated into the unsharded parameter, never into this one, so it
        # runs none of the hooks registered on it with register_post_accumulate_grad_hook:
        # run them here, once per reduction, as torch's fully_shard does. Without this an
        # optimizer stepped inside backward (one per parameter, stepped by the hook) would
        # never step. (replicate's parameters are the ones autograd accumulates into.)
        hooks = getattr(self.sharded, "_post_accumulate_grad_hooks", None)
        for hook in list((hooks or {}).values()):
            hook(self.sharded)


# The identity of each parameter given to fully_shard, kept in a number so that a tie
# between two units is found even after both replaced the original parameter (ids of
# dead objects are reused; these numbers are not).
_PARAM_UIDS = WeakIdKeyDictionary()  # keyed by identity: tensors' == is elementwise
_NEXT_UID = itertools.count()


def param_uid(param: nn.Parameter) -> int:
    uid: int | None = _PARAM_UIDS.get(param)
    if uid is None:
        uid = _PARAM_UIDS[param] = next(_NEXT_UID)
    return uid


@contextlib.contextmanager
def swappable(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Drop the identity record's weak references to ``params`` while ``module._apply``
    may swap them, then restore them.

    ``torch.utils.swap_tensors`` (``module.to(...)`` under
    ``torch.__future__.set_swap_module_params_on_conversion(True)``) refuses a tensor that
    has weak references; ``replicate``'s parameters stay the module's own, so theirs would
    be refused. A swap keeps each parameter's Python identity, so the same objects are
    recorded again."""
    held = [(p, _PARAM_UIDS.pop(p)) for p in params if p in _PARAM_UIDS]
    try:
        yield
    finally:
        for p, uid in held:
            _PARAM_UIDS[p] = uid
