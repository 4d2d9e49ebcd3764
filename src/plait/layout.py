"""The parallel layout of a run: the mesh dimensions by name, one :class:`Layout`, the
device mesh built from it, and the one set of rules saying which layouts can run.

``plait train`` (which refuses a configuration before any worker starts) and ``plait plan``
(which searches the layouts of N devices) ask the same rules, so a layout the planner
proposes is one that training runs. A rule returns :class:`Reason` s, none when the layout
can run; each names the field at fault and the fix in ``plait train``'s flag words (the
planner's layout flags are the same). The caller decides what a reason means: training
refuses with the first, the search skips the layout.

This module is core: it imports torch, nothing of plait's APIs. What the rules need of a
pipeline schedule comes in as an argument (:class:`ScheduleFacts` by name; the pipeline
package's ``SCHEDULES`` is such a table), and what they need of a model as a
:class:`ModelShape`, which training builds from its GPT and the planner from its specs.

Adding a parallel dimension happens here: its name, its place in :data:`MESH_DIMS`, its
field of :class:`Layout`, and a rule for what it splits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "CP",
    "CP_METHODS",
    "DATA_PARALLEL",
    "DP",
    "DP_REPLICATE",
    "DP_SHARD",
    "DP_SHARD_CP",
    "EFSDP",
    "EP",
    "EXPERT_MESH_DIMS",
    "INTERLEAVED_STAGES_PER_RANK",
    "LAYOUT_FIELDS",
    "MESH_DIMS",
    "PP",
    "TP",
    "Layout",
    "ModelShape",
    "Reason",
    "ScheduleFacts",
    "ScheduleTable",
    "Split",
    "World",
    "check",
    "check_batch",
    "check_cp",
    "check_ep",
    "check_microbatches",
    "check_schedule",
    "check_sizes",
    "check_stages",
    "check_stages_per_rank",
    "check_tp",
    "check_world",
    "cp_shard",
    "default_microbatches",
    "default_stages_per_rank",
    "fewest_microbatches",
    "find_schedule",
    "flag",
    "grids",
    "moe_tp_width",
    "tp_splits",
]

PP = "pp"
DP_REPLICATE = "dp_replicate"
DP_SHARD = "dp_shard"
TP = "tp"
#: Context parallelism: each sequence split over its ranks (``plait.context``), which share
#: their batch; fully_shard shards over ``dp_shard x cp``.
CP = "cp"
#: ``dp_shard`` and ``cp`` as one dimension: what fully_shard shards over with context
#: parallelism (each cp rank's gradients cover its own tokens), torchtitan's name.
DP_SHARD_CP = "dp_shard_cp"
#: How context-parallel attention sees the other ranks' keys and values: all-gathered,
#: passed around a ring, or exchanged all-to-all by heads (Ulysses).
CP_METHODS: tuple[str, ...] = ("allgather", "ring", "alltoall")
#: Expert parallelism: the routed experts of every mixture-of-experts block split over its
#: ranks (``plait.experts``). It takes its ranks from ``dp_shard x cp`` (they hold
#: different tokens, which all-to-all sends to their experts), so it is not a factor of the
#: world.
EP = "ep"
#: The experts' own fully_shard dimension: the ``dp_shard x cp`` ranks holding the same
#: experts (``dp_shard x cp / ep`` of them), torchtitan's name.
EFSDP = "efsdp"
#: The data-parallel dims flattened into one (torch's and torchtitan's name for it).
DP = "dp"

#: The mesh dimensions, outermost first. The innermost communicate most: ``tp``
#: (collectives inside every layer) between neighbouring ranks, which launchers place on
#: one node, then ``cp`` (attention in every layer), then ``dp_shard``.
MESH_DIMS: tuple[str, ...] = (PP, DP_REPLICATE, DP_SHARD, CP, TP)
#: The mesh of the routed experts, outermost first: ``dp_shard x cp`` split into ``(efsdp,
#: ep)``, so the same ranks, in the same order, as :data:`MESH_DIMS`.
EXPERT_MESH_DIMS: tuple[str, ...] = (PP, DP_REPLICATE, EFSDP, EP, TP)
#: The dimensions a global batch is split over.
DATA_PARALLEL: tuple[str, ...] = (DP_REPLICATE, DP_SHARD)
#: Stages per rank of a schedule that interleaves several, unless told otherwise.
INTERLEAVED_STAGES_PER_RANK = 2


def flag(name: str) -> str:
    """The command-line flag of field ``name``: ``dp_shard`` -> ``--dp-shard``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Layout:
    """A composition of plait's parallelisms: the size of each mesh dimension (their
    product is the world size) and the choices that go with them.

    ``schedule``: the pipeline schedule's name; ``stages_per_rank``: pipeline stages each
    ``pp`` rank holds (2 or more for interleaved and V schedules); ``microbatches``: per
    step, through the pipeline or accumulated without one; ``ac``: activation
    checkpointing of each block (``"none"``, ``"full"``, ``"selective"``, ``"offload"``);
    ``sequence_parallel``: with ``tp``, norms and activations split by sequence;
    ``reshard_after_forward``: as ``fully_shard``'s (``True`` frees parameters between
    forward and backward); ``ep``: expert parallelism, ranks taken from ``dp_shard`` (see
    :data:`EP`); ``cp``: context parallelism, each sequence split over its ranks, and
    ``cp_method`` its attention (:data:`CP_METHODS`). Nothing is checked on construction:
    :func:`check` says whether a layout can run.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    cp_method: str = "allgather"
    schedule: str = "1F1B"
    microbatches: int = 1
    ac: str = "none"
    sequence_parallel: bool = True
    reshard_after_forward: bool = True
    stages_per_rank: int = 1

    @property
    def sizes(self) -> dict[str, int]:
        """The size of each mesh dimension, by name, outermost first."""
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def world(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways the global batch is split."""
        return math.prod(getattr(self, name) for name in DATA_PARALLEL)

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all (1 without a pipeline)."""
        return self.pp * self.stages_per_rank

    @property
    def efsdp(self) -> int:
        """The ranks of one ``ep`` rank's experts shard them (``dp_shard x cp / ep``)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def expert_sizes(self) -> dict[str, int]:
        """The size of each dimension of the experts' mesh (:data:`EXPERT_MESH_DIMS`)."""
        return {name: getattr(self, name) for name in EXPERT_MESH_DIMS}

    def with_sizes(self, sizes: Mapping[str, int]) -> Layout:
        """A copy with the mesh dimensions named in ``sizes`` resized."""
        unknown = set(sizes) - set(MESH_DIMS)
        if unknown:
            raise ValueError(f"not mesh dimensions: {sorted(unknown)}; they are {MESH_DIMS}")
        changes: dict[str, Any] = dict(sizes)
        return dataclasses.replace(self, **changes)

    def mesh(self, device_type: str) -> DeviceMesh | None:
        """The device mesh on ``device_type``, dimensions named as in :data:`MESH_DIMS`
        and in its order, keeping only those larger than 1; None for one process.
        Collective: every rank of the default process group calls it."""
        return _mesh(device_type, self.sizes, keep=())

    def shard_mesh(self, device_type: str) -> DeviceMesh | None:
        """With context parallelism, the mesh tensor parallelism and fully_shard use: the
        same ranks as :meth:`mesh`, ``dp_shard`` and ``cp`` as one dimension,
        :data:`DP_SHARD_CP` (kept at any size), so parameters are sharded and gradients
        reduced over both; None without context parallelism (:meth:`mesh` serves).
        Collective, like :meth:`mesh`."""
        if self.cp == 1:
            return None
        sizes = {PP: self.pp, DP_REPLICATE: self.dp_replicate}
        sizes |= {DP_SHARD_CP: self.dp_shard * self.cp, TP: self.tp}
        return _mesh(device_type, sizes, keep=(DP_SHARD_CP,))

    @property
    def splits_routed_rows(self) -> bool:
        """Whether a mixture of experts' tp ranks share its routed rows (each computes one
        chunk: :func:`plait.experts.split_routed_rows`): with tensor parallelism under
        ``fully_shard`` (``dp_shard x cp`` > 1), whose expert group then spans the tp
        ranks and sums their gradients. Otherwise every tp rank computes all of them."""
        return self.tp > 1 and self.dp_shard * self.cp > 1

    def expert_mesh(self, device_type: str, split_rows: bool = False) -> DeviceMesh | None:
        """The routed experts' mesh (:data:`EXPERT_MESH_DIMS`): the same ranks as
        :meth:`mesh`, ``dp_shard x cp`` split into ``(efsdp, ep)``, both kept even at size 1 (the
        experts are sharded over ``ep`` and fully_shard over ``efsdp``); None without
        expert parallelism. ``split_rows`` (a model with experts, and a layout that
        :attr:`splits_routed_rows`): the tp ranks join ``efsdp`` (dims ``(pp,
        dp_replicate, efsdp, ep)``, ``efsdp`` of ``dp_shard x cp x tp / ep`` ranks: the
        experts' fully_shard group spans the ranks that split their rows), made even with
        ``ep`` 1. Collective, like :meth:`mesh`."""
        if not split_rows:
            if self.ep == 1:
                return None
            return _mesh(device_type, self.expert_sizes, keep=(EFSDP, EP))
        grid = torch.arange(self.world).view(self.pp, self.dp_replicate, self.efsdp, self.ep, -1)
        # An efsdp group varies the layout's efsdp and tp coordinates; an ep group keeps tp's.
        sizes = {PP: self.pp, DP_REPLICATE: self.dp_replicate, EFSDP: self.efsdp * self.tp}
        sizes[EP] = self.ep
        kept = [name for name, size in sizes.items() if size > 1 or name in (EFSDP, EP)]
        grid = grid.transpose(3, 4).reshape([sizes[name] for name in kept])
        return DeviceMesh(device_type, grid, mesh_dim_names=tuple(kept))


