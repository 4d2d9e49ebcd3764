"""``plait plan``'s flags, declared as a table: per help group, one :class:`Flag` per flag
(its destination, help, type or action, default, choices), in the order ``--help`` lists
them. :func:`add_flags` adds them to a parser; :mod:`plait.plan.cli` reads the parsed
values by destination.

Layout flags are ``plait train``'s (:func:`plait.layout.flag` names them); those given fix
that part of the layout, the others are searched, so none has a default.
"""

from __future__ import annotations

import argparse
import builtins
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plait.layout import CP, CP_METHODS, EP, flag
from plait.plan.compute_time import EFFICIENCY
from plait.plan.devices import DEVICES
from plait.plan.models import preset_names
from plait.plan.pinned import AC_SEARCHED
from plait.plan.spec import FLOAT8_RECIPES, LAYOUT_DIMS, RECIPES, TP_OVERLAPS
from plait.plan.stacks import STACK_NAMES
from plait.train.config import DEFAULTS, PRECISIONS

__all__ = ["PLAN_FLAGS", "Flag", "add_flags"]


@dataclass(frozen=True)
class Flag:
    """One flag: ``--`` and ``name`` with dashes for underscores (then ``aliases``),
    parsed into ``name``. The fields left None are not passed to ``argparse``, so that
    its own defaults hold (a ``store_true`` flag's False); ``exclusive``: one of its
    group's mutually exclusive flags."""

    name: str
    help: str | None = None
    type: Callable[[str], Any] | None = None
    default: Any = None
    choices: Sequence[Any] | None = None
    metavar: str | None = None
    action: str | builtins.type[argparse.Action] | None = None  # (``type`` is a field)
    required: bool = False
    aliases: tuple[str, ...] = ()
    exclusive: bool = False

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``add_argument`` this flag sets."""
        given = {
            "help": self.help,
            "type": self.type,
            "default": self.default,
            "choices": self.choices,
            "metavar": self.metavar,
            "action": self.action,
        }
        options = {key: value for key, value in given.items() if value is not None}
        if self.required:
            options["required"] = True
        if self.aliases:
            options["dest"] = self.name
        return options


def _gpt_size(name: str, what: str) -> Flag:
    """One of plait's GPT's sizes, with ``plait train``'s default."""
    default = getattr(DEFAULTS, name)
    return Flag(name, f"plait's GPT: {what} (default: {default})", int, default)


_LAYOUT_HELP = {
    CP: "context-parallel ranks: each sequence split over them (default: searched "
    "from --seq-len 16384 on, else 1)",
    "end_blocks": "with a pipeline: blocks the embedding and the head each count for in "
    "the split among stages (default: 0, an even split of the blocks)",
    "max_active_stages": "with a pipeline: the most stages a rank holds gathered at once, a "
    "stage gathered again when it comes back (default: 0, no bound: each gathered once per "
    "step; torch's runtime schedules hold 3)",
}

