"""The parity oracle: a parallel run must train exactly like one process on the global batch.

``check_parity`` runs *inside a rank* (call it from a body given to ``run_on_ranks``). It
builds the model twice from the same seed: a reference copy that trains alone on every
global batch (no communication at all), and a copy that ``parallelize`` wraps and that
trains on this rank's slice of each global batch. After every step it compares the
reference loss with the mean of the ranks' local losses, and at the end every parameter
(DTensor parameters are gathered with ``full_tensor()``). Any difference raises
``AssertionError`` naming the step or parameter and the size of the difference.

For a mean-reduced loss and equal slices, the mean of local losses *is* the global loss
and the averaged gradient *is* the global gradient, so a correct data-parallel wrapping
matches to rounding error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
StepFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, LossFn], torch.Tensor]


def default_step(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn
) -> torch.Tensor:
    """Forward, loss and backward of one batch; returns the (detached) loss."""
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    return loss.detach()


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def local_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous share of a global batch along dim 0 (must divide evenly)."""
    if t.shape[0] % world:
        raise ValueError(f"global batch of {t.shape[0]} does not split over {world} ranks")
    return t.chunk(world)[rank]


@dataclass
class ParityReport:
    reference_losses: list[float] = field(default_factory=list)
    parallel_losses: list[float] = field(default_factory=list)
    max_param_diff: float = 0.0


class StageModules(nn.Module):
    """A rank's pipeline stage modules seen as one model, for ``check_parity``: their
    parameters under their own (whole-model) names. Holds the modules without registering
    them, so nothing is renamed."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self._parts = modules

    def named_parameters(  # type: ignore[override]
        self, *args: object, **kwargs: object
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for m in self._parts:
            yield from m.named_parameters(*args, **kwargs)  # type: ignore[arg-type]


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathering a DTensor if needed."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def check_parity(
    build_model: Callable[[], nn.Module],
    parallelize: Callable[[nn.Module], nn.Module],
    batches: Sequence[Batch],
    *,
    loss_fn: LossFn = nn.functional.mse_loss,
    make_optimizer: Callable[..., torch.optim.Optimizer] = default_optimizer,
    step: StepFn = default_step,
    seed: int = 0,
    data_rank: int | None = None,
    data_world: int | None = None,
    loss_group: dist.ProcessGroup | None = None,
    build_reference: Callable[[], nn.Module] | None = None,
    atol: float = 1e-6,
    rtol: float = 1e-5,
) -> ParityReport:
    """Train reference and parallel copies on ``batches``; raise if they ever differ.

    ``data_rank`` / ``data_world`` choose this rank's slice of each global batch (default:
    the global rank and world size); ``loss_group`` is the group over which local losses
    are averaged (default: the world). ``build_reference`` builds the reference model when
    it must differ from ``build_model`` (e.g. edits the parallel copy only gets after
    wrapping).
    """
    rank = dist.get_rank() if data_rank is None else data_rank
    world = dist.get_world_size() if data_world is None else data_world
    report = ParityReport()

    torch.manual_seed(seed)
    reference = (build_reference or build_model)()
    torch.manual_seed(seed)
    parallel = parallelize(build_model())
    ref_opt = make_optimizer(reference.parameters())
    par_opt = make_optimizer(parallel.parameters())

    for i, (inputs, targets) in enumerate(batches):
        ref_loss = step(reference, inputs, targets, loss_fn)
        ref_opt.step()
        ref_opt.zero_grad()

        local = step(
            parallel, local_slice(inputs, rank, world), local_slice(targets, rank, world), loss_fn
        ).clone()
        dist.all_reduce(local, group=loss_group)
        par_loss = local / world
        par_opt.step()
        par_opt.zero_grad()

        report.reference_losses.append(ref_loss.item())
        report.parallel_losses.append(par_loss.item())
        if not torch.allclose(par_loss, ref_loss, atol=atol, rtol=rtol):
            raise AssertionError(
                f"step {i}: parallel loss {par_loss.item():.8g} != reference "
                f"{ref_loss.item():.8g} (diff {abs(par_loss - ref_loss).item():.3g})"
            )

    ref_params = dict(reference.named_parameters())
    for name, param in parallel.named_parameters():
        got = full_value(param.detach())
        want = ref_params[name].detach()
        same_shape = got.shape == want.shape
        diff = (got - want).abs().max().item() if same_shape and got.numel() else 0.0
        report.max_param_diff = max(report.max_param_diff, diff)
        if not same_shape or not torch.allclose(got, want, atol=atol, rtol=rtol):
            raise AssertionError(
                f"parameter {name!r} differs from the reference after {len(batches)} steps: "
                f"shape {tuple(got.shape)} vs {tuple(want.shape)}, max abs diff {diff:.3g}"
            )
    return report


def random_batches(
    steps: int, batch: int, in_features: int, out_features: int, seed: int = 1
) -> list[Batch]:
    """Deterministic (inputs, targets) global batches, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, in_features, generator=gen),
            torch.randn(batch, out_features, generator=gen),
        )
        for _ in range(steps)
    ]


def train_local(model: nn.Module, batches: Sequence[Batch], steps_per_opt: int = 1) -> list[float]:
    """AdamW on this rank's slice of each global batch (MSE loss); returns local losses.

    The optimizer steps every ``steps_per_opt`` batches, so gradients of the batches in
    between accumulate. For comparing two parallel wrappings with each other.
    """
    opt = default_optimizer(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for i, (inputs, targets) in enumerate(batches):
        loss = default_step(
            model,
            local_slice(inputs, rank, world),
            local_slice(targets, rank, world),
            nn.functional.mse_loss,
        )
        losses.append(loss.item())
        if (i + 1) % steps_per_opt == 0:
            opt.step()
            opt.zero_grad()
    return losses
