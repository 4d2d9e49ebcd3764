"""``plait train``, ``plait sample`` and ``plait export``: their arguments and what they run.

The ``plait`` command (:mod:`plait.cli`) mounts these beside ``plait plan``; :func:`main`
runs them on their own. Every ``plait train`` flag is a field of
:class:`~plait.train.config.TrainConfig` (dashes for underscores); flags override
``--config`` (a flat TOML file) and, with ``--resume``, the configuration saved in the run
directory. The configuration is resolved and checked (:func:`~plait.train.resolve.resolve`)
before any worker starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from plait.layout import CP
from plait.train.checkpointing import (
    CheckpointDamaged,
    check_settings,
    checkpoint_step,
    latest_checkpoint,
    read_info,
)
from plait.train.config import (
    CHOICES,
    DEFAULTS,
    ConfigError,
    RunConfig,
    TrainConfig,
    flag,
    load_toml,
)
from plait.train.config import from_mapping as config_from_mapping
from plait.train.export import export_run
from plait.train.hf import check_init_from, with_default_model_config
from plait.train.launch import WorkerFailed, launch, under_torchrun
from plait.train.loggers import check_logging
from plait.train.loop import CONFIG_FILE, model_settings
from plait.train.metrics import FILENAME as METRICS_FILENAME
from plait.train.replicas import group_run_dir, metrics_run_dir, replicas_config
from plait.train.resolve import resolve
from plait.train.restart import check_torchrun_restarts, mark_torchrun_job, restarted
from plait.train.sample import sample_command
from plait.train.snapshots import check_snapshots, latest_snapshot
from plait.train.tokenizer_command import tokenizer_command
from plait.train.train_flags import FLAGS, TRAIN_HELP
from plait.train.worker import default_run_dir

__all__ = ["PlanCheck", "Planner", "add_parsers", "build_config", "main", "run"]

#: What ``plait train --plan`` prints before launching, for a resolved configuration: the
#: planner's prediction, given by the command that has the planner (:mod:`plait.cli`).
Planner = Callable[[TrainConfig], str]
#: What ``plait train --plan`` prints after the run: the prediction beside the step times the
#: session measured (in order), given by the command that has the planner.
PlanCheck = Callable[[TrainConfig, list[float]], str]


def _add_flag(group: argparse._ArgumentGroup, name: str, text: str) -> None:
    option, default = flag(name), getattr(DEFAULTS, name)
    if isinstance(default, bool):
        # --resume only: a run starts fresh unless told (no --no-resume).
        action = "store_true" if name == "resume" else argparse.BooleanOptionalAction
        group.add_argument(option, action=action, help=f"{text} (default: {default})")
    elif name in CHOICES:
        shown = f" (default: {default})" if default else ""
        group.add_argument(option, choices=CHOICES[name], help=text + shown)
    else:
        shown = "" if default in ("", 0) else f" (default: {default})"
        metavar = option[2:].upper()
        group.add_argument(option, type=type(default), metavar=metavar, help=text + shown)


def add_parsers(commands: Any, *, planner: bool = False) -> None:
    """Add ``train``, ``sample`` and ``export`` to an ``argparse`` sub-command set; with
    ``planner``, ``train`` takes ``--plan`` (:func:`run` then needs a :data:`Planner`)."""
    train = commands.add_parser(
        "train",
        help="train a small GPT with any composition of parallelisms",
        description=TRAIN_HELP,
        argument_default=argparse.SUPPRESS,  # only flags actually given override
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", help="a flat TOML file of these settings (flags win)")
    if planner:
        train.add_argument(
            "--plan",
            action="store_true",
            help="first print the planner's prediction for this layout (memory per rank, "
            "bubble, tokens/s; `plait plan`), warning when it will not fit, and after the "
            "run the predicted step time beside the measured one",
        )
    for title, flags in FLAGS.items():
        group = train.add_argument_group(title)
        for name, text in flags:
            _add_flag(group, name, text)
    sample = commands.add_parser("sample", help="print text generated from a run's checkpoint")
    sample.add_argument("--run-dir", required=True, help="the run to sample from")
    sample.add_argument("--checkpoint", help="a checkpoint directory (default: the latest)")
    sample.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    sample.add_argument("--tokens", type=int, default=400, help="tokens to generate")
    sample.add_argument("--temperature", type=float, default=0.8)
    sample.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: all)")
    sample.add_argument("--seed", type=int, default=0)
    tokenizer = commands.add_parser("tokenizer", help="train a byte-level BPE tokenizer")
    actions = tokenizer.add_subparsers(dest="action", metavar="{train}", required=True)
    bpe = actions.add_parser(
        "train",
        help="train a byte-level BPE on --data's files",
        description="Train a byte-level BPE (special tokens <|endoftext|>, <|im_start|>, "
        "<|im_end|>) on the files plait train --data reads; write tokenizer.json and, beside "
        "it, tokenizer_config.json with a ChatML chat template. Use it with --tokenizer.",
    )
    bpe.add_argument("--data", required=True, help="a file or directory, as plait train's")
    bpe.add_argument("--vocab", type=int, required=True, help="ids in all (at least 259)")
    bpe.add_argument("--out", required=True, help="the tokenizer.json to write")
    bpe.add_argument("--text-field", default="text", help="a record's text field")
    bpe.add_argument("--messages-field", default="messages", help="a record's chat field")
    export = commands.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face model directory (safetensors)",
        description="Write a Llama-family run's checkpoint (any layout) as a directory that "
        "transformers' AutoModelForCausalLM.from_pretrained reads: config.json, "
        "model.safetensors (or shards and their index) and the run's tokenizer files.",
    )
    export.add_argument("--run-dir", required=True, help="the run to export")
    export.add_argument("--out", required=True, help="the directory to write (new or empty)")
    export.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        help="split the weights into files of at most this size (default: 5GB)",
    )


def build_config(flags: dict[str, Any]) -> TrainConfig:
    """Defaults < ``--config`` TOML < the run's saved configuration (``--resume``) < flags."""
    flags = dict(flags)
    path = flags.pop("config", None)
    cfg = load_toml(path) if path else TrainConfig()
    run_dir = flags.get("run_dir", cfg.run_dir)
    if flags.get("resume", cfg.resume):
        if not run_dir:
            raise ConfigError("--resume needs --run-dir: the run directory to continue")
        saved = Path(run_dir) / CONFIG_FILE
        if not saved.is_file() and replicas_config(run_dir).is_file():
            saved = replicas_config(run_dir)  # a --replica-groups run
        if not saved.is_file():
            raise ConfigError(f"--resume: {saved} does not exist; is {run_dir} a plait run?")
        cfg = config_from_mapping(json.loads(saved.read_text()), cfg)
        # --stop-after stopped the session that gave it; this one runs on unless told.
        cfg = cfg.replace(resume=True, run_dir=run_dir, stop_after=0)
    return config_from_mapping(flags, cfg)


