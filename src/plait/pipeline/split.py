"""Cut a layered model into pipeline stage modules that keep every parameter's name.

A stage is a copy of the whole model in which the layers of the other stages are replaced
by a :class:`SkippedLayer`: a module without parameters that returns its first positional
argument unchanged, and is *falsy*. So the model's own ``forward`` runs as every stage's
forward, with no edits:

* a plain loop, ``for layer in self.layers: x = layer(x)`` (over an ``nn.ModuleList``, an
  ``nn.ModuleDict``'s values, or an ``nn.Sequential``), passes activations through the
  layers of other stages, also when layers take more arguments (``layer(x, mask)``);
* an embedding or a head of another stage passes its input through too
  (``x = self.emb(x)`` on a later stage gets hidden states and returns them);
* torchtitan's guards, ``h = self.tok_embeddings(tokens) if self.tok_embeddings else
  tokens``, see a falsy module and skip it, as they would skip ``None``.

What a forward must not do is compute outside its layers or combine the output of a
skipped layer with something else, since pass-through only makes sense for a chain of
layer calls: code between the calls runs on every stage (``x = torch.tanh(layer(x))``
applies ``tanh`` once per stage; move it into the layer), and ``x = self.tok_emb(ids)
+ self.pos_emb(pos)`` on a stage without the embeddings would add ``pos`` to the hidden
states. Guard such parts with the layer's truth value (``if self.tok_emb:``), as
:class:`~plait.train.model.GPT` does; ``is not None`` guards see a module and do not skip.

Because names are unchanged (a placeholder has no parameters or buffers), each stage's
``state_dict`` is a slice of the whole model's and loads back into it. Only the kept
layers are copied (removed ones are substituted during ``deepcopy``), so building a stage
costs the stage's memory, not the model's.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from plait.layout.schedule import stage_blocks

__all__ = ["SkippedLayer", "split_model", "stage_layers"]


class SkippedLayer(nn.Module):
    """A layer that lives on another pipeline stage: returns its first positional argument
    unchanged, holds no parameters, and is falsy (see the module docstring)."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.layer_name = name  # the replaced layer's name in the whole model
        self.stage = stage  # the stage that runs it

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not args:
            raise TypeError(
                f"{self.layer_name!r} runs on pipeline stage {self.stage}; on this stage it "
                "passes its first positional argument through, but it was called with "
                f"keyword arguments only ({sorted(kwargs)}): pass the activation "
                "positionally, or guard the call with `if self.<layer>:`"
            )
        return args[0]

    def __bool__(self) -> bool:
        return False

    def extra_repr(self) -> str:
        return f"{self.layer_name!r} on stage {self.stage}"


def stage_layers(
    model: nn.Module, n_stages: int, *, layers: str | None = None, end_blocks: int = 0
) -> list[list[str]]:
    """An even plan: the children of the container ``layers`` (default: of ``model``
    itself, e.g. an ``nn.Sequential``) in ``n_stages`` contiguous runs, earlier stages
    taking one more when they do not divide; the model's other children go to the first
    stage if registered before the container, else to the last. ``end_blocks``: what those
    other children weigh at each end, in layers, so the first and last stages hold that
    many fewer (:func:`plait.layout.stage_blocks`, torchtitan's
    ``pipeline_parallel_first_stage_less_layers`` / ``..._last_stage_less_layers``; only
    with ``layers``): a stage may then hold the embedding or the head alone.

    ``stage_layers(gpt, 2, layers="blocks")`` gives
    ``[["tok_emb", "pos_emb", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "head"]]``.
    """
    container = model if layers is None else model.get_submodule(layers)
    prefix = "" if layers is None else f"{layers}."
    names = [prefix + name for name, _ in container.named_children()]
    if end_blocks and layers is None:
        raise ValueError("end_blocks weighs the layers around the container: pass layers=")
    try:
        sizes = stage_blocks(len(names), n_stages, end_blocks)
    except ValueError as err:
        raise ValueError(
            f"cannot split the {len(names)} layers of {layers or type(model).__name__!r} into "
            f"{n_stages} stages: {err}"
        ) from None
    plan, start = [], 0
    for size in sizes:
        plan.append(names[start : start + size])
        start += size
    if layers is not None:
        children = [name for name, _ in model.named_children()]
        at = children.index(layers.split(".")[0])
        plan[0] = children[:at] + plan[0]
        plan[-1] = plan[-1] + children[at + 1 :]
    return plan


def split_model(
    model: nn.Module,
    plan: int | Sequence[Sequence[str]],
    *,
    layers: str | None = None,
    stages: Iterable[int] | None = None,
) -> list[nn.Module]:
    """Stage modules of ``model`` for the stage indices ``stages`` (default: all).

    ``plan`` lists, per stage, the names of the submodules (layers) it keeps, or is a
    number of stages for :func:`stage_layers` (with ``layers``). Every layer named in the
    plan belongs to exactly one stage; submodules the plan does not name are kept by every
    stage. ``model`` itself is not modified. Raises ValueError for unknown, repeated or
    nested layer names.
    """
    if isinstance(plan, int):
        plan = stage_layers(model, plan, layers=layers)
    owner = _owners(model, plan)
    wanted = range(len(plan)) if stages is None else list(stages)
    return [_stage_copy(model, owner, s) for s in wanted]


def _owners(model: nn.Module, plan: Sequence[Sequence[str]]) -> dict[str, int]:
    owner: dict[str, int] = {}
    modules = dict(model.named_modules())
    for s, names in enumerate(plan):
        for name in names:
            if name not in modules or not name:
                raise ValueError(
                    f"stage {s}: {name!r} is not a submodule of {type(model).__name__}"
                )
            if name in owner:
                raise ValueError(f"{name!r} is given to stages {owner[name]} and {s}")
            owner[name] = s
    for name in owner:
        parent = name.rpartition(".")[0]
        while parent:
            if parent in owner:
                raise ValueError(f"{name!r} is inside {parent!r}, which the plan also names")
            parent = parent.rpartition(".")[0]
    return owner


def _stage_copy(model: nn.Module, owner: dict[str, int], stage: int) -> nn.Module:
    """Deepcopy ``model``, substituting the layers of other stages (never copied)."""
    memo: dict[int, object] = {
        id(model.get_submodule(name)): SkippedLayer(name, s)
        for name, s in owner.items()
        if s != stage
    }
    return copy.deepcopy(model, memo)
