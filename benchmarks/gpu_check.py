"""One GPU check, ready before a GPU is lent: ``python -m benchmarks.gpu_check``.

plait is developed on CPUs; a GPU comes only now and then, for minutes. This command does,
in one go (about 7.5 minutes on one H100 with the defaults: ``--budget`` 450 s), what one
GPU can tell, each part in its own process with its own time limit, so that a part that
fails, hangs or kills its process (a CUDA error poisons the process's context) still
leaves the others to run and report:

1. ``tests``: the test suite's CUDA-only tests (:data:`CUDA_TESTS`, listed by node id; a
   listed id that no longer exists fails the part), run by pytest in a subprocess.
2. ``fsdp-eager``, ``fsdp-compile``: ``plait train``'s model (``--model``, a Llama preset
   or config.json) through a timing loop of its own, sharded per block then at the root by
   plait's ``fully_shard`` and by torch's ``torch.distributed.fsdp.fully_shard`` on a
   1-rank process group, both with ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``, the
   same AdamW and the same random token batches; eager, and with every block's forward
   compiled (:func:`plait.train.compiled.compile_blocks`, before ``fully_shard``, as
   ``plait train --compile`` does). Both variants are built, warmed up (compiled) and
   their peak memory measured one after the other; then ``--repeats`` rounds time
   ``--steps`` steps of each, the order rotated from round to round; medians.
3. ``train-eager``, ``train-compile``: the real ``plait train`` path
   (:func:`plait.train.loop.train`, one process: no ``fully_shard``, bf16 under autocast)
   with and without ``--compile``; tokens/s and MFU are the medians of ``metrics.jsonl``
   after the first two steps.
4. ``moe`` (last, if the budget leaves time): ``plait train --experts 4 --top-k 2`` on the
   GPT, then the same model under plait's and torch's ``fully_shard`` in the timing loop,
   eager, with the calls of ``torch._grouped_mm`` per step counted (``plait train`` runs
   them under autocast, casting the experts' weights itself; ``fully_shard`` on its bf16
   parameters).

5. ``kernels`` (run after ``fsdp-eager``: half a minute): the planner's roofline against
   this GPU, kernel by kernel (GEMMs, flash attention, one rank's ring attention under
   context parallelism 1 to 8, a streaming copy), each beside the seconds ``plait plan``
   gives it on the matching preset (:mod:`benchmarks.gpu_kernels`).

Context parallelism, pipelines, expert parallelism and multi-rank ``fully_shard`` need two
or more GPUs: not run here, and the report says so.

The report is a Markdown section (date, GPU, torch version, then the tests' outcome and one
table row per variant: tokens/s, MFU, peak GiB, ratio to torch's ``fully_shard`` in the
same mode) printed at the end and, with ``--out``, rewritten after every part, so a run
cut short still leaves what it measured. ``--log`` collects the parts' own output.

On a machine without CUDA, ``--device cpu`` runs the same parts that can run there (the
tests part only checks that the listed ids still exist), e.g.::

    .venv/bin/python -m benchmarks.gpu_check --device cpu --model tiny-llama --seq-len 64 \\
        --batch 4 --steps 3 --repeats 1 --train-steps 3 --backend aot_eager

On the GPU machine (plait not installed there; ``src`` is put on the path)::

    python3 -m benchmarks.gpu_check --out $OUT/gpu_check.md --log $OUT/gpu_check.log
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import gpu_kernels

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30

#: The tests that skip without CUDA, by pytest node id. ``grep -rn cuda tests/*.py`` finds
#: them (``skipif(not torch.cuda.is_available())`` and the ``"cuda"`` parameters).
CUDA_TESTS = (
    "tests/test_checkpoint.py::test_tensor_only_gpu",
    "tests/test_checkpoint.py::test_random_ops_replay_the_forward_rng[cuda]",
    "tests/test_checkpoint.py::test_offload_moves_activations_to_pinned_host_memory",
    "tests/test_checkpoint.py::test_offload_under_tensor_parallelism_on_cuda",
    "tests/test_replicate.py::test_device_id_moves_tensor_inputs_to_the_device",
    "tests/test_train_hf.py::test_loads_into_cuda_parameters",
    "tests/test_fsdp_features.py::test_cpu_offload_on_cuda_equals_no_offload",
    "tests/test_fsdp_features.py::test_offloaded_units_built_on_the_cpu_run_on_cuda_with_their_buffers",
    "tests/test_experts_grouped.py::test_fused_cuda_kernel_matches_the_loop",
    "tests/test_packing_varlen.py::test_flash_varlen_on_cuda_matches_the_dense_mask",
    "tests/test_train_async_checkpoint.py::test_stager_page_locks_its_arena_on_cuda",
)

#: The parts in the order they run (most wanted first: a short budget drops the tail), and
#: the most seconds each may take (the budget left may cut it shorter).
PART_LIMITS = {
    "tests": 180,
    "fsdp-eager": 150,
    "kernels": 90,
    "train-eager": 150,
    "fsdp-compile": 240,
    "train-compile": 210,
    "moe": 150,
}
#: A part is not started with less than this left of the budget.
MIN_PART_S = 30
#: Steps of a ``plait train`` run left out of its medians (compilation, allocator warm-up).
TRAIN_SKIP = 2
#: The MoE model (the GPT with experts) by device, when --moe-d-model / --moe-layers are 0.
MOE_SIZES = {"cuda": (1024, 8), "cpu": (64, 2)}
NOT_RUN = (
    "Not run (they need two or more GPUs): context parallelism (`plait.context`), "
    "pipelines, expert parallelism (ep > 1), tensor parallelism and multi-rank `fully_shard`."
)


@dataclass(frozen=True)
class CheckConfig:
    """What every part needs; passed to the part processes as JSON."""

    device: str
    model: str = "llama3.2-1b"
    seq_len: int = 2048
    batch: int = 4
    steps: int = 4  # timed steps per variant per repeat
    repeats: int = 5
    warmup: int = 2
    train_steps: int = 12
    mp: str = "bf16"
    backend: str = "inductor"
    moe_d_model: int = 0  # 0: MOE_SIZES by device
    moe_layers: int = 0
    budget: float = 450.0  # seconds for all parts


@dataclass
class PartResult:
    """A part's rows and notes, saved to ``path`` after every change (a part that dies
    still leaves what it measured)."""

    path: Path | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tests: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    skipped: str = ""  # why the part did not run at all

    def row(self, **values: Any) -> dict[str, Any]:
        row: dict[str, Any] = {"error": "", "note": "", **values}
        self.rows.append(row)
        self.save()
        return row

    def save(self) -> None:
        if self.path is not None:
            data = {k: v for k, v in asdict(self).items() if k != "path"}
            # Whole or not at all: the process may be killed at any moment.
            partial = self.path.with_suffix(".partial")
            partial.write_text(json.dumps(data, indent=1))
            os.replace(partial, self.path)

    @staticmethod
    def load(path: Path) -> PartResult:
        result = PartResult()
        if path.is_file():
            for key, value in json.loads(path.read_text()).items():
                setattr(result, key, value)
        return result


def _short(err: BaseException) -> str:
    """An exception's first line, short enough for a table cell."""
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first}"[:160].replace("|", "/")