def expert_shard_dim(shape: tuple[int, ...], group: int) -> int:
    """The dim ``fully_shard`` shards a stacked expert weight ``(experts, in, out)`` on over
    ``group`` ranks in plait train's recipe: the experts' dim when it splits evenly, else
    the first that does (torchtitan's rule: ``Shard(1)`` when there are fewer experts than
    ranks to shard them), else 0. Sharding 2 experts over 8 ranks on dim 0 would pad every
    rank's shard to a whole expert: 4x the memory of the sharded states and of the
    gradients' reduce-scatter."""
    return next((d for d, size in enumerate(shape) if size % group == 0), 0)


def _mesh(device_type: str, sizes: Mapping[str, int], keep: tuple[str, ...]) -> DeviceMesh | None:
    dims = [(name, size) for name, size in sizes.items() if size > 1 or name in keep]
    if not dims:
        return None
    names, shape = zip(*dims, strict=True)
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


#: The fields of :class:`Layout`, in its order.
LAYOUT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Layout))


@dataclass(frozen=True)
class ModelShape:
    """What the rules need of a model and its sequences: the sizes tensor parallelism
    splits and the blocks a pipeline splits.

    ``from_flags``: the model is plait's GPT, shaped by ``plait train``'s model flags
    (``--n-layer``, ``--n-head``, ``--d-model``, ``--experts``), so messages may suggest
    changing them; ``tokens``: what messages call the vocabulary's entries; ``experts``:
    routed experts per mixture-of-experts block (0: a dense model).
    """

    layers: int
    heads: int
    kv_heads: int
    d_model: int
    d_mlp: int
    vocab: int
    seq_len: int
    from_flags: bool = False
    tokens: str = "tokens"
    experts: int = 0


