"""Long-context benchmark of context parallelism: ``python -m benchmarks.long_context``.

``plait train``'s model and step (:class:`plait.train.loop.Trainable`: the recipe of
``plait train --cp N --cp-method M``, fully_shard over ``dp_shard x cp``, AdamW, gradient
clipping) at several sequence lengths and cp degrees, one row per attention method:

* ``cp 1`` (one rank, no context parallelism: the reference every ratio is taken to);
* ``allgather``, ``ring``, ``alltoall``: plait's methods (:mod:`plait.context`), on
  ``cp`` ranks that share one global batch, each holding a head and a tail chunk of every
  sequence (``dp_shard`` 1, so the world is the cp group);
* ``torch``: torch's ``context_parallel`` (its default all-gather rotation) over the same
  ranks, with plait's ``fully_shard`` over them as a ``dp_shard`` dimension. Only on CUDA:
  on CPU torch's context-parallel SDPA has no kernel to dispatch to
  (``aten._scaled_dot_product_flash_attention_for_cpu`` has no sharding strategy), so the
  mode is skipped with that reason printed.

One launch per (sequence, cp): ``cp`` ranks (gloo on CPU, one thread each; NCCL on CUDA)
build every method's model up front (same seed, same tokens), run ``warmup`` untimed steps,
one step under the memory measure, then ``repeats`` rounds that each visit every method in
an order rotated from round to round and time ``steps`` steps of it. A step's time is its
slowest rank's; the table gives the median over all timed steps.

Memory per rank (the busiest rank's): on CPU :class:`plait.plan.live.LiveTensors`, the
exact bytes of live tensor storages (not the allocator's or the process's), during one
step taken after warmup (the optimizer state already exists). ``peak`` is the largest
count in that step (every method's model and optimizer state are alive, built up front);
``activations`` is the peak less what was alive when the step began (sharded parameters
and optimizer state): the memory the step itself needs. No method builds an attention
mask any more (:mod:`plait.context`), so there is no mask column; reports saved before
(with masks, e.g. ``*_masked_before.json``) render the same, without it. On CUDA the
same two numbers from ``torch.cuda`` counters.

Bytes each rank exchanges with its cp peers per step, counted at
:mod:`plait.context.collectives`' helpers (the only callers of c10d in plait.context),
wrapped while the timed steps run: an all-gather counts the bytes received from peers
(its output less the own share), a reduce-scatter and an all-to-all the bytes sent to
peers, a ring shift the bytes sent. fully_shard's all-gathers and reduce-scatters are
reported apart (c10d's total, as :mod:`benchmarks.comm_bytes` counts it, less the cp
part): with ``dp_shard`` 1 both use the world's group, so the group cannot tell them
apart. torch's context parallelism goes through functional collectives: not counted.
Beside them, the formulas, with ``n`` the local tokens (batch x sequence / cp), ``d`` the
model width (keys and values have ``d`` each: no grouped-query attention), 4 bytes, ``L``
layers:

* allgather: forward ``(cp-1) * 2nd * 4`` all-gathered, backward the same reduce-scattered;
* ring: forward ``(cp-1) * 2nd * 4``; backward the key/value blocks go round again
  (``(cp-1) * 2nd * 4``) and their fp32 gradient accumulators with them (``cp * 2nd * 4``);
* alltoall: ``(3nd + nd) * 4 * (cp-1)/cp`` each way (q, k, v stacked to heads, the output
  back), forward and backward alike;

each times ``L`` per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.comm_bytes import count_comm_bytes
from plait.context import shard_sequence
from plait.train.config import TrainConfig
from plait.train.loop import Trainable, model_config
from plait.train.model import GPT
from plait.train.resolve import resolve
from plait.train.step_batch import StepBatch

METHODS = ("allgather", "ring", "alltoall", "torch")
MiB = 2**20


@dataclass(frozen=True)
class LongConfig:
    seq_len: int = 1024
    cp: int = 1
    methods: tuple[str, ...] = ("allgather", "ring", "alltoall")
    batch: int = 1  # global: sequences per step, shared by the cp ranks
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    repeats: int = 3
    steps: int = 1
    warmup: int = 1
    device: str = "cpu"


class Skip(Exception):
    """A method that cannot run here; the message says why."""


Step = Callable[[], None]


def _train_config(cfg: LongConfig, cp: int, dp_shard: int, method: str) -> TrainConfig:
    plain = TrainConfig(
        nproc=cp * dp_shard,
        device=cfg.device,
        dp_shard=dp_shard,
        cp=cp,
        cp_method=method,
        seq_len=cfg.seq_len,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        d_model=cfg.d_model,
        batch_size=cfg.batch,
    )
    return resolve(plain, world_size=cp * dp_shard)


def _tokens(cfg: LongConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (inputs, next-token targets): the same on every rank."""
    gen = torch.Generator().manual_seed(1000)
    tokens = torch.randint(0, 256, (cfg.batch, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1].to(cfg.device), tokens[:, 1:].to(cfg.device)


def _optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's moments made now, as the first update would make them, by an update with
    zero gradients and learning rate 0 (weight decay scales with it: nothing moves), so
    that the measured step is a steady-state one."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)


def _trainable(train: TrainConfig) -> Trainable:
    torch.manual_seed(0)
    model = GPT(model_config(train)).to(train.device)
    parts = Trainable(model, train, train.layout.mesh(train.device))
    _optimizer_state(parts.optimizer)
    return parts


def build_plait(cfg: LongConfig, method: str) -> Step:
    """``plait train``'s step with ``--cp cfg.cp --cp-method method`` (cp 1: no cp)."""
    train = _train_config(cfg, cfg.cp, 1, method if cfg.cp > 1 else "allgather")
    parts = _trainable(train)
    x, y = _tokens(cfg)
    if cfg.cp > 1:  # this rank's head and tail chunks of every sequence, as loop.batch
        # dp_shard 1: the cp ranks are the world (the recipe's mesh["cp"] has its group)
        x, y = (shard_sequence(t, dist.group.WORLD, dim=1) for t in (x, y))

    batch = _step_batch(cfg, x, y)

    def step() -> None:
        parts.stepper.train(batch)
        parts.update()

    return step


def _step_batch(cfg: LongConfig, x: torch.Tensor, y: torch.Tensor) -> StepBatch:
    """The steppers' batch of this rank's rows: one document per row, the loss over every
    token of the global batch."""
    tokens = torch.full((), cfg.batch * cfg.seq_len, device=cfg.device)
    return StepBatch(x, y, None, None, tokens)


def build_torch(cfg: LongConfig) -> Step:
    """torch's ``context_parallel`` around the same model's forward and backward, with
    plait's fully_shard over the cp ranks (as ``dp_shard``: the same parameter sharding
    and gradient averaging as the plait rows). CUDA only (see the module doc)."""
    if not cfg.device.startswith("cuda"):
        raise Skip(
            "torch's context_parallel does not run on CPU: its SDPA dispatch has no "
            "sharding strategy for aten._scaled_dot_product_flash_attention_for_cpu "
            "(NotImplementedError, torch " + torch.__version__ + "); run with --device cuda"
        )
    from torch.distributed.tensor.experimental import context_parallel

    train = _train_config(cfg, 1, cfg.cp, "allgather")
    parts = _trainable(train)
    module = parts.modules[0]
    mesh = init_device_mesh(cfg.device, (cfg.cp,), mesh_dim_names=("cp",))
    x_all, y_all = _tokens(cfg)
    positions = torch.arange(cfg.seq_len, device=cfg.device)

    def step() -> None:
        x, y, pos = x_all.clone(), y_all.clone(), positions.clone()  # sharded in place
        with context_parallel(
            mesh["cp"], buffers=[x, y, pos], buffer_seq_dims=[1, 1, 0], no_restore_buffers={x, y}
        ):
            module.positions = pos
            parts.stepper.train(_step_batch(cfg, x, y))
        parts.update()

    return step


def build(cfg: LongConfig, method: str) -> Step:
    return build_torch(cfg) if method == "torch" else build_plait(cfg, method)


# -- counting ----------------------------------------------------------------------------


@contextlib.contextmanager
def count_cp_bytes() -> Iterator[dict[str, float]]:
    """Yield byte counters filled while the block runs: ``ag`` / ``rs`` / ``a2a`` / ``p2p``,
    what context parallelism's collectives move (see the module doc for what each counts),
    and ``other``: every other byte all-gathered or reduce-scattered (fully_shard's).

    fully_shard and context parallelism share one process group when ``dp_shard`` is 1 (a
    1-D mesh over the world is the world's group), so the group cannot tell them apart:
    the cp bytes are counted at :mod:`plait.context.collectives`' helpers, which are the
    only callers of c10d in :mod:`plait.context` (looked up at call time, as the c10d
    functions are by ``benchmarks.comm_bytes``), and ``other`` is c10d's total less them.
    """
    from plait.context import collectives, ring

    totals = {"ag": 0.0, "rs": 0.0, "a2a": 0.0, "p2p": 0.0}
    raw = [0.0]  # the cp all-gathers' outputs and reduce-scatters' inputs, as c10d counts

    def peers(group: dist.ProcessGroup) -> float:
        size = dist.get_world_size(group)
        return (size - 1) / size

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    gather, scatter = collectives._gather, collectives._reduce_scatter
    exchange, shift = collectives._exchange, ring.ring_shift

    def counted_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        totals["ag"] += nbytes(x) * (dist.get_world_size(group) - 1)  # from each peer
        raw[0] += nbytes(x) * dist.get_world_size(group)
        return gather(x, dim, group)

    def counted_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        totals["rs"] += nbytes(x) * peers(group)  # the peers' slices of the sum
        raw[0] += nbytes(x)
        return scatter(x, dim, group)

    def counted_exchange(x: torch.Tensor, group: dist.ProcessGroup, label: str) -> torch.Tensor:
        totals["a2a"] += nbytes(x) * peers(group)  # every block but this rank's own
        return exchange(x, group, label)

    def counted_shift(x: torch.Tensor, group: dist.ProcessGroup, label: str, tag: int = 0) -> Any:
        totals["p2p"] += nbytes(x)  # to the next rank
        return shift(x, group, label, tag)

    patches = [
        (collectives, "_gather", counted_gather),
        (collectives, "_reduce_scatter", counted_scatter),
        (collectives, "_exchange", counted_exchange),
        (ring, "ring_shift", counted_shift),
    ]
    for owner, name, wrapper in patches:
        assert hasattr(owner, name), f"plait.context changed: {owner.__name__}.{name} is gone"
        setattr(owner, name, wrapper)
    try:
        with count_comm_bytes() as c10d:
            yield totals
            totals["other"] = c10d["all_gather"] + c10d["reduce_scatter"] - raw[0]
    finally:
        originals = {"_gather": gather, "_reduce_scatter": scatter, "_exchange": exchange}
        for name, original in originals.items():
            setattr(collectives, name, original)
        ring.ring_shift = shift


def formula_bytes(cfg: LongConfig, method: str) -> float:
    """Bytes one rank sends its cp peers per step, by the module doc's formulas."""
    cp = cfg.cp
    if cp == 1:
        return 0.0
    n, d, word = cfg.batch * cfg.seq_len // cp, cfg.d_model, 4
    kv = 2 * n * d * word  # one rank's keys and values
    per_layer = {
        "allgather": 2 * (cp - 1) * kv,
        "torch": 2 * (cp - 1) * kv,
        "ring": (cp - 1) * kv + (cp - 1) * kv + cp * kv,
        "alltoall": 2 * 4 * n * d * word * (cp - 1) / cp,
    }[method]
    return per_layer * cfg.n_layer


# -- measuring ---------------------------------------------------------------------------


def _memory(cfg: LongConfig, step: Step) -> tuple[float, float]:
    """(peak, peak less what was alive at the start) bytes of one step on this rank."""
    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return float(peak), float(peak - start)
    import gc
    import warnings

    from plait.plan.live import LiveTensors

    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated names
        warnings.simplefilter("ignore", FutureWarning)
        alive = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
    with LiveTensors(device_type="cpu") as live:
        live.watch(alive)  # the parameters and optimizer state, made before the mode
        del alive
        start = live.current
        live.reset_peak()
        step()
    return float(live.peak), float(live.peak - start)


def _sync(cfg: LongConfig) -> None:
    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize()


def _rank_main(rank: int, cfg: LongConfig, store: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cuda = cfg.device.startswith("cuda")
    if cuda:  # "cuda" then means this rank's GPU (plait train's config takes "cuda" only)
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=cfg.cp,
        timeout=timedelta(minutes=20),
    )
    try:
        result = _run(cfg)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(cfg: LongConfig) -> dict[str, Any]:
    steps: dict[str, Step] = {}
    skipped: dict[str, str] = {}
    for method in cfg.methods:
        try:
            steps[method] = build(cfg, method)
        except Skip as why:
            skipped[method] = str(why)
    names = list(steps)
    for name in names:
        dist.barrier()
        for _ in range(cfg.warmup):
            steps[name]()
    memory = torch.zeros(len(names), 2, dtype=torch.float64)
    for i, name in enumerate(names):
        dist.barrier()
        memory[i] = torch.tensor(_memory(cfg, steps[name]), dtype=torch.float64)
    times: dict[str, list[float]] = {name: [] for name in names}
    comm = torch.zeros(len(names), 5, dtype=torch.float64)
    for round_ in range(cfg.repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            local = torch.zeros(cfg.steps, dtype=torch.float64)
            with count_cp_bytes() as sent:
                for s in range(cfg.steps):
                    _sync(cfg)
                    start = time.perf_counter()
                    steps[name]()
                    _sync(cfg)
                    local[s] = time.perf_counter() - start
            comm[names.index(name)] += torch.tensor(list(sent.values()), dtype=torch.float64)
            maxed = local.to(cfg.device)
            dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
            times[name] += maxed.cpu().tolist()
    memory_max = memory.to(cfg.device)
    dist.all_reduce(memory_max, op=dist.ReduceOp.MAX)  # the busiest rank
    comm_max = comm.to(cfg.device)
    dist.all_reduce(comm_max, op=dist.ReduceOp.MAX)
    comm_max = comm_max.cpu() / (cfg.repeats * cfg.steps)
    rows = []
    for i, name in enumerate(names):
        median = statistics.median(times[name])
        tokens = cfg.batch * cfg.seq_len
        ag, rs, a2a, p2p, other = comm_max[i].tolist()
        rows.append(
            {
                "seq_len": cfg.seq_len,
                "cp": cfg.cp,
                "method": name if cfg.cp > 1 else "-",
                "ranks": cfg.cp,
                "median_s": median,
                "min_s": min(times[name]),
                "max_s": max(times[name]),
                "tokens_per_s": tokens / median,
                "tokens_per_s_per_rank": tokens / median / cfg.cp,
                "peak_mib": float(memory_max[i, 0]) / MiB,
                "activation_mib": float(memory_max[i, 1]) / MiB,
                "cp_sent_mib": {"ag": ag / MiB, "rs": rs / MiB, "a2a": a2a / MiB, "p2p": p2p / MiB},
                "cp_sent_total_mib": (ag + rs + a2a + p2p) / MiB,
                "formula_mib": formula_bytes(cfg, name) / MiB,
                "fsdp_mib": other / MiB,
                "step_times_s": times[name],
            }
        )
    return {"config": asdict(cfg), "rows": rows, "skipped": skipped}


def launch(cfg: LongConfig) -> dict[str, Any]:
    """Run ``cfg``'s methods on ``cfg.cp`` fresh ranks; return rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="plait-long-") as tmp:
        out = os.path.join(tmp, "result.json")
        store = os.path.join(tmp, "store")
        mp.spawn(_rank_main, args=(cfg, store, out), nprocs=cfg.cp, join=True)
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
    return result


# -- the grid and its table ----------------------------------------------------------------


def _parse_only(items: list[str]) -> dict[int, tuple[str, ...]]:
    """``["16384=allgather,alltoall"]`` -> ``{16384: ("allgather", "alltoall")}``."""
    only = {}
    for item in items:
        seq, _, names = item.partition("=")
        only[int(seq)] = tuple(n for n in names.split(",") if n)
    return only


def _ratio(value: float, base: float | None) -> str:
    return "—" if not base else f"{value / base:.2f}"


def markdown(rows: list[dict[str, Any]], notes: list[str]) -> str:
    """One table: a row per (sequence, cp, method), ratios to the cp 1 row of its length."""
    base = {r["seq_len"]: r for r in rows if r["cp"] == 1}
    lines = [
        "| seq | cp | method | median step (s) | min-max (s) | tokens/s | tokens/s/rank | "
        "peak MiB/rank | step act. MiB/rank | act. vs cp 1 | 1/cp | "
        "cp MiB sent/rank/step (AG+RS / A2A / P2P) | formula MiB | FSDP MiB |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
        "---: | ---: | ---: |",
    ]
    for r in rows:
        ref = base.get(r["seq_len"])
        ref_act = ref["activation_mib"] if ref else None
        sent = r["cp_sent_mib"]
        counted = r["method"] != "torch"  # torch's go through functional collectives
        parts = f"{sent['ag'] + sent['rs']:.1f} / {sent['a2a']:.1f} / {sent['p2p']:.1f}"
        cells = [
            str(r["seq_len"]),
            str(r["cp"]),
            r["method"],
            f"{r['median_s']:.2f}",
            f"{r['min_s']:.2f}-{r['max_s']:.2f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['tokens_per_s_per_rank']:.0f}",
            f"{r['peak_mib']:.1f}",
            f"{r['activation_mib']:.1f}",
            _ratio(r["activation_mib"], ref_act),
            f"{1 / r['cp']:.2f}",
            (f"{r['cp_sent_total_mib']:.1f} ({parts})" if counted else "not counted"),
            f"{r['formula_mib']:.1f}",
            f"{r['fsdp_mib']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def render(paths: list[Path], n_layer: int) -> str:
    """The table of the reports at ``paths`` together (e.g. runs of different lengths);
    ``n_layer``: the depth of reports that do not say theirs."""
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    skipped: dict[str, list[str]] = {}
    layers = set()
    for path in paths:
        report = json.loads(path.read_text())
        rows += report["rows"]
        layers.add(report.get("n_layer", n_layer))
        for why, where in report["skipped"].items():
            skipped.setdefault(why, []).extend(where)
        notes += [f"(launch retried once: {line})" for line in report["retried"]]
    assert len(layers) == 1, f"reports of different depths: {sorted(layers)}"
    notes = [f"skipped {why} (at {', '.join(where)})" for why, where in skipped.items()] + notes
    rows.sort(key=lambda r: (r["seq_len"], r["cp"]))  # stable: methods keep their order
    return markdown(rows, notes)


def main() -> None:
    default = LongConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="1024,4096,16384", help="sequence lengths")
    parser.add_argument("--cps", default="1,2,4", help="cp degrees (ranks per launch)")
    parser.add_argument("--methods", default="allgather,ring,alltoall,torch")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="SEQ=M1,M2",
        help="at sequence SEQ run only these methods (repeatable); e.g. 16384=allgather",
    )
    parser.add_argument("--batch", type=int, default=default.batch, help="global sequences")
    parser.add_argument("--layers", type=int, default=default.n_layer)
    parser.add_argument("--heads", type=int, default=default.n_head)
    parser.add_argument("--d-model", type=int, default=default.d_model)
    parser.add_argument("--repeats", type=int, default=default.repeats)
    parser.add_argument("--steps", type=int, default=default.steps, help="timed per repeat")
    parser.add_argument("--warmup", type=int, default=default.warmup)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--out", type=Path, default=Path("bench-results/long_context.json"))
    parser.add_argument(
        "--render", type=Path, nargs="+", help="print the table of saved reports; run nothing"
    )
    args = parser.parse_args()
    if args.render:
        print(render(args.render, args.layers))
        return

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    methods = tuple(m for m in args.methods.split(",") if m)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    only = _parse_only(args.only)
    rows: list[dict[str, Any]] = []
    skipped: dict[str, list[str]] = {}  # reason -> where
    retried: list[str] = []
    for seq in (int(s) for s in args.seqs.split(",")):
        for cp in (int(c) for c in args.cps.split(",")):
            chosen = methods if cp > 1 else ("cp1",)
            if cp > 1 and seq in only:
                chosen = tuple(m for m in chosen if m in only[seq])
            if not chosen:
                continue
            cfg = LongConfig(
                seq_len=seq,
                cp=cp,
                methods=chosen,
                batch=args.batch,
                n_layer=args.layers,
                n_head=args.heads,
                d_model=args.d_model,
                repeats=args.repeats,
                steps=args.steps,
                warmup=args.warmup,
                device=device,
            )
            start = time.perf_counter()
            try:
                result = launch(cfg)
            except mp.ProcessExitedException as failure:  # gloo's rare abort: once more
                print(f"long_context: seq {seq} cp {cp} failed ({failure}); retrying", flush=True)
                retried.append(f"seq {seq} cp {cp}: {failure}")
                result = launch(cfg)
            rows += result["rows"]
            for method, why in result["skipped"].items():
                print(f"long_context: skipped {method} at seq {seq}, cp {cp}: {why}", flush=True)
                skipped.setdefault(f"{method}: {why}", []).append(f"seq {seq} cp {cp}")
            took = time.perf_counter() - start
            print(f"long_context: seq {seq} cp {cp} {','.join(chosen)}: {took:.0f}s", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            report = {"rows": rows, "skipped": skipped, "retried": retried, "n_layer": args.layers}
            args.out.write_text(json.dumps(report, indent=1))
    notes = [f"skipped {why} (at {', '.join(where)})" for why, where in skipped.items()]
    notes += [f"(launch retried once: {line})" for line in retried]
    print(markdown(rows, notes))
    print(
        f"\n{device}, {args.repeats} repeats x {args.steps} steps per method, batch {args.batch}, "
        f"{args.layers} layers, d_model {args.d_model}, {args.heads} heads; full report: {args.out}"
    )


if __name__ == "__main__":
    main()
