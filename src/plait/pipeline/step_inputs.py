"""What one ``schedule.step`` / ``schedule.eval`` call takes (:class:`StepInputs`), turned
into this rank's microbatches (:class:`~plait.pipeline.runtime.StepData`) by :func:`step_data`.

Two forms, as torch's schedules:

* **whole batch** (torch 2.13): ``step(*args, target=None, losses=None, return_outputs=True,
  loss_kwargs=None, **kwargs)``: ``args`` / ``kwargs`` / ``target`` are cut into
  microbatches with :func:`~plait.pipeline.microbatch.split_args_kwargs_into_chunks` and the
  schedule's chunk specs;
* **microbatch lists** (torch's newest form, used by torchtitan): ``step(arg_mbs=[...],
  kwarg_mbs=[...], target_mbs=[...], losses=None, return_outputs=True, loss_kwargs=None)``:
  the caller has cut the microbatches itself (e.g. one attention mask per microbatch).
  Each list has one entry per microbatch; ``arg_mbs[i]`` is a tuple of positional
  arguments (a single value is taken as a 1-tuple). A list left out means "nothing"
  (ranks without the first stage pass no ``arg_mbs``, ranks without the last no
  ``target_mbs``).

The two forms cannot be mixed in one call. In both, ``loss_kwargs`` go to the loss function
(``loss_fn(output, target, **loss_kwargs)``) of every microbatch, never to the model; and
``return_outputs=False`` makes the last stage keep no outputs (only the losses) and
``step`` return None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from plait.pipeline.microbatch import ChunkSpec, split_args_kwargs_into_chunks
from plait.pipeline.runtime import LossFn, StepData

__all__ = ["Microbatching", "StepInputs", "step_data"]


@dataclass(frozen=True)
class StepInputs:
    """What one ``step`` / ``eval`` call was given, in either form (the module docstring):
    the whole batch (``args``, ``kwargs``, ``target``) or the microbatch lists
    (``arg_mbs``, ``kwarg_mbs``, ``target_mbs``); ``loss_kwargs`` for ``loss_fn``;
    ``return_outputs``."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    target: Any = None
    arg_mbs: Sequence[Any] | None = None
    kwarg_mbs: Sequence[dict[str, Any]] | None = None
    target_mbs: Sequence[Any] | None = None
    loss_kwargs: Mapping[str, Any] | None = None
    return_outputs: bool = True


@dataclass(frozen=True)
class Microbatching:
    """How one rank's schedule cuts a step's inputs: ``name`` (the schedule's, for
    messages), ``n_microbatches``, whether this rank holds the first / last stage, the loss
    function, ``scale_grads`` and the chunk specs of the whole-batch form."""

    name: str
    n_microbatches: int
    has_first: bool
    has_last: bool
    loss_fn: LossFn | None
    scale_grads: bool
    args_chunk_spec: Sequence[ChunkSpec] | None
    kwargs_chunk_spec: Mapping[str, ChunkSpec] | None


def step_data(inputs: StepInputs, cut: Microbatching, *, backward: bool) -> StepData:
    """This rank's microbatches of one step (``backward``: the step trains); raises
    ValueError / TypeError naming the argument at fault."""
    name, m = cut.name, cut.n_microbatches
    lists = (inputs.arg_mbs, inputs.kwarg_mbs, inputs.target_mbs)
    given_lists = any(x is not None for x in lists)
    if given_lists and (inputs.args or inputs.kwargs or inputs.target is not None):
        raise ValueError(
            f"{name}.step: give either the whole batch (positional / keyword arguments and "
            "target=) or the microbatch lists (arg_mbs= / kwarg_mbs= / target_mbs=), not both"
        )
    loss_kwargs = inputs.loss_kwargs
    if loss_kwargs is not None and not isinstance(loss_kwargs, Mapping):
        raise TypeError(
            f"{name}.step: loss_kwargs must be a dict of keyword arguments for loss_fn, got "
            f"{type(loss_kwargs).__name__}"
        )
    if given_lists:
        args_list = _args_list(name, inputs.arg_mbs, m)
        kwargs_list = _checked_list(name, "kwarg_mbs", inputs.kwarg_mbs, m) or [{}] * m
        targets = _checked_list(name, "target_mbs", inputs.target_mbs, m)
    else:
        args_list, kwargs_list = split_args_kwargs_into_chunks(
            inputs.args if cut.has_first else (),
            dict(inputs.kwargs),
            m,
            cut.args_chunk_spec if cut.has_first else None,
            cut.kwargs_chunk_spec,
        )
        targets = None
        if cut.has_last and inputs.target is not None:
            target_split, _ = split_args_kwargs_into_chunks((inputs.target,), None, m)
            targets = [t for (t,) in target_split]
    if cut.has_first and not any(args_list) and not any(kwargs_list):
        raise ValueError(
            f"{name}.step: this rank holds stage 0, which needs the batch: pass it as "
            "positional arguments (or as arg_mbs=)"
        )
    if cut.has_last and backward and targets is None:
        raise ValueError(
            f"{name}.step: this rank holds the last stage, which needs target= (or "
            "target_mbs=) to compute the loss"
        )
    scales = [1.0] * m
    if cut.has_last and targets is not None and cut.scale_grads:
        scales = _row_shares(targets)
    return StepData(
        args_list,
        kwargs_list,
        targets if cut.has_last else None,
        scales,
        cut.loss_fn,
        backward,
        loss_kwargs=dict(loss_kwargs or {}),
        keep_outputs=inputs.return_outputs,
    )


def _checked_list(name: str, what: str, value: Sequence[Any] | None, m: int) -> list[Any] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name}.step: {what} must be a list, got {type(value).__name__}")
    if len(value) != m:
        raise ValueError(
            f"{name}.step: {what} has {len(value)} entries, but the schedule runs {m} "
            "microbatches: give one entry per microbatch"
        )
    return list(value)


def _args_list(name: str, arg_mbs: Sequence[Any] | None, m: int) -> list[tuple[Any, ...]]:
    checked = _checked_list(name, "arg_mbs", arg_mbs, m)
    if checked is None:
        return [()] * m
    return [tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in checked]


def _row_shares(target_mbs: Sequence[Any]) -> list[float]:
    """Microbatch i's share of the rows of the whole batch (see pipeline_schedule)."""
    rows = [_rows(t) for t in target_mbs]
    total = sum(rows)
    return [r / total for r in rows]


def _rows(target: Any) -> int:
    leaves = [t for t in tree_leaves(target) if isinstance(t, torch.Tensor)]
    return leaves[0].shape[0] if leaves and leaves[0].dim() else 1