class ScheduleFacts(Protocol):
    """What the rules need of a pipeline schedule (``plait.pipeline.ScheduleSpec`` has it):
    ``stages_per_rank`` is None for a schedule that holds any number per rank."""

    @property
    def name(self) -> str: ...

    @property
    def stages_per_rank(self) -> int | None: ...

    def min_microbatches(self, n_stages: int) -> int: ...


#: The pipeline schedules by name (``plait.pipeline.SCHEDULES``).
ScheduleTable = Mapping[str, ScheduleFacts]


@dataclass(frozen=True)
class World:
    """The ranks a layout must fill exactly, in the words of the command that runs it.

    ``flag``: the option that sets the number (``--nproc``); ``noun``: what the ranks are
    (``"processes"``); ``named``: how a sentence names the world (default: ``the 4
    processes (--nproc 4)``); ``auto``: the dims the command sizes itself when left out.
    """

    size: int
    flag: str
    noun: str
    named: str = ""
    auto: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.named or f"the {self.size} {self.noun} ({self.flag} {self.size})"


@dataclass(frozen=True)
class Reason:
    """Why a layout cannot run: ``field``, the one to change (a :class:`Layout` field, or
    ``"batch"`` or ``"world"``), and ``message``, a sentence naming the fix."""

    field: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Split:
    """A size that tensor parallelism splits: ``what`` it is in words (``the 4 attention
    heads``), its ``size``, and the ``option`` that changes it ("" for none)."""

    what: str
    size: int
    option: str


