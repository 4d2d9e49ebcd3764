"""``plait plan``: which layouts fit, and how fast they run (:func:`plait.plan.plan`).

The model is a preset (``--preset llama3-8b``), a Hugging Face ``config.json``
(``--hf-config``) or plait's GPT from ``plait train``'s flags (``--n-layer``, ``--n-head``,
``--d-model``). ``--experts`` (with ``--top-k``, ``--shared-experts``, ``--expert-hidden``,
``--dense-layers``) makes any of them a mixture of experts, whose expert-parallel size
``--ep`` is searched unless given. Layout flags are ``plait train``'s: each one given is
fixed, the others are searched. Exit status 2, with a message naming the flag, for input
that cannot be planned (sizes that do not divide the devices, a ``--tp`` the model does
not divide, an ``--ep`` the experts do not divide, a model that fits in no layout).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from plait.layout import LAYOUT_FIELDS, flag
from plait.plan.batch import BatchError, read_entries, run_batch
from plait.plan.calibrate import calibrate, read_run
from plait.plan.devices import device, override
from plait.plan.flags import add_flags
from plait.plan.memory import first_rank_memory
from plait.plan.models import (
    expert_hidden_default,
    from_hf_config,
    gpt,
    preset,
)
from plait.plan.report import format_plan, size, speed_flags, to_json
from plait.plan.search import Candidate, PlanError, describe, plan
from plait.plan.spec import (
    DeviceSpec,
    Layout,
    ModelSpec,
    PlanLayout,
    Software,
    Workload,
)
from plait.train.config import DEFAULTS, TrainConfig
from plait.train.cores import usable_cores

__all__ = ["add_parser", "main", "run"]

_HELP = """\
Plan a training run: for a model, a sequence length and batch, and N devices, list the
layouts (dp_replicate x dp_shard x cp x tp x pp, schedule, microbatches, checkpointing,
resharding) that fit in memory, fastest first, with per-rank memory by part,
communication, pipeline bubble and predicted throughput (docs/plan.md: the cost model).
Layout flags fix that part of the layout; the rest is searched.

examples:
  plait plan --preset llama3-8b --gpus 1024 --seq-len 8192
  plait plan --preset llama3-70b --gpus 256 --tp 8 --ac full --json
  plait plan --hf-config config.json --gpus 64 --device h200
  plait plan --n-layer 4 --d-model 128 --gpus 4 --device cpu
  plait plan --n-layer 32 --n-head 32 --d-model 4096 --seq-len 4096 --gpus 1024 --dry-run
  plait plan --preset llama3-8b --seq-len 4096 --gpus 64 --dry-run
  plait plan --n-layer 16 --d-model 2048 --n-head 16 --experts 64 --top-k 4 --gpus 64
  plait plan --preset llama3-8b --gpus 64 --seq-len 65536 --cp 8 --cp-method ring