# -- part 1: the CUDA-only tests --------------------------------------------------------------


def missing_test_ids() -> list[str]:
    """The ids of :data:`CUDA_TESTS` whose file or test function is gone."""
    missing = []
    for node in CUDA_TESTS:
        path, _, name = node.partition("::")
        func = name.split("[")[0]
        file = REPO / path
        if not file.is_file() or not re.search(rf"^def {func}\(", file.read_text(), re.M):
            missing.append(node)
    return missing


def run_tests(cfg: CheckConfig, timeout: float, log: Path | None) -> PartResult:
    result = PartResult()
    missing = missing_test_ids()
    if missing:
        result.error = (
            f"listed CUDA test ids no longer exist: {', '.join(missing)}; "
            "update CUDA_TESTS in benchmarks/gpu_check.py"
        )
        return result
    if cfg.device != "cuda":
        result.tests = {"skipped": f"no CUDA device here: the {len(CUDA_TESTS)} tests not run"}
        return result
    with tempfile.TemporaryDirectory(prefix="plait-gpu-tests-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        cmd += ["--junitxml", str(xml), *CUDA_TESTS]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd += ["--timeout", "120"]
        code, output = _run(cmd, timeout, log)
        outcomes = _junit_outcomes(xml) if xml.is_file() else {}
    result.tests = {"outcomes": outcomes, "exit_code": code}
    if code != 0 or len(outcomes) < len(CUDA_TESTS):
        # 1: a test failed; 4: an id pytest cannot find; None: our time limit.
        what = "timed out" if code is None else f"pytest exit code {code}"
        result.error = f"{what}; last output:\n" + "\n".join(output.splitlines()[-15:])
    return result


def _junit_outcomes(xml: Path) -> dict[str, str]:
    """``{"file.py::test": "passed" | "failed: message" | "skipped: reason"}``."""
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}.py::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = "skipped" if child.tag == "skipped" else "failed"
                outcome = f"{kind}: {(child.get('message') or '').splitlines()[0][:200]}"
        outcomes[name] = outcome
    return outcomes


