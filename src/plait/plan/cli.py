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

from plait.layout import CP, CP_METHODS, EP, LAYOUT_FIELDS, flag
from plait.plan.devices import DEVICES, device, override
from plait.plan.memory import first_rank_memory
from plait.plan.models import (
    expert_hidden_default,
    from_hf_config,
    gpt,
    param_counts,
    preset,
    preset_names,
)
from plait.plan.report import format_plan, size, to_json
from plait.plan.roofline import STACK_NAMES
from plait.plan.search import AC_SEARCHED, Candidate, PlanError, describe, plan
from plait.plan.spec import (
    LAYOUT_DIMS,
    RECIPES,
    TP_OVERLAPS,
    DeviceSpec,
    Layout,
    ModelSpec,
    PlanLayout,
    Software,
    Workload,
)
from plait.plan.timing import EFFICIENCY
from plait.train.config import DEFAULTS, PRECISIONS, TrainConfig

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
    """Add ``plan`` to an ``argparse`` sub-command set; returns its parser."""
    p: argparse.ArgumentParser = subcommands.add_parser(
        "plan",
        help="which layouts fit, and how fast they run",
        description=_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_argument_group("model (a preset, a Hugging Face config, or plait's GPT)")
    which = model.add_mutually_exclusive_group()
    which.add_argument(
        "--preset",
        choices=preset_names(),
        metavar="NAME",
        help=f"a published model: {', '.join(preset_names())} (plait train's presets, and "
        "the llama3-* names for Llama 3.1's)",
    )
    which.add_argument("--hf-config", metavar="PATH", help="a Llama-family config.json")
    for name, what in (("n_layer", "blocks"), ("n_head", "attention heads"), ("d_model", "width")):
        default = getattr(DEFAULTS, name)
        model.add_argument(
            flag(name),
            type=int,
            default=default,
            help=f"plait's GPT: {what} (default: {default})",
        )
    moe = p.add_argument_group(
        "mixture of experts (plait train's flags; --experts 0: dense; with --preset or "
        "--hf-config, replaces the MLP of every block after --dense-layers)"
    )
    moe.add_argument("--experts", type=int, help="routed experts per MoE block")
    moe.add_argument("--top-k", type=int, help="experts each token goes to (default: 2)")
    moe.add_argument("--shared-experts", type=int, help="experts every token goes through")
    moe.add_argument(
        "--expert-hidden",
        type=int,
        help="each expert's hidden width (default: the MLP's width / (top-k + shared))",
    )
    moe.add_argument(
        "--dense-layers", type=int, help="leading blocks that keep a dense MLP (default: 0)"
    )
    work = p.add_argument_group("work")
    work.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sequence (default: 8192 for "
        f"presets and configs, {DEFAULTS.seq_len} for plait's GPT)",
    )
    work.add_argument(
        "--global-batch",
        "--batch-size",
        dest="global_batch",
        type=int,
        help="sequences per step over all devices (default: one per device)",
    )
    work.add_argument(
        "--mp", choices=PRECISIONS, help="compute precision (default: bf16, fp32 on --device cpu)"
    )
    machine = p.add_argument_group("machine")
    machine.add_argument("--gpus", type=int, required=True, help="devices in all")
    machine.add_argument("--gpus-per-node", type=int, help="devices per node (default: 8)")
    machine.add_argument("--device", default="h100", help=f"one of {', '.join(DEVICES)}")
    machine.add_argument(
        "--measure-cpu",
        action="store_true",
        help="--device cpu: measure this machine first (FLOP/s of plait's GPT block, gloo "
        "bandwidth and latency, optimizer and fully_shard host costs, with --gpus local "
        "workers; about a minute) instead of the preset's measure-free defaults",
    )
    machine.add_argument("--memory-gib", type=float, help="override: memory per device, GiB")
    machine.add_argument("--tflops", type=float, help="override: dense bf16 peak, TFLOP/s")
    machine.add_argument("--tflops-fp32", type=float, help="override: dense fp32 peak, TFLOP/s")
    machine.add_argument("--intra-node-bw", type=float, help="override: GB/s per device, in a node")
    machine.add_argument("--inter-node-bw", type=float, help="override: GB/s per device, across")
    machine.add_argument(
        "--efficiency",
        type=float,
        default=EFFICIENCY,
        help=f"achievable fraction of peak (default: {EFFICIENCY}, calibrated)",
    )
    machine.add_argument(
        "--kernels",
        choices=STACK_NAMES,
        default="plait",
        help="whose kernels run the blocks (the cost model's software stacks; default: plait)",
    )
    machine.add_argument(
        "--tp-overlap",
        choices=TP_OVERLAPS,
        default="none",
        help="TP collectives: none (synchronous, plait's) or async (decomposed into GEMMs)",
    )
    machine.add_argument(
        "--param-gather-overlap",
        action="store_true",
        help="ZeRO's parameter all-gather beside the next forward (Megatron's)",
    )
    machine.add_argument(
        "--grad-reduce-bf16",
        action="store_true",
        help="reduce gradients in the compute dtype, not fp32 (Megatron-Core's default)",
    )
    machine.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        help="usable fraction of device memory (default: 0.9)",
    )
    layout = p.add_argument_group("layout (plait train's flags; given ones are fixed)")
    helps = {
        CP: "context-parallel ranks: each sequence split over them (default: searched "
        "from --seq-len 16384 on, else 1)"
    }
    for name in (*LAYOUT_DIMS, "stages_per_rank", "microbatches"):
        layout.add_argument(flag(name), type=int, help=helps.get(name))
    layout.add_argument(
        "--cp-method",
        choices=CP_METHODS,
        help="context-parallel attention: keys and values all-gathered, passed around a "
        "ring, or exchanged all-to-all by heads (default: each searched with --cp > 1)",
    )
    layout.add_argument(
        flag(EP), type=int, help="expert-parallel ranks, taken from dp_shard (with --experts)"
    )
    layout.add_argument("--schedule", help="a pipeline schedule (default: all searched)")
    layout.add_argument("--ac", choices=AC_SEARCHED)
    layout.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction)
    layout.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction)
    other = p.add_argument_group(
        "other frameworks (predictions for published runs: plait train runs neither)"
    )
    other.add_argument(
        "--zero",
        type=int,
        choices=(1, 2),
        help="also search ZeRO-1 / ZeRO-2 data parallelism (DeepSpeed; Megatron-LM's "
        "distributed optimizer is ZeRO-1): parameters replicated over dp_replicate x cp, "
        "optimizer state (and ZeRO-2 gradients) sharded over them",
    )
    other.add_argument(
        "--recipe",
        choices=RECIPES,
        default="plait",
        help="whose activations the memory model counts: plait's (torch tensor "
        "parallelism saves all-gathered linear inputs) or Megatron-LM's (Korthikanti et "
        "al. 2022: sequence-parallel activations saved split; default: plait)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="layouts shown (0: all that fit)")
    out.add_argument("--json", action="store_true", help="a JSON list instead of the table")
    out.add_argument(
        "--dry-run",
        action="store_true",
        help="also run plait's real training step (plait's GPT, or plait train's Llama of "
        "--hf-config or of --preset llama3-8b / llama3-70b) for rank 0 of the best layout "
        "plait can dry-run (fake process group and tensors; a pipeline: "
        "without tensor parallelism, schedules with full backwards, rank 0's own "
        "actions) and compare its measured peak memory with the prediction",
    )
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
    from plait.plan.measure import Shapes, measure_cpu

    shapes = Shapes(
        tokens=work.seq_len * max(1, work.global_batch // gpus),
        d_model=model.d_model,
        params=param_counts(model).total(model.layers) // gpus,
        heads=model.heads,
        seq_len=work.seq_len,
    )
    return measure_cpu(gpus, shapes)


def run(args: argparse.Namespace) -> int:
    """Plan from parsed ``args``; prints the table or JSON. Returns the exit status."""
    try:
        seq_len = args.seq_len or (8192 if args.preset or args.hf_config else DEFAULTS.seq_len)
        model = _model(args, seq_len)
        dev = device(args.device)
        gib, tera, giga = 2.0**30, 1e12, 1e9
        dev = override(
            dev,
            memory=args.memory_gib and args.memory_gib * gib,
            flops=args.tflops and args.tflops * tera,
            flops_fp32=args.tflops_fp32 and args.tflops_fp32 * tera,
            intra_node_bw=args.intra_node_bw and args.intra_node_bw * giga,
            inter_node_bw=args.inter_node_bw and args.inter_node_bw * giga,
            gpus_per_node=args.gpus_per_node,
        )
        precision = args.mp or ("fp32" if dev.name == "cpu" else "bf16")
        work = Workload(seq_len, args.global_batch or args.gpus, precision)
        if work.seq_len < 1 or work.global_batch < 1:
            raise PlanError("--seq-len and --global-batch must be at least 1")
        if not 0 < args.efficiency <= 1 or not 0 < args.memory_fraction <= 1:
            raise PlanError("--efficiency and --memory-fraction must be in (0, 1]")
        if args.measure_cpu:
            dev = _measured_cpu(args.gpus, model, work, dev)
        ranked = plan(
            model,
            work,
            dev,
            args.gpus,
            memory_fraction=args.memory_fraction,
            efficiency=args.efficiency,
            zero=args.zero or 0,
            recipe=args.recipe,
            software=Software(
                args.kernels,
                args.tp_overlap,
                param_gather_overlap=args.param_gather_overlap,
                grad_reduce_fp32=not args.grad_reduce_bf16,
            ),
            **{name: getattr(args, name) for name in LAYOUT_FIELDS},
        )
    except ValueError as err:  # PlanError, and bad presets, configs or device values
        print(f"plait plan: error: {err}", file=sys.stderr)
        return 2
    shown = ranked[: args.top] if args.top > 0 else ranked
    if args.json:
        print(json.dumps([to_json(c, model, work, dev) for c in shown], indent=1))
    else:
        print(format_plan(shown, model, work, dev, args.gpus))
        foreign = [c for c in shown if isinstance(c.layout, PlanLayout)]
        if foreign:
            print(
                f"  note: {len(foreign)} layout(s) shown ({describe(foreign[0].layout)}, ...) "
                "use ZeRO or another framework's recipe: predictions for other frameworks "
                "(DeepSpeed, Megatron-LM); plait train does not run them"
            )
    if args.dry_run:
        return _dry_run(args, ranked, work, model)
    return 0


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
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["plan", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    sys.exit(main())
