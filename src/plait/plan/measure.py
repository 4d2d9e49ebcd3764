"""This machine's figures for the cost model, measured: :func:`measure_cpu`.

The ``cpu`` preset (:mod:`plait.plan.devices`) holds measure-free defaults. This module
measures what the planner's CPU predictions need, the way ``plait train`` runs its workers:
``nproc`` local processes at once, each with the thread count ``plait train`` gives a
worker (the machine's cores divided by the local workers, at least one), joined by gloo.
Every figure is the median over ``repeats`` timings (then over the ranks), so one noisy
timing does not decide it. The rates are timed in CPU seconds (the process's, every thread
counted) and turned into wall-clock rates by the share of the cores a worker gets,
``threads / oversubscription``: other programs running on the machine meanwhile slow the
wall clock, not the CPU seconds a FLOP or a copied byte costs, so the figures of two
measurements taken minutes apart, or beside other work, compare (wall-clock figures moved by
up to 2x between measurements while tests ran beside them). The collectives' latency, which
is waiting rather than work, stays wall time:

* ``flops_fp32`` / ``flops``: achieved FLOP/s of one worker running one block of ``plait
  train``'s GPT forward and backward at the benchmark's shapes (``tokens`` of one
  microbatch, its width, heads and sequence), in fp32 and in bf16, every worker computing
  at the same time (they share the cores). FLOPs are counted as the cost model counts
  them (matrices and attention), so the time of what it does not count separately (norms,
  GELU, residual additions, the kernels' efficiency at these shapes) is in the rate;
* ``intra_node_bw`` (= ``inter_node_bw``): bytes each rank sends per second in gloo's
  all-gather, reduce-scatter and all-reduce of a block's parameters (the ring's share per
  rank, :func:`plait.plan.comm.ring`), the median of the three;
* ``latency``: seconds of a one-element all-reduce;
* ``oversubscription``: workers per core, from the thread count and the cores;
* ``unit_overhead``: ``fully_shard``'s host CPU seconds per unit and microbatch, from a
  tiny model (:func:`_unit_overhead`), times ``oversubscription`` (a worker gets that share
  of a core);
* ``update_rate``: parameter elements per second through the optimizer step as
  ``plait train`` runs it (gradient-norm clipping, then AdamW with its foreach kernels, then
  ``zero_grad``), over tensors shaped like the model's.

The result is a ``measured`` :class:`~plait.plan.spec.DeviceSpec`: achieved rates (the cost
model applies no efficiency to them) and ``overlap=False`` (on a CPU, gloo's threads and the
compute share the same cores, so communication does not hide behind compute).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.plan.devices import device
from plait.plan.models import attention_flops_per_token, gpt, param_counts
from plait.plan.spec import DeviceSpec, ModelSpec
from plait.train.cores import freeze_at_exit, threads_per_worker, usable_cores

__all__ = ["Shapes", "measure_counts", "measure_cpu", "measure_for"]


@dataclass(frozen=True)
class Shapes:
    """What to measure at: one microbatch's ``tokens`` on one rank (fp32; ``bf16_tokens``
    for bf16, default the same), the model's width, heads and sequence, and the parameter
    elements one rank's optimizer updates (``params``; a block's worth of elements per
    collective)."""

    tokens: int = 1024
    d_model: int = 256
    params: int = 3_300_000
    bf16_tokens: int = 0
    heads: int = 4
    seq_len: int = 128


def _median_seconds(
    fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Median time of ``fn`` on ``clock`` (default: wall time) over ``repeats`` runs after
    one warm-up. The ranks start together (one barrier) and then run back to back, so
    every rank's timings are taken while the others work too, as in training; no barrier
    between runs, which would let ranks on shared cores take turns instead."""
    fn()
    dist.barrier()
    times = []
    for _ in range(repeats):
        began = clock()
        fn()
        times.append(clock() - began)
    return statistics.median(times)


