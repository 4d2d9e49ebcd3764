"""Cutting a batch into microbatches and gluing outputs back (one process).

Examples first, then properties over random calls (hypothesis): any tensors nested in any
arguments, any split dims, any number of chunks, keyword and non-tensor arguments. A call
either splits (and then merging gives back the input exactly, and no microbatch is empty)
or raises the documented ValueError / TypeError naming the argument at fault, as predicted
by :func:`expected_error`, an independent statement of the rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten

from plait.pipeline import TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks
from plait.pipeline.microbatch import ChunkSpec

# --- examples -------------------------------------------------------------------------------


def test_split_even_uneven_kwargs_and_replicated_values() -> None:
    x = torch.arange(14.0).view(7, 2)
    mask = torch.arange(7)
    args, kwargs = split_args_kwargs_into_chunks((x, "tag"), {"mask": mask, "n": 3}, 3)
    assert [a[0].shape[0] for a in args] == [3, 2, 2]  # tensor_split: larger first
    assert all(a[1] == "tag" for a in args) and all(k["n"] == 3 for k in kwargs)
    assert torch.equal(torch.cat([k["mask"] for k in kwargs]), mask)
    assert torch.equal(merge_chunks([a[0] for a in args]), x)


def test_arguments_of_different_sizes_are_each_cut_on_their_own() -> None:
    """torch's test_split_and_merge: 128, 256 and 512 rows in 2 microbatches (issue 19 #2);
    and a per-microbatch value of 4 rows beside a batch of 256
    (test_zero_bubble_with_model_kwargs)."""
    x0, x1, x2 = torch.randn(128, 3), torch.randn(256, 3), torch.randn(512, 3)
    args, kwargs = split_args_kwargs_into_chunks((x0, x1, x2), {"x0": x0, "x2": x2}, 2)
    assert [t.shape[0] for t in args[0]] == [64, 128, 256]
    assert kwargs[1]["x0"].shape[0] == 64 and kwargs[1]["x2"].shape[0] == 256
    spec3 = (TensorChunkSpec(0),) * 3
    for merged, whole in zip(merge_chunks(args, spec3), (x0, x1, x2), strict=True):
        assert torch.equal(merged, whole)
    merged_kwargs = merge_chunks(kwargs, {"x0": TensorChunkSpec(0), "x2": TensorChunkSpec(0)})
    assert torch.equal(merged_kwargs["x0"], x0) and torch.equal(merged_kwargs["x2"], x2)
    _, kw = split_args_kwargs_into_chunks((torch.randn(256, 3),), {"extra": torch.ones(4, 1)}, 4)
    assert [k["extra"].shape for k in kw] == [torch.Size([1, 1])] * 4


def test_split_by_spec_nested_and_none() -> None:
    x, pair = torch.randn(3, 8), [torch.randn(8), torch.randn(2, 8)]
    args, _ = split_args_kwargs_into_chunks(
        (x, pair, x), None, 4, args_chunk_spec=(TensorChunkSpec(1), TensorChunkSpec(-1), None)
    )
    assert [a[0].shape for a in args] == [torch.Size([3, 2])] * 4
    assert args[1][1][1].shape == (2, 2) and args[3][2] is x
    spec = TensorChunkSpec.from_tuple((1,))[0]
    assert torch.equal(merge_chunks([a[0] for a in args], spec), x)
    assert TensorChunkSpec.from_dict({"m": 0}) == {"m": TensorChunkSpec(0)}


def test_merge_structures_and_non_tensors() -> None:
    outs = [{"y": torch.ones(2, 1) * i, "k": "same"} for i in range(3)]
    merged = merge_chunks(outs)
    assert merged["k"] == "same" and merged["y"].shape == (6, 1)
    with pytest.raises(ValueError, match="microbatch 1"):
        merge_chunks([{"k": 1}, {"k": 2}])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: split_args_kwargs_into_chunks((torch.ones(3, 2),), None, 4), "argument 0 has 3"),
        (
            lambda: split_args_kwargs_into_chunks((), {"ids": torch.ones(2)}, 3),
            "keyword argument 'ids' has 2",
        ),
        (lambda: split_args_kwargs_into_chunks((torch.ones(4),), None, 0), "chunks"),
        (lambda: split_args_kwargs_into_chunks((torch.ones(()),), None, 1), "0-dim"),
    ],
)
def test_split_errors_name_the_argument(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# --- properties -----------------------------------------------------------------------------

DTYPES = [torch.float32, torch.int64, torch.bool, torch.bfloat16]
NAMES = ["ids", "mask", "cache", "scale"]


@dataclass
class Call:
    """One call of split_args_kwargs_into_chunks."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    chunks: Any  # usually an int >= 1; sometimes 0, negative, a bool or a float
    args_spec: tuple[Any, ...] | None  # entries: TensorChunkSpec, None, or a wrong type
    kwargs_spec: dict[str, Any] | None

    def run(self) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
        return split_args_kwargs_into_chunks(
            self.args, self.kwargs, self.chunks, self.args_spec, self.kwargs_spec
        )

    def arguments(self) -> list[tuple[str, Any, Any]]:
        """(name as errors give it, value, spec) of every argument, in splitting order."""
        default = TensorChunkSpec(0)
        named = [
            (
                f"positional argument {i}",
                v,
                default if self.args_spec is None else self.args_spec[i],
            )
            for i, v in enumerate(self.args)
        ]
        spec = self.kwargs_spec or {}
        named += [
            (f"keyword argument {k!r}", v, spec.get(k, default)) for k, v in self.kwargs.items()
        ]
        return named