# -- the training configurations ---------------------------------------------------------------


def moe_size(cfg: CheckConfig) -> tuple[int, int]:
    d_model, layers = MOE_SIZES["cuda" if cfg.device == "cuda" else "cpu"]
    return cfg.moe_d_model or d_model, cfg.moe_layers or layers


def train_config(cfg: CheckConfig, kind: str, **changes: Any) -> Any:
    """``plait train``'s resolved configuration for ``kind`` ("llama": ``--model``; "moe":
    the GPT with 4 experts, top-2), one process, evaluation and checkpoint only at the end."""
    from plait.train.config import TrainConfig
    from plait.train.resolve import resolve

    if kind == "llama":
        model: dict[str, Any] = {"model_config": cfg.model}
    else:
        d_model, layers = moe_size(cfg)
        model = {"experts": 4, "top_k": 2, "d_model": d_model, "n_layer": layers}
        model["n_head"] = max(1, d_model // 64)
    base = TrainConfig(
        seq_len=cfg.seq_len,
        batch_size=cfg.batch,
        steps=cfg.train_steps,
        lr=3e-4,  # plait train's 3e-3 suits its small GPT, not a 1B Llama
        warmup=1,
        mp=cfg.mp,
        device=cfg.device,
        nproc=1,
        eval_every=0,
        eval_batches=1,
        ckpt_every=0,
    )
    return resolve(base.replace(**model, **changes))


def _model_label(cfg: CheckConfig, kind: str) -> str:
    if kind == "llama":
        return Path(cfg.model).parent.name if cfg.model.endswith(".json") else cfg.model
    d_model, layers = moe_size(cfg)
    return f"GPT MoE 4x top-2 (d {d_model}, {layers} layers)"


@contextlib.contextmanager
def count_grouped_mm() -> Iterator[dict[str, int]]:
    """Count the calls of ``torch._grouped_mm`` (looked up at call time by plait's experts;
    the routed experts run eagerly even under ``--compile``)."""
    import torch

    calls = {"n": 0}
    original = getattr(torch, "_grouped_mm", None)
    if original is None:
        yield calls
        return

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return original(*args, **kwargs)

    torch._grouped_mm = counted
    try:
        yield calls
    finally:
        torch._grouped_mm = original


# -- parts 2 and 4: plait's fully_shard beside torch's, one rank --------------------------------


class Variant:
    """``plait train``'s model sharded by one implementation's ``fully_shard`` (per block,
    then the root), its AdamW, and a training step on the shared batches."""

    def __init__(self, impl: str, tcfg: Any, compiled: bool, mesh: Any, batches: list[Any]) -> None:
        import torch

        from plait.train.compiled import compile_blocks
        from plait.train.loop import build_model
        from plait.train.optimizer import build_optimizer

        if impl == "torch":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        else:
            from plait import MixedPrecisionPolicy, fully_shard  # type: ignore[assignment]
        torch.manual_seed(tcfg.seed)  # both variants start from the same weights
        with torch.device(tcfg.device):  # initialised on the device: seconds, not minutes
            self.model = build_model(tcfg)
        if compiled:  # before fully_shard, whose hooks stay outside the graphs
            compile_blocks(list(self.model.blocks), context_parallel=False)
        bf16 = tcfg.mp == "bf16"
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        )
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)
        self.optimizer = build_optimizer([self.model], tcfg)
        self.batches = batches
        self.moe = tcfg.experts > 0
        self.steps = 0
        self.losses: list[float] = []

    def step(self) -> Any:
        from plait.experts import update_expert_bias
        from plait.train.model import token_loss

        inputs, targets = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        loss = token_loss(self.model(inputs), targets) / targets.numel()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.moe:
            update_expert_bias(self.model)  # the trainer's end of a step: counts reset
        return loss.detach()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _memory(device: str) -> tuple[int, int]:
    """(allocated now, peak since the last reset) on CUDA; zeros elsewhere."""
    import torch

    if device != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()