def check(
    layout: Layout, model: ModelShape, batch: int, world: World, schedules: ScheduleTable
) -> list[Reason]:
    """Every reason ``layout`` cannot run ``model`` on global batches of ``batch``
    sequences over ``world``, with the pipeline ``schedules`` (a table by name); [] when it
    can. In the order ``plait train`` reports them."""
    counts = {**layout.sizes, EP: layout.ep, "stages_per_rank": layout.stages_per_rank}
    reasons = check_sizes({**counts, "microbatches": layout.microbatches})
    if reasons:
        return reasons  # the rules below divide by these
    reasons += check_world(layout.sizes, world)
    reasons += check_cp(model, layout.cp, layout.cp_method, layout.tp)
    if not reasons or layout.cp == 1:  # tp splits each cp rank's share of a sequence
        reasons += check_tp(cp_shard(model, layout.cp), layout.tp, layout.sequence_parallel)
    reasons += check_ep(model, layout.ep, layout.dp_shard * layout.cp)
    spec = find_schedule(schedules, layout.schedule)
    if spec is None:
        reasons += check_schedule(schedules, layout.schedule)
    else:
        reasons += check_stages_per_rank(layout, spec, schedules)
        reasons += check_stages(model, layout)
        reasons += check_microbatches(layout, spec)
    return reasons + check_batch(batch, layout)


def check_sizes(sizes: Mapping[str, int | None]) -> list[Reason]:
    """Sizes and counts by field name must be at least 1 (None: not given)."""
    return [
        Reason(name, f"{flag(name)} {size}: must be at least 1")
        for name, size in sizes.items()
        if size is not None and size < 1
    ]


# The world rule lists the data-parallel dims, then the others outermost first; the
# data-parallel and pipeline dims always, the dims inside layers only where they are used.
_LISTED = DATA_PARALLEL + tuple(d for d in MESH_DIMS if d not in DATA_PARALLEL)
_ALWAYS_LISTED = (*DATA_PARALLEL, PP)


def check_world(sizes: Mapping[str, int | None], world: World) -> list[Reason]:
    """The known mesh sizes (None or absent: to be found) must leave a grid of exactly
    ``world``: their product divides it, and equals it when every size is known. Sizes
    must be at least 1 (:func:`check_sizes`)."""
    known = {d: size for d in _LISTED if (size := sizes.get(d)) is not None}
    product = math.prod(known.values())
    listed = [f"{flag(d)} {s}" for d, s in known.items() if d in _ALWAYS_LISTED or s > 1]
    grid = " x ".join(listed)
    if len(known) < len(MESH_DIMS):
        if world.size % product == 0:
            return []
        total = f" = {product}" if len(listed) > 1 else ""
        message = f"{grid}{total} does not divide {world}: make {world.flag} a multiple of "
        return [Reason("world", f"{message}{product}")]
    if product == world.size:
        return []
    auto = " or ".join(flag(d) for d in world.auto)
    leave = f" (or leave {auto} out: auto)" if auto else ""
    message = (
        f"{grid} = {product} {world.noun}, but {world.size} will run ({world.flag} "
        f"{world.size}): make the product equal the number of {world.noun}{leave}"
    )
    return [Reason("world", message)]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


