"""Where a unit's backward begins and ends in the autograd graph.

A unit's backward begins when the first gradient reaches one of its forward outputs
(:func:`register_on_outputs` registers the unit's pre-backward there) and ends when the
gradients of its inputs are computed (:class:`PostBackward`, an identity on the inputs,
calls the unit's post-backward from its backward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from plait.fsdp.cast import tensors_in


def register_on_outputs(output: Any, hook: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Register ``hook`` on every tensor of ``output`` that requires grad; return ``output``."""
    # torch's containers (dataclasses included), not just pytree nodes: a unit whose
    # output hides in a dataclass must still unshard before its backward.
    leaves = [output] if isinstance(output, torch.Tensor) else tensors_in(output)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(hook)
    return output


class PostBackward(torch.autograd.Function):
    """Identity on a unit's tensor inputs; its backward calls the unit's post-backward.

    Written in the form functorch's transforms accept (``forward`` without ``ctx``,
    ``setup_context``, ``generate_vmap_rule``, a ``jvp``), so a sharded module's forward
    can run inside ``torch.func.jvp`` or ``vmap`` as torch's can: the identity passes the
    tangents through, and the callback (not a tensor) has none."""

    generate_vmap_rule = True

    @staticmethod
    def forward(post_backward: Callable[[], None], *tensors: torch.Tensor) -> tuple[Any, ...]:
        # Views, not the inputs themselves: autograd then records this node for each
        # output, so the backward runs however the outputs are used.
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.post_backward = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.post_backward()
        return (None, *grads)

    @staticmethod
    def jvp(ctx: Any, _callback_tangent: Any, *tangents: torch.Tensor) -> tuple[Any, ...]:
        return tuple(tangents)

    @staticmethod
    def wrap_inputs(
        post_backward: Callable[[], None], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The inputs with every tensor that requires grad passed through one
        ``PostBackward``; ``None`` when none does."""
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):  # common
            if not args[0].requires_grad:
                return None
            return (PostBackward.apply(post_backward, args[0])[0],), {}
        leaves, spec = tree_flatten((args, kwargs))
        positions = [
            i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        if not positions:
            return None
        wrapped = PostBackward.apply(post_backward, *(leaves[i] for i in positions))
        for i, tensor in zip(positions, wrapped, strict=True):
            leaves[i] = tensor
        new_args, new_kwargs = tree_unflatten(leaves, spec)
        return tuple(new_args), dict(new_kwargs)


#: torch's (private) name for :class:`PostBackward`: torch's test helper
#: ``patch_register_post_backward_hook_backward`` patches ``backward`` under this name to
#: count the post-backwards that run through autograd.
RegisterPostBackwardFunction = PostBackward