def _timed_step(variant: Variant, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    loss = variant.step()
    _sync(device)
    elapsed = time.perf_counter() - start
    variant.losses.append(float(loss))  # read after the clock stopped
    return elapsed


def run_fsdp(cfg: CheckConfig, result: PartResult, kind: str, compiled: bool) -> None:
    """Part 2 (``kind`` "llama") or the MoE rows of part 4: plait's and torch's
    ``fully_shard`` on a 1-rank process group, interleaved."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cuda = cfg.device == "cuda"
    with tempfile.TemporaryDirectory(prefix="plait-gpu-pg-") as tmp:
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1
        )
        try:
            mesh = init_device_mesh(cfg.device, (1,))
            _time_variants(cfg, result, kind, compiled, mesh)
        finally:
            dist.destroy_process_group()


def _time_variants(
    cfg: CheckConfig, result: PartResult, kind: str, compiled: bool, mesh: Any
) -> None:
    import torch

    from plait.train.flops import device_peak
    from plait.train.loop import model_flops_per_token

    tcfg = train_config(cfg, kind)
    per_token = model_flops_per_token(tcfg)
    peak, source = device_peak(cfg.device, cfg.mp)
    mode = "compile" if compiled else "eager"
    result.notes.append(
        f"{_model_label(cfg, kind)}: {per_token:.3g} model FLOPs/token; MFU over {peak:.3g} "
        f"FLOP/s ({source})"
    )
    generator = torch.Generator().manual_seed(1234)
    vocab = _vocab(tcfg)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, vocab, (cfg.batch, cfg.seq_len + 1), generator=generator)
        batches.append((tokens[:, :-1].to(cfg.device), tokens[:, 1:].to(cfg.device)))
    rate = (cfg.batch * cfg.seq_len, per_token, peak)
    resident: dict[str, Variant] = {}
    rows: dict[str, dict[str, Any]] = {}
    for impl in ("plait", "torch"):
        if resident and not _fits(cfg.device, max(r.get("peak_bytes", 0) for r in rows.values())):
            # Both do not fit side by side: time what is built, free it, go on.
            result.notes.append(f"{mode} {kind}: variants timed one after the other (memory)")
            _time_rounds(cfg, resident, rows, rate)
            resident.clear()
            _free()
        rows[impl] = result.row(
            group=kind, model=_model_label(cfg, kind), impl=f"{impl} fully_shard", mode=mode
        )
        variant = _warm_up(cfg, impl, tcfg, compiled, mesh, batches, rows[impl])
        if variant is not None:
            resident[impl] = variant
        result.save()
    _time_rounds(cfg, resident, rows, rate)
    if all(rows[impl].get("losses") for impl in ("plait", "torch")):
        ours, theirs = rows["plait"]["losses"], rows["torch"]["losses"]
        result.notes.append(
            f"{mode} {kind}: plait's and torch's losses over the same {len(ours)} steps differ "
            f"by at most {_gap(ours, theirs):.2g}"
        )
        resident.clear()
        _free()
        result.notes.append(_torch_again(cfg, tcfg, compiled, mesh, batches, theirs, mode, kind))
    result.save()


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=False))


def _torch_again(
    cfg: CheckConfig,
    tcfg: Any,
    compiled: bool,
    mesh: Any,
    batches: list[Any],
    first: list[float],
    mode: str,
    kind: str,
) -> str:
    """The yardstick for plait's loss gap: torch's ``fully_shard`` built again from the
    same weights and run over the same batches, its losses against its first run's (on a
    GPU, kernels that add in a varying order make two runs of one program differ)."""
    try:
        variant = Variant("torch", tcfg, compiled, mesh, batches)
        for _ in first:
            _timed_step(variant, cfg.device)
    except Exception as err:  # a note, not a row: the timings above stand
        traceback.print_exc()
        return f"{mode} {kind}: torch run again failed: {_short(err)}"
    finally:
        _free()
    return (
        f"{mode} {kind}: torch's fully_shard run again from the same start differs from its "
        f"first run by at most {_gap(variant.losses, first):.2g} (run-to-run spread)"
    )


def _warm_up(
    cfg: CheckConfig,
    impl: str,
    tcfg: Any,
    compiled: bool,
    mesh: Any,
    batches: list[Any],
    row: dict[str, Any],
) -> Variant | None:
    """Build ``impl``'s variant and run its warm-up steps (compilation included); its peak
    memory and notes go into ``row``. None (and the error in ``row``) if it failed."""
    import torch

    from plait.train.compiled import CompileCounters

    cuda = cfg.device == "cuda"
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base, _ = _memory(cfg.device)
        before = CompileCounters.read()
        variant = Variant(impl, tcfg, compiled, mesh, batches)
        with count_grouped_mm() as grouped:
            for _ in range(cfg.warmup):
                _timed_step(variant, cfg.device)
        _, high = _memory(cfg.device)
    except Exception as err:  # reported in the table, the other goes on
        traceback.print_exc()
        row["error"] = _short(err)
        _free()
        return None
    row["peak_bytes"] = high - base
    row["peak_gib"] = (high - base) / GiB if cuda else None
    notes = []
    if compiled:
        done = CompileCounters.read().since(before)
        notes.append(f"warm-up compiled {done.graphs} graph(s), {done.graph_breaks} breaks")
    if tcfg.experts:
        calls = grouped["n"] / max(cfg.warmup, 1)
        notes.append(f"grouped GEMM forward calls/step {calls:.0f}")
    row["note"] = "; ".join(notes)
    return variant


def _time_rounds(
    cfg: CheckConfig,
    variants: dict[str, Variant],
    rows: dict[str, dict[str, Any]],
    rate: tuple[int, float, float],
) -> None:
    """``cfg.repeats`` rounds of ``cfg.steps`` timed steps of every variant, the order
    rotated from round to round; each row gets its medians and its losses."""
    from plait.train.compiled import CompileCounters

    alive = dict(variants)
    times: dict[str, list[float]] = {impl: [] for impl in alive}
    before = CompileCounters.read()
    for round_ in range(cfg.repeats):
        names = list(alive)
        shift = round_ % max(len(names), 1)
        for impl in names[shift:] + names[:shift]:
            try:
                times[impl] += [_timed_step(alive[impl], cfg.device) for _ in range(cfg.steps)]
            except Exception as err:  # e.g. out of memory: drop this variant
                traceback.print_exc()
                rows[impl]["error"] = _short(err)
                del alive[impl]
    recompiled = CompileCounters.read().since(before).graphs
    for impl, variant in alive.items():
        row = rows[impl]
        tokens, per_token, peak = rate
        median = statistics.median(times[impl])
        row["step_ms"] = median * 1e3
        row["tokens_per_s"] = tokens / median
        row["mfu"] = tokens / median * per_token / peak if peak > 0 else None
        row["losses"] = variant.losses
        if recompiled:
            row["note"] += f"; {recompiled} graph(s) compiled while timed"


def _fits(device: str, need: int) -> bool:
    """Whether ``need`` more bytes (with a 15% margin) fit on the device now."""
    import torch

    if device != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return free > 1.15 * need


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _vocab(tcfg: Any) -> int:
    """The model's vocabulary (a Llama's config may hold more ids than the tokenizer)."""
    import torch

    from plait.train.loop import build_model

    with torch.device("meta"):
        model = build_model(tcfg)
    return int(model.tok_emb.weight.shape[0])


# -- part 3: plait train itself ------------------------------------------------------------


def run_train(cfg: CheckConfig, result: PartResult, kind: str, compiled: bool) -> None:
    """One ``plait train`` run in this process; its metrics.jsonl's medians."""
    import torch

    from plait.train.loop import train
    from plait.train.metrics import read_metrics

    mode = "compile" if compiled else "eager"
    row = result.row(group=kind, model=_model_label(cfg, kind), impl="plait train", mode=mode)
    with tempfile.TemporaryDirectory(prefix="plait-gpu-train-") as run_dir:
        if cfg.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            with count_grouped_mm() as grouped, _no_checkpoint(skip=compiled):
                train(train_config(cfg, kind, compile=compiled, run_dir=run_dir))
        except Exception as err:  # the row says it failed
            traceback.print_exc()
            row["error"] = _short(err)
        wall = time.perf_counter() - started
        records = [r for r in read_metrics(run_dir) if "loss" in r]
    if cfg.device == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
    if not records:
        result.save()
        return
    timed = records[TRAIN_SKIP:] or records
    row["step_ms"] = statistics.median(r["step_time"] for r in timed) * 1e3
    row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in timed)
    row["mfu"] = statistics.median(r.get("mfu", 0.0) for r in timed)
    row["losses"] = [r["loss"] for r in records]
    saved = "no checkpoint" if compiled else "checkpoint"
    notes = [f"{len(records)} steps in {wall:.0f} s (with build, data, eval, {saved})"]
    if compiled:
        first = records[0].get("compiled_graphs", 0)
        later = sum(r.get("compiled_graphs", 0) for r in records[1:])
        breaks = sum(r.get("graph_breaks", 0) for r in records)
        notes.append(f"graphs: {first} in step 1, {later} later; {breaks} breaks")
    if kind == "moe":
        notes.append(f"grouped GEMM forward calls/step {grouped['n'] / len(records):.0f}")
    row["note"] = "; ".join(notes)
    result.save()