# The order grids() sizes the dims in: those inside data parallelism first, innermost
# first, then the data-parallel ones, ``dp_shard`` last so that it takes what the others
# leave (``plait train``'s auto ``dp_shard``).
_FILL_ORDER = tuple(reversed([d for d in MESH_DIMS if d not in DATA_PARALLEL])) + DATA_PARALLEL


def grids(sizes: Mapping[str, int | None], world: int) -> Iterator[dict[str, int]]:
    """Every way to size the unknown dims of ``sizes`` (None or absent) so that all of
    :data:`MESH_DIMS` multiply to ``world``, known sizes kept: none when
    :func:`check_world` has a reason, one when a single dim is unknown."""

    def fill(i: int, left: int, grid: dict[str, int]) -> Iterator[dict[str, int]]:
        if i == len(_FILL_ORDER):
            if left == 1:
                yield grid
            return
        dim = _FILL_ORDER[i]
        known = sizes.get(dim)
        last = i == len(_FILL_ORDER) - 1
        options = [known] if known is not None else [left] if last else _divisors(left)
        for size in options:
            if left % size == 0:
                yield from fill(i + 1, left // size, {**grid, dim: size})

    if world >= 1:
        yield from fill(0, world, {})


def moe_tp_width(expert_hidden: int, shared_experts: int, d_model: int) -> int:
    """The feed-forward width tensor parallelism splits in a mixture-of-experts block
    (``ModelShape.d_mlp`` of a MoE model): its shared experts' (the routed experts are
    split by ``ep``, not ``tp``), or without them ``d_model``, already a split."""
    return expert_hidden * shared_experts or d_model


def tp_splits(model: ModelShape, sequence_parallel: bool) -> list[Split]:
    """What tensor parallelism splits ``tp`` ways (its plan: ``plait.train.parallelize``):
    heads, widths and vocabulary, and with sequence parallelism the sequence."""
    gpt = model.from_flags
    mlp = f" ({model.d_mlp // model.d_model} x --d-model)" if gpt else ""
    splits = [
        Split(f"the {model.heads} attention heads", model.heads, "--n-head" if gpt else ""),
        Split(f"the {model.kv_heads} KV heads", model.kv_heads, ""),
        Split(f"the model width {model.d_model}", model.d_model, "--d-model" if gpt else ""),
        Split(f"the MLP width {model.d_mlp}{mlp}", model.d_mlp, "--d-model" if gpt else ""),
    ]
    vocabulary = f"the vocabulary of {model.vocab} {model.tokens} (embedding and head)"
    splits.append(Split(vocabulary, model.vocab, ""))
    if sequence_parallel:
        what = f"each sequence of {model.seq_len} tokens (sequence parallelism)"
        splits.append(Split(what, model.seq_len, "--seq-len"))
    return splits


def check_tp(model: ModelShape, tp: int, sequence_parallel: bool) -> list[Reason]:
    """Everything :func:`tp_splits` names must divide by ``tp``."""
    if tp == 1:
        return []
    splits = tp_splits(model, sequence_parallel)
    # The largest tp up to the given one that splits everything: the fix to suggest.
    fits = max(t for t in range(1, tp + 1) if all(s.size % t == 0 for s in splits))
    reasons = []
    for split in splits:
        if split.size % tp == 0:
            continue
        fixes = [f"use --tp {fits}" if fits > 1 else "drop --tp"]
        if split.option:
            fixes.append(f"set {split.option} to a multiple of {tp}")
        if split.option == "--seq-len":
            fixes.append("turn it off with --no-sequence-parallel")
        problem = f"--tp {tp} splits {split.what} {tp} ways, but {split.size} does not divide"
        reasons.append(Reason(TP, f"{problem} by {tp}: {', or '.join(fixes)}"))
    return reasons


def cp_shard(model: ModelShape, cp: int) -> ModelShape:
    """``model`` as one ``cp`` rank sees it: each sequence ``cp`` times shorter."""
    return dataclasses.replace(model, seq_len=model.seq_len // cp) if cp > 1 else model


def check_cp(model: ModelShape, cp: int, method: str, tp: int = 1) -> list[Reason]:
    """``cp`` splits every sequence into ``2 x cp`` equal chunks (each rank a head and a
    tail chunk, so causal attention costs each the same); ``alltoall`` also splits the
    heads (each tp rank's) ``cp`` ways."""
    if method not in CP_METHODS:
        return [
            Reason(
                "cp_method", f"--cp-method {method}: unknown; choose one of {', '.join(CP_METHODS)}"
            )
        ]
    if cp == 1:
        return []
    reasons = []
    if model.seq_len % (2 * cp):
        fits = [c for c in _divisors(model.seq_len // 2) if c < cp] or [1]
        seq = "--seq-len" if model.from_flags else "the sequence length"
        message = (
            f"--cp {cp} splits each sequence into {2 * cp} chunks (a head and a tail chunk per "
            f"rank, for balanced causal attention), but {seq} {model.seq_len} does not divide "
            f"by {2 * cp}: use a {seq} that is a multiple of {2 * cp}, or --cp {fits[-1]}"
        )
        reasons.append(Reason(CP, message))
    if method == "alltoall":
        for what, heads in (("attention heads", model.heads), ("KV heads", model.kv_heads)):
            if heads % (cp * tp):
                per = f"the {heads} {what}" + (f" over --tp {tp}" if tp > 1 else "")
                message = (
                    f"--cp-method alltoall splits {per} {cp} more ways (--cp {cp}), but "
                    f"{heads} does not divide by {cp * tp}: use --cp-method ring or "
                    f"allgather, or a --cp that divides {heads // math.gcd(heads, tp)}"
                )
                reasons.append(Reason("cp_method", message))
                break
    return reasons


def check_ep(model: ModelShape, ep: int, dp_shard: int) -> list[Reason]:
    """``ep`` must split the model's routed experts into equal whole sets, and take its
    ranks from ``dp_shard`` (times ``cp``: the ranks that hold different tokens): it
    divides both."""
    if ep == 1:
        return []
    if model.experts == 0:
        fix = f"add --experts {2 * ep} (or another multiple of {ep})" if model.from_flags else ""
        message = f"--ep {ep} splits the routed experts, but the model has none"
        return [Reason(EP, f"{message}: {fix or 'drop --ep'}")]
    reasons = []
    if model.experts % ep:
        fits = [d for d in _divisors(model.experts) if d > 1 and dp_shard % d == 0]
        fix = f"use --ep {fits[-1]}" if fits else "drop --ep"
        if model.from_flags:
            fix += f", or --experts a multiple of {ep}"
        message = (
            f"--ep {ep} splits the {model.experts} routed experts {ep} ways, but {ep} does not "
            f"divide {model.experts} (each rank holds the same number of whole experts)"
        )
        reasons.append(Reason(EP, f"{message}: {fix}"))
    if dp_shard % ep:
        message = (
            f"--ep {ep} takes its ranks from --dp-shard (the ranks holding different tokens), "
            f"but --dp-shard {dp_shard} is not a multiple of {ep}: use --dp-shard "
            f"{ep * -(-dp_shard // ep)} (more --nproc), or an --ep that divides {dp_shard}"
        )
        reasons.append(Reason(EP, message))
    return reasons


def find_schedule(schedules: ScheduleTable, name: str) -> ScheduleFacts | None:
    """The schedule ``name`` (case-insensitive), or None."""
    if name in schedules:
        return schedules[name]
    return next((s for key, s in schedules.items() if key.lower() == name.lower()), None)


def check_schedule(schedules: ScheduleTable, name: str) -> list[Reason]:
    """``name`` must be one of ``schedules``."""
    if find_schedule(schedules, name) is not None:
        return []
    message = f"--schedule {name}: Unknown schedule {name!r}; known: {list(schedules)}"
    return [Reason("schedule", message)]


def default_stages_per_rank(spec: ScheduleFacts, pp: int) -> int:
    """Stages per rank when not given: the schedule's own (1 without a pipeline)."""
    if pp == 1:
        return 1
    return spec.stages_per_rank or INTERLEAVED_STAGES_PER_RANK


def check_stages_per_rank(
    layout: Layout, spec: ScheduleFacts, schedules: ScheduleTable
) -> list[Reason]:
    """Several stages per rank need a pipeline and a schedule that interleaves them; a
    schedule of a fixed number runs exactly that."""
    v, field = layout.stages_per_rank, "stages_per_rank"
    if layout.pp == 1:
        if v == 1:
            return []
        return [Reason(field, f"--stages-per-rank {v} needs a pipeline: add --pp 2 or more")]
    if spec.stages_per_rank is not None and v != spec.stages_per_rank:
        *others, last = [s.name for s in schedules.values() if s.stages_per_rank is None]
        message = (
            f"--schedule {spec.name} runs exactly {spec.stages_per_rank} stage(s) per rank, but "
            f"--stages-per-rank is {v}: drop --stages-per-rank, or use a schedule for several "
            f"stages per rank ({', '.join(others)} or {last})"
        )
        return [Reason(field, message)]
    if spec.stages_per_rank is None and v == 1:
        single = " / ".join(s.name for s in schedules.values() if s.stages_per_rank == 1)
        message = (
            f"--schedule {spec.name} interleaves several stages per rank, but "
            f"--stages-per-rank is 1: use --stages-per-rank {INTERLEAVED_STAGES_PER_RANK} (or "
            f"more), or --schedule {single} for one stage per rank"
        )
        return [Reason(field, message)]
    return []


def check_stages(model: ModelShape, layout: Layout) -> list[Reason]:
    """Every pipeline stage needs at least one block."""
    n = layout.n_stages
    if n <= model.layers:
        return []
    blocks = f"--n-layer {model.layers}" if model.from_flags else str(model.layers)
    fix = f"use --n-layer {n} or more, or fewer stages" if model.from_flags else "use fewer stages"
    message = (
        f"--pp {layout.pp} x {layout.stages_per_rank} stage(s) per rank = {n} pipeline "
        f"stages, but the model has only {blocks} blocks (a stage needs at least one): {fix}"
    )
    return [Reason(PP, message)]


def fewest_microbatches(layout: Layout, spec: ScheduleFacts) -> int:
    """The fewest microbatches ``layout``'s pipeline runs (1 without one)."""
    return spec.min_microbatches(layout.n_stages) if layout.pp > 1 else 1


def default_microbatches(layout: Layout) -> int:
    """Microbatches when not given: one per pipeline stage, 1 without a pipeline."""
    return layout.n_stages if layout.pp > 1 else 1


def check_microbatches(layout: Layout, spec: ScheduleFacts) -> list[Reason]:
    """A pipeline runs at least its schedule's fewest microbatches."""
    fewest = fewest_microbatches(layout, spec)
    if layout.microbatches >= fewest:
        return []
    message = (
        f"--schedule {layout.schedule} over {layout.n_stages} pipeline stages needs at "
        f"least {fewest} microbatches, got --microbatches {layout.microbatches}: use "
        f"--microbatches {fewest} or more"
    )
    return [Reason("microbatches", message)]


def check_batch(batch: int, layout: Layout) -> list[Reason]:
    """The global batch splits evenly over the data-parallel ranks, and each rank's share
    over the microbatches."""
    dp, m = layout.dp, layout.microbatches
    if batch % dp:
        ranks = " x ".join(f"{flag(d)} {getattr(layout, d)}" for d in DATA_PARALLEL)
        fix = dp * max(1, round(batch / dp))
        message = (
            f"--batch-size {batch} does not split evenly over {dp} data-parallel ranks "
            f"({ranks}): use a multiple of {dp}, e.g. --batch-size {fix}"
        )
        return [Reason("batch", message)]
    local = batch // dp
    if local % m == 0:
        return []
    message = (
        f"--microbatches {m} does not divide the {local} sequences per data-parallel rank "
        f"(--batch-size {batch} / {dp}): use a --microbatches that divides {local}, or a "
        f"--batch-size that is a multiple of {dp * m}"
    )
    return [Reason("microbatches", message)]