def expected_error(call: Call) -> tuple[type[Exception], str] | None:
    """The documented rules: which error a call must raise (type, the name it must contain),
    or None if it must split."""
    chunks = call.chunks
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        return ValueError, "chunks"
    if call.args_spec is not None and len(call.args_spec) != len(call.args):
        return ValueError, "args_chunk_spec"
    for name, value, spec in call.arguments():
        if spec is None:
            continue  # passed whole, whatever it is
        if not isinstance(spec, TensorChunkSpec):
            return TypeError, name
        for leaf in tree_flatten(value)[0]:
            if not isinstance(leaf, torch.Tensor):
                continue
            dim = spec.split_dim
            if leaf.dim() == 0 or not -leaf.dim() <= dim < leaf.dim():
                return ValueError, name
            if leaf.shape[dim] < chunks:  # each tensor is cut on its own: only its size counts
                return ValueError, name
    return None


@st.composite
def tensors(draw: st.DrawFn, dim: int | None, batch: int) -> torch.Tensor:
    """Mostly a tensor with ``batch`` rows along ``dim``; sometimes one that breaks a rule
    (0-dim, too few dims, another number of rows)."""
    ndim = draw(st.integers(0, 3)) if dim is None or draw(st.integers(0, 9)) == 0 else None
    if ndim is None:  # compatible with dim
        least = dim + 1 if dim is not None and dim >= 0 else -(dim or 0)
        ndim = draw(st.integers(max(1, least), 3))
    shape = [draw(st.integers(0, 3)) for _ in range(ndim)]
    if dim is not None and -ndim <= dim < ndim:
        shape[dim] = batch if draw(st.integers(0, 9)) else draw(st.integers(0, 8))
    dtype = draw(st.sampled_from(DTYPES))
    t = (torch.arange(max(1, torch.Size(shape).numel())) % 5)[: torch.Size(shape).numel()]
    t = t.view(shape).to(dtype)
    if ndim >= 2 and draw(st.booleans()):  # same shape, not contiguous
        t = t.transpose(0, -1).contiguous().transpose(0, -1)
    return t


def leaves() -> st.SearchStrategy[Any]:
    return st.one_of(st.integers(-3, 3), st.text(max_size=3), st.none(), st.booleans())


@st.composite
def values(draw: st.DrawFn, dim: int | None, batch: int, depth: int = 0) -> Any:
    """A tensor, a non-tensor, or a list / tuple / dict of values, two levels deep at most."""
    kind = draw(
        st.sampled_from(
            ["tensor", "tensor", "leaf", "list", "tuple", "dict"][: 3 + 3 * (depth < 2)]
        )
    )
    if kind == "tensor":
        return draw(tensors(dim, batch))
    if kind == "leaf":
        return draw(leaves())
    items = draw(st.lists(values(dim, batch, depth + 1), max_size=3))
    if kind == "dict":
        return {f"k{i}": v for i, v in enumerate(items)}
    return items if kind == "list" else tuple(items)


@st.composite
def specs(draw: st.DrawFn) -> Any:
    """Mostly a TensorChunkSpec with a dim in range for 1-3 dim tensors; sometimes None, or
    a value of the wrong type."""
    choice = draw(st.integers(0, 19))
    if choice == 0:
        return draw(st.sampled_from([0, "0", (0,)]))  # wrong type
    if choice <= 3:
        return None
    return TensorChunkSpec(draw(st.integers(-3, 2)))