@contextlib.contextmanager
def _no_checkpoint(skip: bool) -> Iterator[None]:
    """With ``skip``, ``plait train``'s final checkpoint is not written. A 1B model's with
    its AdamW state is about 15 GB, written, fsynced and hashed: up to a minute of a short
    lease that the eager run has already shown to work on CUDA."""
    from plait.train import loop

    session = getattr(loop, "_Session", None)
    if not skip or session is None or not hasattr(session, "save"):
        yield
        return
    original = session.save
    session.save = lambda self, step: Path(self.run_dir)
    try:
        yield
    finally:
        session.save = original


def run_moe(cfg: CheckConfig, result: PartResult) -> None:
    """Part 4: ``plait train`` of the MoE GPT (autocast), then the same model under
    plait's and torch's ``fully_shard`` (bf16 parameters); grouped GEMMs in all three."""
    run_train(cfg, result, "moe", compiled=False)
    _free()
    run_fsdp(cfg, result, "moe", compiled=False)


# -- the parts, run here or each in a process of its own ---------------------------------------


def _set_backend(backend: str) -> None:
    from plait.train import compiled

    compiled.BACKEND = backend


PARTS: dict[str, Callable[[CheckConfig, PartResult], None]] = {
    "fsdp-eager": lambda cfg, r: run_fsdp(cfg, r, "llama", compiled=False),
    "kernels": lambda cfg, r: gpu_kernels.measure(cfg.device, r.row, r.notes),
    "train-eager": lambda cfg, r: run_train(cfg, r, "llama", compiled=False),
    "fsdp-compile": lambda cfg, r: run_fsdp(cfg, r, "llama", compiled=True),
    "train-compile": lambda cfg, r: run_train(cfg, r, "llama", compiled=True),
    "moe": lambda cfg, r: run_moe(cfg, r),
}