def _check_paths(cfg: TrainConfig) -> None:
    """Refuse missing data files, and a run directory whose checkpoints do not fit: a
    resume without one, a new run over one, another model's (so the whole ``cfg``: its
    data, run directory and model settings)."""
    if cfg.data and not Path(cfg.data).exists():
        raise ConfigError(f"--data {cfg.data}: no such file or directory")
    if cfg.chat_template and not Path(cfg.chat_template).is_file():
        raise ConfigError(f"--chat-template {cfg.chat_template}: no such file")
    if not cfg.run_dir:
        return
    latest, snapshot = _latest_saves(cfg.run)  # a snapshot: of a run that failed here
    if cfg.resume and latest is None and snapshot is None:
        raise ConfigError(f"--resume: {cfg.run_dir} holds no complete checkpoint to continue from")
    if not cfg.resume and (latest or snapshot) is not None:
        held = "checkpoints" if snapshot is None else f"snapshot {snapshot} (in memory)"
        raise ConfigError(
            f"--run-dir {cfg.run_dir} already holds a run's {held}: add --resume to "
            "continue it, or choose another --run-dir"
        )
    latest = latest or snapshot
    if latest is None:
        return
    try:
        read_info(latest)
    except (OSError, ValueError, KeyError):
        return  # unreadable: the workers check the files, and fall back to an older one
    check_settings(latest, model_settings(cfg))  # a checkpoint of another model: refused


def _train(
    flags: dict[str, Any], planner: Planner | None, plan_check: PlanCheck | None = None
) -> None:
    flags = dict(flags)
    show_plan = flags.pop("plan", False)
    cfg = with_default_model_config(build_config(flags))  # --init-from alone: its config
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else None
    cfg = resolve(cfg, world)
    check_snapshots(cfg)
    if under_torchrun():  # torchrun's --max-restarts; a restarted worker resumes
        cfg = restarted(check_torchrun_restarts(cfg))
        if cfg.max_restarts:
            mark_torchrun_job(cfg.run_dir)
    elif not cfg.run_dir:
        cfg = cfg.replace(run_dir=default_run_dir())
    _check_paths(cfg)
    check_logging(cfg)
    warnings = check_init_from(cfg)
    if os.environ.get("RANK", "0") == "0":
        for warning in warnings:
            print(f"plait train: warning: {warning}", file=sys.stderr, flush=True)
        print(_describe(cfg), file=sys.stderr, flush=True)
        if show_plan and planner is not None:
            print(planner(cfg), file=sys.stderr, flush=True)
    metrics = metrics_run_dir(cfg) / METRICS_FILENAME  # --plan compares with it
    written = metrics.stat().st_size if metrics.exists() else 0  # by earlier sessions
    try:
        launch(cfg)
    except WorkerFailed as err:
        raise WorkerFailed(f"{err}{_resume_hint(cfg.run)}") from None
    if show_plan and plan_check is not None and os.environ.get("RANK", "0") == "0":
        print(plan_check(cfg, _session_step_times(metrics, written)), file=sys.stderr)