def _block_pass(shapes: Shapes, n: int, dtype: torch.dtype) -> tuple[Callable[[], object], float]:
    """Forward and backward of one block of ``plait train``'s GPT (linear layers, attention,
    norms, GELU, residuals) on ``n`` tokens in ``dtype``, and its FLOPs as the cost model
    counts them (:mod:`plait.plan.models`: ``3 x (2 x block matrices + attention)`` per
    token), so that the rate is the one the cost model's FLOPs run at."""
    from plait.train.model import Block, GPTConfig  # the model plait train runs

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=shapes.heads, d_model=shapes.d_model, seq_len=shapes.seq_len)
    block = Block(cfg).to(dtype)
    x = torch.randn(max(1, n // shapes.seq_len), shapes.seq_len, shapes.d_model, dtype=dtype)
    x.requires_grad_()
    g = torch.randn_like(x)
    spec = gpt(1, shapes.heads, shapes.d_model, shapes.seq_len)
    per_token = 2 * param_counts(spec).block_split + attention_flops_per_token(spec, spec.positions)
    flops = 3 * per_token * x.shape[0] * shapes.seq_len

    def run() -> None:
        block(x).backward(g)

    return run, flops


def _param_like(total: int, d: int) -> list[torch.Tensor]:
    """Flat parameters with the sizes of a GPT block's (matrices of ``d`` by ``d`` to
    ``4d``, vectors of ``d`` to ``4d``), cycled until ``total`` elements: the optimizer's
    per-tensor cost and its per-element cost both in proportion."""
    out: list[torch.Tensor] = []
    left = total
    pattern = [3 * d * d, 3 * d, d * d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d, d, d]
    i = 0
    while left > 0:
        size = min(pattern[i % len(pattern)], left)
        out.append(torch.nn.Parameter(torch.randn(size)))
        left -= size
        i += 1
    return out


def _update_seconds(shapes: Shapes, repeats: int) -> float:
    params = _param_like(shapes.params, shapes.d_model)
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad for p in params]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def step() -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g  # zero_grad(set_to_none=True) dropped them: plait's backward refills
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _median_seconds(step, repeats, time.process_time)


def _unit_overhead(world: int, repeats: int) -> float:
    """Host CPU seconds ``fully_shard`` adds per unit and microbatch: the CPU time of one
    training step of a tiny 4-block GPT (width 8: its compute and bytes are nothing) with
    plait's ``fully_shard`` on every block and the root over the workers' group, less the
    same step unsharded, less the CPU time of its collective calls (counted apart, as
    latency: 9 all-gathers and 5 reduce-scatters), over its 5 units. What remains is what
    runs per unit on the host: hooks, DTensor handling of parameters and gradients in the
    optimizer and clipping, copies into and out of the communication buffers. CPU time,
    not wall time: a tiny step only waits for the other ranks, where in training a waiting
    rank's core serves the others."""
    from plait.fsdp import fully_shard
    from plait.fsdp.clip import clip_grad_norm_
    from plait.train.model import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(n_layer=4, n_head=1, d_model=8, seq_len=8)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))

    def step_of(shard: bool) -> Callable[[], object]:
        torch.manual_seed(0)
        model = GPT(cfg)
        if shard:
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

        def step() -> None:
            lm_loss(model(tokens), tokens).backward()
            clip_grad_norm_(list(model.parameters()), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    cpu = time.process_time
    one = torch.zeros(1)
    call = _median_seconds(lambda: dist.all_reduce(one), 5 * repeats, cpu)
    plain = _median_seconds(step_of(False), repeats, cpu)
    sharded = _median_seconds(step_of(True), repeats, cpu)
    units = cfg.n_layer + 1
    return max(0.0, sharded - plain - 14 * call) / units


def _comm_rates(shapes: Shapes, world: int, repeats: int) -> tuple[float, float]:
    """(bytes sent per rank per second, the median of the three collectives; seconds of a
    one-element all-reduce)."""
    block = 12 * shapes.d_model**2 // world * world  # one block's elements, divisible
    shard = torch.randn(block // world)
    full = torch.randn(block)
    gathered = torch.empty(block)
    share = (world - 1) / world
    rates = []
    cpu = time.process_time  # gloo's threads' copies and socket calls (module docstring)
    seconds = _median_seconds(lambda: dist.all_gather_single(gathered, shard), repeats, cpu)
    rates.append(block * 4 * share / seconds)
    seconds = _median_seconds(lambda: dist.reduce_scatter_single(shard, full), repeats, cpu)
    rates.append(block * 4 * share / seconds)
    seconds = _median_seconds(lambda: dist.all_reduce(full), repeats, cpu)
    rates.append(block * 4 * 2 * share / seconds)
    one = torch.zeros(1)
    latency = _median_seconds(lambda: dist.all_reduce(one), 5 * repeats)
    return statistics.median(rates), latency


def _worker(rank: int, world: int, port: int, shapes: Shapes, repeats: int, out: str) -> None:
    freeze_at_exit()  # a spawned interpreter's exit, which the parent waits for
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_worker(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        figures: dict[str, float] = {}
        # bf16 matrix products can be slow on CPUs without bf16 instructions: fewer runs.
        for name, dtype, tokens, runs in (
            ("flops_fp32", torch.float32, shapes.tokens, repeats),
            ("flops", torch.bfloat16, shapes.bf16_tokens or shapes.tokens, min(repeats, 3)),
        ):
            run, flops = _block_pass(shapes, tokens, dtype)
            figures[name] = flops / _median_seconds(run, runs, time.process_time)
        figures["update_rate"] = shapes.params / _update_seconds(shapes, repeats)
        if world > 1:
            figures["bandwidth"], figures["latency"] = _comm_rates(shapes, world, repeats)
            figures["unit_overhead"] = _unit_overhead(world, repeats)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(figures, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_cpu(
    nproc: int = 2,
    shapes: Shapes | None = None,
    repeats: int = 7,
    scratch: str | None = None,
    timeout: float = 300.0,
) -> DeviceSpec:
    """Measure this machine with ``nproc`` local gloo workers (module docstring); the ``cpu``
    preset with the measured figures (its memory kept). Takes seconds to a minute.
    ``scratch``: a path prefix for the workers' result files (default: in ``/tmp``);
    ``timeout``: seconds to wait for the workers (RuntimeError if one fails or hangs)."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    shapes = shapes or Shapes()
    out = scratch or f"/tmp/plait-measure-{os.getpid()}"
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters, like plait's workers
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, nproc, port, shapes, repeats, out))
        for rank in range(nproc)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    failed = [rank for rank, proc in enumerate(procs) if proc.exitcode != 0]
    for proc in procs:
        if proc.is_alive():  # a rank stuck past the deadline: the measurement failed
            proc.kill()
    if failed:
        raise RuntimeError(f"measuring the CPU failed on ranks {failed} (see their errors)")
    ranks = []
    for rank in range(nproc):
        with open(f"{out}.{rank}") as f:
            ranks.append(json.load(f))
        os.remove(f"{out}.{rank}")

    def median(key: str, default: float) -> float:
        values = [r[key] for r in ranks if key in r]
        return statistics.median(values) if values else default

    threads = threads_per_worker(nproc)
    oversubscription = max(1.0, nproc * threads / usable_cores())
    share = threads / oversubscription  # CPU seconds a worker gets per wall second
    preset = device("cpu")
    bandwidth = median("bandwidth", preset.intra_node_bw / share) * share
    return DeviceSpec(
        measured=True,
        name=f"cpu (measured, {nproc} workers x {threads_per_worker(nproc)} threads)",
        memory=preset.memory,
        flops=median("flops", preset.flops / share) * share,
        intra_node_bw=bandwidth,
        inter_node_bw=bandwidth,
        gpus_per_node=max(nproc, 1),
        flops_fp32=median("flops_fp32", preset.flops_fp32 / share) * share,
        latency=median("latency", 0.0),
        update_rate=median("update_rate", 0.0) * share,
        # CPU seconds; with more workers than cores each gets 1 / oversubscription of one
        unit_overhead=median("unit_overhead", 0.0) * oversubscription,
        overlap=False,
        oversubscription=oversubscription,
    )


def measure_for(nproc: int, model: ModelSpec, seq_len: int, global_batch: int) -> DeviceSpec:
    """:func:`measure_cpu` with ``nproc`` workers at ``model``'s shapes: a worker's share
    of the global batch as data parallelism splits it, and of the parameters."""
    shapes = Shapes(
        tokens=seq_len * max(1, global_batch // nproc),
        d_model=model.d_model,
        params=param_counts(model).total(model.layers) // nproc,
        heads=model.heads,
        seq_len=seq_len,
    )
    return measure_cpu(nproc, shapes)


def measure_counts(
    counts: list[int], model: ModelSpec, seq_len: int, global_batch: int, rounds: int = 2
) -> dict[int, DeviceSpec]:
    """:func:`measure_for` at each worker count of ``counts``, interleaved over ``rounds``
    rounds, each figure the median over the rounds: what else runs on the machine meanwhile
    weighs on every count alike, so the figures of two counts compare."""
    taken: dict[int, list[DeviceSpec]] = {n: [] for n in counts}
    for _ in range(rounds):
        for n in counts:
            taken[n].append(measure_for(n, model, seq_len, global_batch))
    out = {}
    for n, specs in taken.items():
        rates = {
            name: statistics.median(getattr(spec, name) for spec in specs)
            for name in ("flops", "flops_fp32", "intra_node_bw", "inter_node_bw", "latency",
                         "update_rate", "unit_overhead")
        }  # fmt: skip
        out[n] = dataclasses.replace(specs[0], **rates)
    return out


if __name__ == "__main__":
    import sys

    print(measure_cpu(int(sys.argv[1]) if len(sys.argv) > 1 else 2))