def run_part(name: str, cfg: CheckConfig, path: Path | None) -> PartResult:
    """Part ``name`` in this process; its result (also saved at ``path``)."""
    result = PartResult(path)
    _ensure_plait()
    _set_backend(cfg.backend)
    try:
        PARTS[name](cfg, result)
    except Exception as err:  # the part failed as a whole: say where
        traceback.print_exc()
        result.error = _short(err)
    finally:
        if "compile" in name:
            import torch

            torch._dynamo.reset()  # the graphs hold the part's models
    result.save()
    return result


def _ensure_plait() -> None:
    """Make ``plait`` importable from this checkout when it is not installed (the GPU
    machine has torch and nothing of ours)."""
    if importlib.util.find_spec("plait") is None:
        sys.path.insert(0, str(REPO / "src"))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    # Fewer fragmented blocks, so two 1B models with their optimizer states fit side by
    # side (torchtitan runs with it too); the same for both implementations.
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def _run(cmd: list[str], timeout: float, log: Path | None) -> tuple[int | None, str]:
    """Run ``cmd`` in the repository, in a process group of its own (killed whole at
    ``timeout``: inductor's compile workers too); (exit code or None, its output). The
    output goes straight to ``log`` when given: it survives this process being killed."""
    with contextlib.ExitStack() as stack:
        if log is None:
            out = stack.enter_context(tempfile.TemporaryFile("w+"))
        else:
            out = stack.enter_context(open(log, "a+"))
            out.write(f"\n===== {' '.join(cmd[:6])} ...\n")
            out.flush()
        start = out.tell()
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        out.seek(start)
        output = out.read()
    return code, output