def _session_step_times(metrics: Path, offset: int) -> list[float]:
    """The step times this session appended to ``metrics`` (metrics.jsonl) after byte
    ``offset``, in order."""
    if not metrics.exists():
        return []
    with open(metrics, "rb") as f:
        f.seek(offset)
        rows = [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
    return [float(row["step_time"]) for row in rows if "step_time" in row]


def _latest_saves(run: RunConfig) -> tuple[Path | None, Path | None]:
    """The run's newest checkpoint (the run directory's, else a replica group's first) and
    this machine's newest snapshot of it."""
    latest = latest_checkpoint(run.run_dir)
    for group in range(run.replica_groups if run.replica_groups > 1 else 0):
        latest = latest or latest_checkpoint(group_run_dir(run.run_dir, group))
    return latest, latest_snapshot(run.run_dir)


def _resume_hint(run: RunConfig) -> str:
    """How to continue the failed run ``run`` from its last checkpoint ("" if none)."""
    latest, snapshot = _latest_saves(run)
    last_step = -1 if latest is None else checkpoint_step(latest)
    if snapshot is not None and checkpoint_step(snapshot) > last_step:
        return (
            f"\nthe last snapshot is {snapshot} (in this machine's memory, newer than any "
            f"checkpoint); continue from it on this machine with: "
            f"plait train --run-dir {run.run_dir} --resume"
        )
    if latest is None:
        return ""
    return (
        f"\nthe last checkpoint is {latest}; continue from it with: "
        f"plait train --run-dir {run.run_dir} --resume"
    )


def _describe(cfg: TrainConfig) -> str:
    """One line naming what the run trains and how (it describes every group of ``cfg``)."""
    dims = " ".join(
        f"{name}={size}" for name, size in cfg.mesh_dims.items() if name != CP or size > 1
    )
    pipe = f" schedule={cfg.schedule} microbatches={cfg.microbatches}" if cfg.pp > 1 else ""
    sp = f" sequence_parallel={cfg.sequence_parallel}" if cfg.tp > 1 else ""
    ep = f" ep={cfg.ep}" if cfg.ep > 1 else ""
    moe = f", MoE {cfg.experts} experts top-{cfg.top_k}" if cfg.experts else ""
    model = f"GPT {cfg.n_layer} layers x d{cfg.d_model}{moe}"
    if cfg.model_config:
        model = f"model of --model-config {cfg.model_config}"
    return (
        f"plait train: {cfg.nproc} x {cfg.device} worker(s), {dims}{ep}{pipe}{sp}, ac={cfg.ac}, "
        f"mp={cfg.mp}; {model}, "
        f"{cfg.batch_size} x {cfg.seq_len} tokens per step, {cfg.steps} steps"
    )


def run(
    command: str,
    args: dict[str, Any],
    planner: Planner | None = None,
    plan_check: PlanCheck | None = None,
) -> int:
    """Run ``command`` (``train``, ``sample`` or ``export``) with its parsed ``args``;
    returns the exit status: 2 for a configuration that cannot run, 1 for a failed run,
    130 when interrupted. ``planner``: what ``--plan`` prints before the run (see
    :func:`add_parsers`); ``plan_check``: what it prints after it."""
    try:
        if command == "train":
            _train(args, planner, plan_check)
        elif command == "export":
            out = export_run(args["run_dir"], args["out"], args.get("step"), args["max_shard_size"])
            print(
                f"plait export: wrote {out}; load it with transformers' "
                f"AutoModelForCausalLM.from_pretrained({str(out)!r})"
            )
        elif command == "tokenizer":
            print(tokenizer_command(**args))
        else:
            print(sample_command(**args))
    except ConfigError as err:
        print(f"plait {command}: error: {err}", file=sys.stderr)
        return 2
    except (WorkerFailed, CheckpointDamaged) as err:
        print(f"plait {command}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        hint = " (continue it with --resume and the same --run-dir)" if command == "train" else ""
        print(f"plait {command}: interrupted{hint}", file=sys.stderr)
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``plait train``, ``plait sample`` and ``plait export`` without the planner
    (:func:`plait.cli.main` is the whole ``plait`` command)."""
    parser = argparse.ArgumentParser(prog="plait", description="composable parallelism for PyTorch")
    add_parsers(parser.add_subparsers(dest="command", metavar="{train,sample,export,tokenizer}"))
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command is None:
        parser.print_help()
        return 2
    return run(command, args)