#: Per help group (its title), its flags, in ``--help``'s order.
PLAN_FLAGS: Mapping[str, tuple[Flag, ...]] = {
    "model (a preset, a Hugging Face config, or plait's GPT)": (
        Flag(
            "preset",
            f"a published model: {', '.join(preset_names())} (plait train's presets, and "
            "the llama3-* names for Llama 3.1's)",
            choices=preset_names(),
            metavar="NAME",
            exclusive=True,
        ),
        Flag("hf_config", "a Llama-family config.json", metavar="PATH", exclusive=True),
        _gpt_size("n_layer", "blocks"),
        _gpt_size("n_head", "attention heads"),
        _gpt_size("d_model", "width"),
    ),
    "mixture of experts (plait train's flags; --experts 0: dense; with --preset or "
    "--hf-config, replaces the MLP of every block after --dense-layers)": (
        Flag("experts", "routed experts per MoE block", int),
        Flag("top_k", "experts each token goes to (default: 2)", int),
        Flag("shared_experts", "experts every token goes through", int),
        Flag(
            "expert_hidden",
            "each expert's hidden width (default: the MLP's width / (top-k + shared))",
            int,
        ),
        Flag("dense_layers", "leading blocks that keep a dense MLP (default: 0)", int),
    ),
    "work": (
        Flag(
            "seq_len",
            "tokens per sequence (default: 8192 for "
            f"presets and configs, {DEFAULTS.seq_len} for plait's GPT)",
            int,
        ),
        Flag(
            "global_batch",
            "sequences per step over all devices (default: one per device)",
            int,
            aliases=("--batch-size",),
        ),
        Flag(
            "mp",
            "compute precision (default: bf16, fp32 on --device cpu)",
            choices=PRECISIONS,
        ),
    ),
    "machine": (
        Flag("gpus", "devices in all", int, required=True),
        Flag("gpus_per_node", "devices per node (default: 8)", int),
        Flag("device", f"one of {', '.join(DEVICES)}", default="h100"),
        Flag(
            "measure_cpu",
            "--device cpu: measure this machine first (FLOP/s of plait's GPT block, gloo "
            "bandwidth and latency, optimizer and fully_shard host costs, with --gpus local "
            "workers; about a minute) instead of the preset's measure-free defaults",
            action="store_true",
        ),
        Flag(
            "calibrate",
            "fit the device's figures to a finished plait train run (its config.json and "
            "metrics.jsonl: measured step time and peak memory against the prediction; "
            "repeat for several runs) before predicting; --device the run's kind (cpu for a "
            "CPU run: this machine is then measured at the run's workers and --gpus, about "
            "half a minute)",
            metavar="RUN_DIR",
            action="append",
        ),
        Flag("memory_gib", "override: memory per device, GiB", float),
        Flag("tflops", "override: dense bf16 peak, TFLOP/s", float),
        Flag("tflops_fp32", "override: dense fp32 peak, TFLOP/s", float),
        Flag("intra_node_bw", "override: GB/s per device, in a node", float),
        Flag("inter_node_bw", "override: GB/s per device, across", float),
        Flag(
            "efficiency",
            f"achievable fraction of peak (default: {EFFICIENCY}, calibrated)",
            float,
            EFFICIENCY,
        ),
        Flag(
            "kernels",
            "whose kernels run the blocks (the cost model's software stacks; default: plait)",
            default="plait",
            choices=STACK_NAMES,
        ),
        Flag(
            "tp_overlap",
            "TP collectives: none (synchronous, plait's), async (Megatron's: decomposed "
            "into GEMMs) or micro-pipeline (torch's async TP, torchtitan's)",
            default="none",
            choices=TP_OVERLAPS,
        ),
        Flag(
            "compile",
            "price torch.compile of each block (plait train --compile): fused norms, "
            "activation, rope and residual additions, fewer kernel launches; with "
            "--kernels torchtitan the loss too (torchtitan compiles it with the blocks)",
            action="store_true",
        ),
        Flag(
            "float8",
            "price torchao Float8Linears in the blocks (plait train --float8: tensorwise): "
            "fp8 GEMMs at the device's fp8 peak plus their casts (H100, H200, B200 only); "
            "tensorwise with --kernels torchtitan also gathers tp's inputs in fp8 (as "
            "torchtitan's Float8 TP does)",
            default="none",
            choices=FLOAT8_RECIPES,
        ),
        Flag(
            "float8_all_gather",
            "fully_shard all-gathers the blocks' weights in fp8 (with --float8 tensorwise; "
            "plait train --float8 does under fully_shard)",
            action="store_true",
        ),
        Flag(
            "param_gather_overlap",
            "ZeRO's parameter all-gather beside the next forward (Megatron's)",
            action="store_true",
        ),
        Flag(
            "ep_inner",
            "ep groups of consecutive ranks (Megatron-Core's expert mesh with expert "
            "tensor parallelism 1), not strided over tp as plait's mesh lays them",
            action="store_true",
        ),
        Flag(
            "grad_reduce_bf16",
            "reduce gradients in the compute dtype, not fp32 (Megatron-Core's default)",
            action="store_true",
        ),
        Flag("memory_fraction", "usable fraction of device memory (default: 0.9)", float, 0.9),
    ),
    "layout (plait train's flags; given ones are fixed)": (
        *(
            Flag(name, _LAYOUT_HELP.get(name), int)
            for name in (
                *LAYOUT_DIMS,
                "stages_per_rank",
                "end_blocks",
                "max_active_stages",
                "microbatches",
            )
        ),
        Flag(
            "cp_method",
            "context-parallel attention: keys and values all-gathered, passed around a "
            "ring, or exchanged all-to-all by heads (default: each searched with --cp > 1)",
            choices=CP_METHODS,
        ),
        Flag(EP, "expert-parallel ranks, taken from dp_shard (with --experts)", int),
        Flag("schedule", "a pipeline schedule (default: all searched)"),
        Flag("ac", choices=AC_SEARCHED),
        Flag("reshard_after_forward", action=argparse.BooleanOptionalAction),
        Flag("sequence_parallel", action=argparse.BooleanOptionalAction),
    ),
    "other frameworks (predictions for published runs: plait train runs neither)": (
        Flag(
            "zero",
            "also search ZeRO-1 / ZeRO-2 data parallelism (DeepSpeed; Megatron-LM's "
            "distributed optimizer is ZeRO-1): parameters replicated over dp_replicate x cp, "
            "optimizer state (and ZeRO-2 gradients) sharded over them",
            int,
            choices=(1, 2),
        ),
        Flag(
            "recipe",
            "whose activations the memory model counts: plait's (torch tensor "
            "parallelism saves all-gathered linear inputs) or Megatron-LM's (Korthikanti et "
            "al. 2022: sequence-parallel activations saved split; default: plait)",
            default="plait",
            choices=RECIPES,
        ),
    ),
    "output": (
        Flag("top", "layouts shown (0: all that fit)", int, 10),
        Flag("json", "a JSON list instead of the table", action="store_true"),
        Flag(
            "batch",
            "evaluate each entry of FILE (a JSON list of objects, or JSON lines), each a set "
            'of this command\'s flags by name (e.g. {"gpus": 64, "tp": 4, "pp": 4}) added to '
            "the command line's, in one process; prints one JSON list: per entry its flags "
            "and --json's layouts, or its error",
            metavar="FILE",
        ),
        Flag(
            "dry_run",
            "also run plait's real training step (plait's GPT, or plait train's Llama of "
            "--hf-config or of --preset llama3-8b / llama3-70b) for rank 0 of the best layout "
            "plait can dry-run (fake process group and tensors; a pipeline: "
            "without tensor parallelism, schedules with full backwards, rank 0's own "
            "actions) and compare its measured peak memory with the prediction",
            action="store_true",
        ),
    ),
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add :data:`PLAN_FLAGS` to ``parser``, group by group, in the table's order."""
    for title, flags in PLAN_FLAGS.items():
        group = parser.add_argument_group(title)
        exclusive: argparse._MutuallyExclusiveGroup | None = None  # made at its first flag
        for row in flags:
            target: argparse._ArgumentGroup = group
            if row.exclusive:
                exclusive = exclusive or group.add_mutually_exclusive_group()
                target = exclusive
            target.add_argument(flag(row.name), *row.aliases, **row.options())