def run_isolated(name: str, cfg: CheckConfig, timeout: float, log: Path | None) -> PartResult:
    """Part ``name`` in a fresh process, at most ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="plait-gpu-part-") as tmp:
        path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--part", name]
        cmd += ["--config", json.dumps(asdict(cfg)), "--result", str(path)]
        code, output = _run(cmd, timeout, log)
        result = PartResult.load(path)
    if code != 0 and not result.error:
        result.error = f"timed out after {timeout:.0f} s" if code is None else f"exit code {code}"
    for row in result.rows:  # the rows the part had begun when it stopped
        if code != 0 and not row["error"] and row.get("tokens_per_s") is None:
            row["error"] = f"part stopped: {result.error}"
    if code != 0:
        tail = "\n".join(output.splitlines()[-20:])
        print(f"gpu_check: part {name} failed ({result.error}); its last output:\n{tail}")
    return result


# -- the report ---------------------------------------------------------------------------------


def environment(cfg: CheckConfig) -> str:
    import torch

    if cfg.device == "cuda":
        device = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    else:
        device = f"CPU ({os.cpu_count()} cores), no GPU"
    try:  # the GPU machine gets the working tree, perhaps without git or .git
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    return f"{device} · torch {torch.__version__} · plait {commit or 'checkout'}"


def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def markdown(
    cfg: CheckConfig, header: str, results: dict[str, PartResult], took: dict[str, float]
) -> str:
    lines = [f"## GPU check, {time.strftime('%Y-%m-%d')}", "", header, ""]
    tests = results.get("tests")
    if tests is not None:
        lines += _tests_lines(tests) + [""]
    rows = [r for name, res in results.items() if name != "tests" for r in res.rows]
    kernels = [r for r in rows if r.get("group") == "kernels"]
    rows = [r for r in rows if r.get("group") != "kernels"]
    torch_rows = {(r["group"], r["mode"]): r for r in rows if r["impl"] == "torch fully_shard"}
    lines += [
        "| model | implementation | mode | step ms | tokens/s | MFU | peak GiB | vs torch | "
        "loss first → last | notes |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        ref = torch_rows.get((r["group"], r["mode"]))
        ratio = None
        if r.get("tokens_per_s") and ref and ref.get("tokens_per_s") and ref is not r:
            ratio = r["tokens_per_s"] / ref["tokens_per_s"]
        losses = r.get("losses")
        loss = f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else "—"
        note = f"FAILED: {r['error']}" if r["error"] else r["note"]
        mfu = r.get("mfu")
        lines.append(
            f"| {r['model']} | {r['impl']} | {r['mode']} | {_cell(r.get('step_ms'), '.1f')} | "
            f"{_cell(r.get('tokens_per_s'), ',.0f')} | "
            f"{_cell(None if mfu is None else 100 * mfu, '.1f')}{'%' if mfu is not None else ''} | "
            f"{_cell(r.get('peak_gib'), '.1f')} | {_cell(ratio, '.2f')} | {loss} | {note} |"
        )
    if kernels:
        lines += ["", "Kernels against the planner's roofline:", "", *gpu_kernels.markdown(kernels)]
    lines += ["", *_notes(cfg, results, took)]
    return "\n".join(lines)


def _tests_lines(tests: PartResult) -> list[str]:
    info = tests.tests
    if "skipped" in info:
        return [f"CUDA-only tests: skipped ({info['skipped']}); the listed ids all exist."]
    if not info:  # ids gone, or no time left
        return [f"CUDA-only tests: {tests.skipped or 'FAILED: ' + tests.error}"]
    outcomes: dict[str, str] = info.get("outcomes", {})
    counts = {k: sum(o.startswith(k) for o in outcomes.values()) for k in ("passed", "failed")}
    counts["skipped"] = sum(o.startswith("skipped") for o in outcomes.values())
    lines = [
        f"CUDA-only tests ({len(CUDA_TESTS)} listed): {counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped"
    ]
    lines += [f"- `{name}`: {o}" for name, o in outcomes.items() if o != "passed"]
    if tests.error:
        lines += ["", "```", f"FAILED: {tests.error}", "```"]
    return lines


def _notes(cfg: CheckConfig, results: dict[str, PartResult], took: dict[str, float]) -> list[str]:
    notes = [
        f"Settings: seq {cfg.seq_len} x batch {cfg.batch}, {cfg.mp}; fully_shard rows: "
        f"{cfg.warmup} warm-up steps, then {cfg.repeats} interleaved repeats x {cfg.steps} "
        f"steps (median); plait train rows: {cfg.train_steps} steps, medians after the first "
        f"{TRAIN_SKIP}; compile backend {cfg.backend}. vs torch: tokens/s over torch "
        "fully_shard's in the same mode (>1: faster than torch). plait train on one process "
        "runs without fully_shard (bf16 by autocast) and clips gradients: its ratio is to "
        "the same torch row. Peak GiB: torch.cuda.max_memory_allocated, over a fully_shard "
        "variant's build and warm-up less what was allocated before it, over a whole plait "
        "train run.",
    ]
    for name, res in results.items():
        notes += [f"- {name}: {n}" for n in dict.fromkeys(res.notes)]
        if res.error and name != "tests":
            notes.append(f"- {name}: FAILED: {res.error}")
        if res.skipped:
            notes.append(f"- {name}: {res.skipped}")
    spent = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in took.items())
    notes += [f"Wall time per part: {spent}.", NOT_RUN]
    return notes


# -- the command --------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    default = CheckConfig(device="auto")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--model", default=default.model, help="a Llama preset or config.json")
    p.add_argument("--seq-len", type=int, default=default.seq_len)
    p.add_argument("--batch", type=int, default=default.batch, help="sequences per step")
    p.add_argument("--steps", type=int, default=default.steps, help="timed per repeat")
    p.add_argument("--repeats", type=int, default=default.repeats)
    p.add_argument("--warmup", type=int, default=default.warmup)
    p.add_argument("--train-steps", type=int, default=default.train_steps)
    p.add_argument("--mp", default=default.mp, choices=("bf16", "fp32"))
    p.add_argument("--backend", default=default.backend, help="torch.compile backend")
    p.add_argument("--moe-d-model", type=int, default=0, help="0: 1024 on CUDA, 64 on CPU")
    p.add_argument("--moe-layers", type=int, default=0, help="0: 8 on CUDA, 2 on CPU")
    p.add_argument("--parts", default=",".join(["tests", *PARTS]), help="which, in order")
    p.add_argument("--budget", type=float, default=default.budget, help="seconds, all parts")
    p.add_argument("--out", type=Path, help="also write the report here (after every part)")
    p.add_argument("--log", type=Path, help="append every part's own output here")
    p.add_argument("--in-process", action="store_true", help="no process per part (tests)")
    p.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.part:  # a part's own process
        run_part(args.part, CheckConfig(**json.loads(args.config)), args.result)
        return 0
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here")
    names = [n for n in args.parts.split(",") if n]
    unknown = [n for n in names if n not in PART_LIMITS]
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {', '.join(PART_LIMITS)}")
    cfg = CheckConfig(
        device=device,
        model=args.model,
        seq_len=args.seq_len,
        batch=args.batch,
        steps=args.steps,
        repeats=args.repeats,
        warmup=args.warmup,
        train_steps=args.train_steps,
        mp=args.mp,
        backend=args.backend,
        moe_d_model=args.moe_d_model,
        moe_layers=args.moe_layers,
        budget=args.budget,
    )
    header = environment(cfg)
    print(f"gpu_check: {header}; parts {', '.join(names)}; budget {cfg.budget:.0f} s", flush=True)
    deadline = time.perf_counter() + cfg.budget
    results: dict[str, PartResult] = {}
    took: dict[str, float] = {}
    for name in names:
        left = deadline - time.perf_counter()
        started = time.perf_counter()
        if left < MIN_PART_S:
            why = f"not run: only {max(left, 0):.0f} s of --budget left"
            results[name] = PartResult(skipped=why)
        elif name == "tests":
            results[name] = run_tests(cfg, min(PART_LIMITS[name], left), args.log)
        elif args.in_process:
            results[name] = run_part(name, cfg, None)
        else:
            results[name] = run_isolated(name, cfg, min(PART_LIMITS[name], left), args.log)
        took[name] = time.perf_counter() - started
        state = results[name].skipped or "done"
        if results[name].error:
            state = f"FAILED: {results[name].error}"
        print(f"gpu_check: {name} {state} ({took[name]:.0f} s)", flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(markdown(cfg, header, results, took) + "\n")
    print(markdown(cfg, header, results, took), flush=True)
    failed = any(r.error or any(row["error"] for row in r.rows) for r in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