@st.composite
def calls(draw: st.DrawFn) -> Call:
    chunks: Any = draw(st.integers(1, 6))
    batch = chunks + draw(st.integers(0, 4))
    if draw(st.integers(0, 9)) == 0:  # any batch, maybe fewer rows than microbatches
        batch = draw(st.integers(1, 8))
    if draw(st.integers(0, 19)) == 0:
        chunks = draw(st.sampled_from([0, -1, True, 2.0]))
    n_args = draw(st.integers(0, 3))
    explicit = draw(st.booleans())
    arg_specs = [draw(specs()) if explicit else TensorChunkSpec(0) for _ in range(n_args)]
    args = tuple(draw(values(_dim(s), batch)) for s in arg_specs)
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=3))
    kw_specs = {n: draw(specs()) for n in names if draw(st.booleans())}
    kwargs = {n: draw(values(_dim(kw_specs.get(n, TensorChunkSpec(0))), batch)) for n in names}
    args_spec: tuple[Any, ...] | None = tuple(arg_specs) if explicit else None
    if args_spec is not None and draw(st.integers(0, 19)) == 0:  # the wrong length
        args_spec = (*args_spec, None) if draw(st.booleans()) or not args_spec else args_spec[1:]
    return Call(args, kwargs, chunks, args_spec, kw_specs or None)


def _dim(spec: Any) -> int | None:
    return spec.split_dim if isinstance(spec, TensorChunkSpec) else None


@settings(max_examples=300, deadline=None)
@given(calls())
def test_split_then_merge_gives_back_the_input_or_a_named_error(call: Call) -> None:
    expected = expected_error(call)
    event("splits" if expected is None else f"{expected[0].__name__} naming {expected[1][:7]}")
    if expected is not None:
        kind, name = expected
        with pytest.raises(kind) as info:
            call.run()
        assert type(info.value) is kind and name in str(info.value)
        return
    arg_mbs, kwarg_mbs = call.run()
    assert len(arg_mbs) == len(kwarg_mbs) == call.chunks
    assert all(len(mb) == len(call.args) for mb in arg_mbs)
    assert all(list(mb) == list(call.kwargs) for mb in kwarg_mbs)
    for i, (_, value, spec) in enumerate(call.arguments()):
        if i < len(call.args):
            pieces = [mb[i] for mb in arg_mbs]
        else:
            pieces = [mb[list(call.kwargs)[i - len(call.args)]] for mb in kwarg_mbs]
        _check_pieces(value, pieces, spec, call.chunks)


def _check_pieces(value: Any, pieces: list[Any], spec: ChunkSpec, chunks: int) -> None:
    """``pieces`` (one per microbatch) are ``value`` split along ``spec``, losslessly."""
    if spec is None:
        assert all(p is value for p in pieces)  # passed whole, not copied
        return
    leaves0, tree = tree_flatten(value)
    flat = [tree_flatten(p) for p in pieces]
    assert all(t == tree for _, t in flat)
    for j, leaf in enumerate(leaves0):
        parts = [p_leaves[j] for p_leaves, _ in flat]
        if not isinstance(leaf, torch.Tensor):
            assert all(p is leaf for p in parts)
            continue
        sizes = [p.shape[spec.split_dim] for p in parts]
        assert min(sizes) >= 1, sizes  # no empty microbatch
        assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
        merged = torch.cat(parts, dim=spec.split_dim)
        assert merged.dtype == leaf.dtype and torch.equal(merged, leaf)
    merged_value = merge_chunks(pieces, spec)
    merged_leaves, merged_tree = tree_flatten(merged_value)
    assert merged_tree == tree
    for got, want in zip(merged_leaves, leaves0, strict=True):
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8))
def test_uneven_batches_put_the_extra_rows_first(batch: int, chunks: int) -> None:
    x = torch.arange(batch)
    if batch < chunks:
        with pytest.raises(ValueError, match="positional argument 0 has"):
            split_args_kwargs_into_chunks((x,), None, chunks)
        return
    args, _ = split_args_kwargs_into_chunks((x,), None, chunks)
    sizes = [len(a[0]) for a in args]
    assert sizes == [batch // chunks + (i < batch % chunks) for i in range(chunks)]