"""


def add_parser(subcommands: Any) -> argparse.ArgumentParser:
    """Add ``plan`` to an ``argparse`` sub-command set, with its flags
    (:data:`plait.plan.flags.PLAN_FLAGS`); returns its parser."""
    p: argparse.ArgumentParser = subcommands.add_parser(
        "plan",
        help="which layouts fit, and how fast they run",
        description=_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(p)
    return p


_MOE_FLAGS = ("experts", "top_k", "shared_experts", "expert_hidden", "dense_layers")


def _model(args: argparse.Namespace, seq_len: int) -> ModelSpec:
    """The model the flags describe; ValueError for MoE flags that do not fit it."""
    moe = {name: getattr(args, name) for name in _MOE_FLAGS if getattr(args, name) is not None}
    for name, value in moe.items():
        least = 1 if name in ("top_k", "expert_hidden") else 0
        if value < least:
            raise PlanError(f"{flag(name)} {value}: must be at least {least}")
    if args.preset or args.hf_config:
        base = preset(args.preset) if args.preset else from_hf_config(args.hf_config)
    elif moe.get("dense_layers"):
        raise PlanError(
            "--dense-layers: plait's GPT has MoE blocks only; use --preset or --hf-config"
        )
    else:
        return _gpt(args, seq_len, moe)
    if not moe:
        return base
    base = dataclasses.replace(base, source="")  # no longer the preset's or config's model
    if moe.get("experts") == 0 and not any(moe.get(n) for n in ("shared_experts", "dense_layers")):
        return dataclasses.replace(base, experts=0, dense_layers=0)  # --experts 0: dense
    if not moe.get("experts", base.experts):
        raise PlanError(f"{', '.join(flag(n) for n in moe)}: a dense model; add --experts")
    top_k = moe.get("top_k", base.top_k if base.experts else 2)
    shared = moe.get("shared_experts", base.shared_experts)
    default_hidden = base.expert_hidden or expert_hidden_default(base.ffn_hidden, top_k, shared)
    fields = {
        "experts": moe.get("experts", base.experts),
        "top_k": top_k,
        "shared_experts": shared,
        "expert_hidden": moe.get("expert_hidden", default_hidden),
        "dense_layers": moe.get("dense_layers", base.dense_layers),
    }
    return dataclasses.replace(base, name=f"{base.name}-moe{fields['experts']}", **fields)


def _gpt(args: argparse.Namespace, seq_len: int, moe: dict[str, int]) -> ModelSpec:
    """plait's GPT from the flags (dense without --experts; plait train's MoE defaults)."""
    if not moe.get("experts"):
        others = [flag(name) for name in moe if name != "experts" and moe[name]]
        if others:
            raise PlanError(f"{', '.join(others)}: a dense model; add --experts")
        return gpt(args.n_layer, args.n_head, args.d_model, seq_len)
    return gpt(
        args.n_layer,
        args.n_head,
        args.d_model,
        seq_len,
        experts=moe["experts"],
        top_k=moe.get("top_k", DEFAULTS.top_k),
        shared_experts=moe.get("shared_experts", DEFAULTS.shared_experts),
        expert_hidden=moe.get("expert_hidden", DEFAULTS.expert_hidden),
    )


def _measured_cpu(gpus: int, model: ModelSpec, work: Workload, dev: DeviceSpec) -> DeviceSpec:
    """``--measure-cpu``: this machine's figures, at ``model``'s shapes with the local
    batch of pure data parallelism."""
    if dev.name != "cpu":
        raise PlanError(f"--measure-cpu measures this CPU: use --device cpu, not {dev.name}")
    from plait.plan.measure import measure_for

    return measure_for(gpus, model, work.seq_len, work.global_batch)


def _evaluate(
    args: argparse.Namespace,
) -> tuple[list[Candidate], ModelSpec, Workload, DeviceSpec]:
    """The layouts ``args`` ask for, best first, with the model, work and device they were
    priced for; ValueError (PlanError, bad presets, configs or device values) otherwise."""
    seq_len = args.seq_len or (8192 if args.preset or args.hf_config else DEFAULTS.seq_len)
    model = _model(args, seq_len)
    dev = _device(args)
    work = _workload(args, seq_len, dev)
    if args.calibrate:  # on a CPU, the calibration measures it (plait.plan.calibrate)
        dev = _calibrated(args.calibrate, dev, args.gpus)
    elif args.measure_cpu:
        dev = _measured_cpu(args.gpus, model, work, dev)
    return _plan(args, model, work, dev), model, work, dev


def _calibrated(run_dirs: list[str], dev: DeviceSpec, workers: int) -> DeviceSpec:
    """``--calibrate``: ``dev`` fitted to the runs (:mod:`plait.plan.calibrate`), for
    ``workers`` devices (on a CPU: workers sharing this machine's cores); says the fit on
    stderr."""
    fit = calibrate(dev, [read_run(d) for d in run_dirs], usable_cores(), (workers,))
    for line in fit.lines:
        print(f"plait plan: {line}", file=sys.stderr)
    return fit.device(workers, usable_cores())


def _evaluate_json(args: argparse.Namespace) -> list[dict[str, Any]]:
    """What ``--json`` prints for ``args`` (``--top``'s best); ValueError as :func:`_evaluate`."""
    ranked, model, work, dev = _evaluate(args)
    shown = ranked[: args.top] if args.top > 0 else ranked
    return [to_json(c, model, work, dev, _speed(args)) for c in shown]


def run(args: argparse.Namespace) -> int:
    """Plan from parsed ``args``; prints the table or JSON. Returns the exit status."""
    if args.batch:
        print("plait plan: error: --batch needs the command line (plait plan ...)", file=sys.stderr)
        return 2
    try:
        ranked, model, work, dev = _evaluate(args)
    except ValueError as err:  # PlanError, and bad presets, configs or device values
        print(f"plait plan: error: {err}", file=sys.stderr)
        return 2
    _print(args, ranked[: args.top] if args.top > 0 else ranked, model, work, dev)
    if args.dry_run:
        return _dry_run(args, ranked, work, model)
    return 0


def _device(args: argparse.Namespace) -> DeviceSpec:
    """``--device`` with the figures the flags override."""
    gib, tera, giga = 2.0**30, 1e12, 1e9
    return override(
        device(args.device),
        memory=args.memory_gib and args.memory_gib * gib,
        flops=args.tflops and args.tflops * tera,
        flops_fp32=args.tflops_fp32 and args.tflops_fp32 * tera,
        intra_node_bw=args.intra_node_bw and args.intra_node_bw * giga,
        inter_node_bw=args.inter_node_bw and args.inter_node_bw * giga,
        gpus_per_node=args.gpus_per_node,
    )


def _workload(args: argparse.Namespace, seq_len: int, dev: DeviceSpec) -> Workload:
    """The step the flags describe; PlanError for sizes and fractions out of range."""
    precision = args.mp or ("fp32" if dev.name == "cpu" else "bf16")
    work = Workload(seq_len, args.global_batch or args.gpus, precision)
    if work.seq_len < 1 or work.global_batch < 1:
        raise PlanError("--seq-len and --global-batch must be at least 1")
    if not 0 < args.efficiency <= 1 or not 0 < args.memory_fraction <= 1:
        raise PlanError("--efficiency and --memory-fraction must be in (0, 1]")
    return work


def _software(args: argparse.Namespace) -> Software:
    """The flags' :class:`Software`."""
    return Software(
        args.kernels,
        args.tp_overlap,
        param_gather_overlap=args.param_gather_overlap,
        grad_reduce_fp32=not args.grad_reduce_bf16,
        ep_inner=args.ep_inner,
        compiled=args.compile,
        float8=args.float8,
        float8_all_gather=args.float8_all_gather,
        compiled_loss=args.compile and args.kernels == "torchtitan",
        float8_tp_gather=args.float8 == "tensorwise" and args.kernels == "torchtitan",
    )


def _speed(args: argparse.Namespace) -> tuple[str, ...]:
    """``plait train``'s compile and Float8 flags for the printed commands."""
    return speed_flags(_software(args))


def _plan(
    args: argparse.Namespace, model: ModelSpec, work: Workload, dev: DeviceSpec
) -> list[Candidate]:
    """:func:`plait.plan.plan` with the flags' settings, layout fields and software."""
    software = _software(args)
    return plan(
        model,
        work,
        dev,
        args.gpus,
        memory_fraction=args.memory_fraction,
        efficiency=args.efficiency,
        zero=args.zero or 0,
        recipe=args.recipe,
        software=software,
        **{name: getattr(args, name) for name in LAYOUT_FIELDS},
    )


def _print(
    args: argparse.Namespace,
    shown: list[Candidate],
    model: ModelSpec,
    work: Workload,
    dev: DeviceSpec,
) -> None:
    """The table (or ``--json``'s list) of the layouts ``shown``."""
    speed = _speed(args)
    if args.json:
        print(json.dumps([to_json(c, model, work, dev, speed) for c in shown], indent=1))
        return
    print(format_plan(shown, model, work, dev, args.gpus, speed))
    foreign = [c for c in shown if isinstance(c.layout, PlanLayout)]
    if foreign:
        print(
            f"  note: {len(foreign)} layout(s) shown ({describe(foreign[0].layout)}, ...) "
            "use ZeRO or another framework's recipe: predictions for other frameworks "
            "(DeepSpeed, Megatron-LM); plait train does not run them"
        )


def _dry_runnable(layout: Layout, tied: bool = False) -> bool:
    """Whether :func:`plait.plan.dryrun.dry_run` runs ``layout``: plait's own, not tensor
    parallelism replicated without ``fully_shard``, and a pipeline only without tensor
    parallelism, with a schedule of full backwards, and of a model whose head is not
    ``tied`` to its embedding (plait train refuses that)."""
    from plait.pipeline.schedules import schedule_spec
    from plait.plan.dryrun import DRY_RUN_SCHEDULES, replicated_tp

    if isinstance(layout, PlanLayout) or replicated_tp(layout):
        return False
    if layout.pp == 1:
        return True
    if tied:
        return False
    return layout.tp == 1 and schedule_spec(layout.schedule).name in DRY_RUN_SCHEDULES


def _model_config(args: argparse.Namespace, model: ModelSpec) -> str:
    """What ``--dry-run`` gives ``plait train --model-config``: ``model``'s source (a
    train preset or the ``--hf-config`` path), or "" (plait's GPT). PlanError for MoE
    flags on a preset or config (plait train builds a config's experts from its
    config.json)."""
    given = [flag(n) for n in _MOE_FLAGS if getattr(args, n) is not None]
    if (args.preset or args.hf_config) and given:
        raise PlanError(
            f"--dry-run with {', '.join(given)}: plait train builds a config's experts from "
            "its config.json only; dry-run without them"
        )
    return model.source


def _dry_run(
    args: argparse.Namespace, ranked: list[Candidate], work: Workload, model: ModelSpec
) -> int:
    """``--dry-run``: measure rank 0 of the best layout the dry run runs, and compare with
    its prediction (rank 0's: with a pipeline, the first pipeline rank's). ``model``: the
    planner's description of what ``plait train`` builds (plait's GPT or the Llama of
    ``--hf-config`` / ``--preset``)."""
    try:
        model_config = _model_config(args, model)
    except PlanError as err:
        print(f"plait plan: error: {err}", file=sys.stderr)
        return 2
    candidates = [c for c in ranked if _dry_runnable(c.layout, model.tied)]
    if not candidates:
        print("plait plan: error: --dry-run: no layout it runs fits", file=sys.stderr)
        return 2
    from plait.plan.dryrun import dry_run
    from plait.plan.train_plan import config_of_layout

    best = candidates[0]
    lay = best.layout
    if model_config:
        cfg = _train_config(model_config, lay, work)
    else:
        cfg = config_of_layout(model, lay, work)
    try:
        measured = dry_run(cfg, args.gpus)
    except ValueError as err:  # ConfigError: what plait train refuses of this model
        print(f"plait plan: error: --dry-run of {describe(lay)}: {err}", file=sys.stderr)
        return 2
    predicted = best.memory.total
    if lay.pp > 1:
        predicted = first_rank_memory(model, lay, work).total
    print(
        f"dry run of {describe(lay)} (rank 0 of {args.gpus}, {measured.seconds:.1f} s): "
        f"peak live tensors {size(measured.peak)}, predicted {size(predicted)} "
        f"({predicted / measured.peak - 1:+.1%})"
    )
    return 0


def _train_config(model_config: str, layout: Layout, work: Workload) -> TrainConfig:
    """The ``plait train`` configuration of ``layout`` for the Llama of ``model_config``
    (a config.json or a train preset)."""
    return TrainConfig(
        model_config=model_config,
        seq_len=work.seq_len,
        batch_size=work.global_batch,
        mp=work.precision,
        **dataclasses.asdict(layout),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``plait plan`` on its own (``python -m plait.plan.cli``)."""
    parser = argparse.ArgumentParser(prog="plait")
    flags = add_parser(parser.add_subparsers(dest="command", required=True))
    words = ["plan", *(argv if argv is not None else sys.argv[1:])]
    args = parser.parse_args(words)
    if not args.batch:
        return run(args)
    try:
        entries = read_entries(args.batch)
    except BatchError as err:
        print(f"plait plan: error: {err}", file=sys.stderr)
        return 2
    known = [action.dest for action in flags._actions]
    print(json.dumps(run_batch(parser, words, known, entries, _evaluate_json), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
