"""The collectives of expert parallelism, stateless: an autograd-aware uneven all-to-all
and the exchange of per-expert row counts.

c10d's ``all_to_all_single`` is looked up at call time (tests patch it to count calls) and
always given an explicit group. On CPU it runs on gloo's ``alltoall_base``, which takes
uneven split sizes, zero included.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.hooks import traced

__all__ = ["all_to_all", "exchange_counts"]


def _exchange(
    x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup, label: str
) -> torch.Tensor:
    """Send ``send[j]`` consecutive rows of ``x`` to rank ``j`` of ``group``; receive
    ``recv[j]`` rows from rank ``j``, concatenated in rank order."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    with traced(label):
        dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group
        )
    return out


class _AllToAll(torch.autograd.Function):
    """The uneven all-to-all; its backward is the same exchange in reverse."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        send: list[int],
        recv: list[int],
        group: dist.ProcessGroup,
        label: str,
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.label = send, recv, group, label
        return _exchange(x, send, recv, group, label)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Rows came from rank j as ``recv[j]`` and left for rank j as ``send[j]``: their
        # gradients retrace the same paths backwards. Every rank runs this at the same
        # point of its backward (the graphs are alike), so the collectives pair up.
        back = _exchange(grad, ctx.recv, ctx.send, ctx.group, f"{ctx.label}.backward")
        return back, None, None, None, None


def all_to_all(
    x: torch.Tensor,
    send: list[int],
    recv: list[int],
    group: dist.ProcessGroup,
    label: str = "experts.all_to_all",
) -> torch.Tensor:
    """Differentiable uneven all-to-all of the rows of ``x`` ``(sum(send), ...)``; returns
    ``(sum(recv), ...)``. ``send`` / ``recv`` have one entry per rank of ``group`` and must
    agree across ranks (rank i's ``send[j]`` is rank j's ``recv[i]``)."""
    out: torch.Tensor = _AllToAll.apply(x, send, recv, group, label)
    return out


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Each rank's ``counts`` ``(ep * L,)`` cut in ``ep`` chunks of ``L``, chunk ``j`` sent
    to rank ``j``: returns ``(ep, L)``, row ``i`` the chunk rank ``i`` sent here."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    with traced("experts.exchange_counts"):
        dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep, -1)
