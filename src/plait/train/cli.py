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

from plait.layout import CP, DP_REPLICATE, DP_SHARD, EP, PP, TP
from plait.pipeline import SCHEDULES
from plait.train.checkpointing import (
    CheckpointDamaged,
    check_settings,
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
from plait.train.llama import families_help
from plait.train.loggers import check_logging
from plait.train.loop import CONFIG_FILE, model_settings
from plait.train.metrics import FILENAME as METRICS_FILENAME
from plait.train.presets import preset_names
from plait.train.replicas import group_run_dir, metrics_run_dir, replicas_config
from plait.train.resolve import resolve
from plait.train.restart import check_torchrun_restarts, restarted
from plait.train.sample import sample_command
from plait.train.tokenizer_command import tokenizer_command
from plait.train.worker import default_run_dir

__all__ = ["PlanCheck", "Planner", "add_parsers", "build_config", "main", "run"]

#: What ``plait train --plan`` prints before launching, for a resolved configuration: the
#: planner's prediction, given by the command that has the planner (:mod:`plait.cli`).
Planner = Callable[[TrainConfig], str]
#: What ``plait train --plan`` prints after the run: the prediction beside the step times the
#: session measured (in order), given by the command that has the planner.
PlanCheck = Callable[[TrainConfig, list[float]], str]

_AUTO = "0 = auto"
_TRAIN_HELP = """\
Train plait's small GPT, or a Llama / Mistral / Qwen / Mixtral / Qwen3-MoE model from a
Hugging Face config.json or a preset (--model-config, optionally --init-from its weights),
on text, JSON-lines or Parquet data (--data, --tokenizer), with any composition of plait's
parallelisms: fully_shard (--dp-shard), replicate or HSDP (--dp-replicate), pipelines
(--pp, --schedule), tensor parallelism (--tp, with sequence parallelism), context
parallelism (--cp), mixture-of-experts blocks with expert parallelism (--experts, --ep),
activation checkpointing (--ac) and mixed precision (--mp). The processes form a (pp,
dp_replicate, dp_shard, cp, tp) mesh, tp innermost; --ep splits dp_shard x cp into
(efsdp, ep) for the experts.
Outside torchrun it starts --nproc local workers with torch's elastic launcher; under
torchrun each process is one worker.

Flags override --config (a flat TOML file of the same keys, e.g. dp_shard = 2) and, with
--resume, the run's saved configuration. Impossible layouts are refused before any worker
starts.

examples:
  plait train
  plait train --dp-replicate 2 --dp-shard 2 --ac full --mp bf16
  plait train --pp 2 --dp-shard 2 --schedule 1F1B --microbatches 4
  plait train --tp 2 --dp-shard 2
  plait train --experts 4 --top-k 2 --ep 2 --dp-shard 2
  plait train --run-dir runs/a --steps 600 --stop-after 200
  plait train --run-dir runs/a --resume
  plait train --run-dir runs/a --max-restarts 3 --async-checkpoint --ckpt-every 50
  plait tokenizer train --data texts/ --vocab 8192 --out tok/tokenizer.json
  plait train --data texts/ --tokenizer tok/tokenizer.json
  plait train --init-from path/to/hf-model --tokenizer path/to/hf-model/tokenizer.json
  plait export --run-dir runs/a --out runs/a-hf
"""

# Per group: (field, help). The flag, its type or choices and the default shown come from
# TrainConfig.
_FLAGS: dict[str, list[tuple[str, str]]] = {
    "data and model": [
        (
            "data",
            "a file or a directory of them: text (a file is a document), .jsonl/.json (one "
            "object per line) or .parquet records (default: the Python stdlib)",
        ),
        ("tokenizer", "a Hugging Face tokenizer.json (default: bytes, vocabulary 256)"),
        ("vocab_size", f"the GPT's vocabulary ({_AUTO}: the tokenizer's; more pads it)"),
        ("text_field", "the field of a .jsonl/.parquet record holding its text"),
        (
            "messages_field",
            "the field holding a chat instead: a list of {role, content}; only the assistant "
            "answers take loss",
        ),
        ("chat_template", "a file holding the Jinja chat template (default: the tokenizer's)"),
        ("seq_len", "tokens per sequence"),
        ("n_layer", "transformer blocks"),
        ("n_head", "attention heads"),
        ("d_model", "model width"),
        ("dropout", "dropout probability"),
        (
            "model_config",
            "a Hugging Face config.json, or a preset name, of a model to train instead of "
            f"the GPT; families: {families_help()}; presets: {preset_names()} (its "
            "vocabulary >= the tokenizer's; --n-layer, --n-head, --d-model ignored; a MoE "
            "config brings its own experts, router and balance-loss weight)",
        ),
        (
            "init_from",
            "a Hugging Face model directory (config.json, model.safetensors or shards) to "
            "start from instead of random weights; its config.json is the --model-config "
            "unless one is given (ignored with --resume)",
        ),
    ],
    "mixture of experts": [
        ("experts", "routed experts per block (0: a dense MLP in every block)"),
        ("top_k", "experts each token goes to (dropless: no capacity, none dropped)"),
        ("shared_experts", "experts every token goes through, beside its routed ones"),
        ("expert_hidden", f"each expert's hidden width ({_AUTO}: 4 x d_model / (top_k + shared))"),
        ("aux_loss_coeff", "weight of the load-balancing loss (0: off)"),
        (
            "aux_loss_type",
            "balance per sequence (DeepSeek-V3: the same at any layout and microbatching) or "
            "over each microbatch's global tokens",
        ),
        ("z_loss_coeff", "weight of the router z-loss (0: off)"),
        ("bias_update_speed", "step of the auxiliary-loss-free balancing bias (0: off)"),
    ],
    "optimisation": [
        ("steps", "optimizer steps in all (a resumed run continues to this step)"),
        ("batch_size", "sequences per step, over all data-parallel ranks"),
        ("lr", "peak learning rate (AdamW)"),
        ("min_lr_ratio", "final learning rate as a fraction of --lr (cosine decay)"),
        ("warmup", "linear warm-up steps"),
        ("weight_decay", "AdamW weight decay of matrices"),
        ("grad_clip", "clip the global gradient norm to this (0: never)"),
        ("seed", "seed of weights, data order and dropout"),
    ],
    "parallelism": [
        (
            "nproc",
            f"local worker processes ({_AUTO}: the layout's ranks when --dp-shard is given, "
            "else 4 on CPU, one per GPU)",
        ),
        ("device", "where to train (default: cuda if available, else cpu)"),
        (DP_REPLICATE, "data-parallel replicas (replicate, or HSDP's outer dim)"),
        (DP_SHARD, f"ranks sharding each replica with fully_shard ({_AUTO}: the rest)"),
        (PP, "pipeline-parallel ranks"),
        (TP, "tensor-parallel ranks (neighbouring ranks: keep them on one node)"),
        (EP, "expert-parallel ranks, taken from --dp-shard: the routed experts split over them"),
        (CP, "context-parallel ranks: each sequence split over them"),
        ("cp_method", "context-parallel attention: keys and values gathered, ringed or all-to-all"),
        ("sequence_parallel", "with --tp: norms and activations split by sequence"),
        ("schedule", f"pipeline schedule: {', '.join(SCHEDULES)}"),
        ("stages_per_rank", f"pipeline stages per rank ({_AUTO}: the schedule's)"),
        (
            "end_blocks",
            "with --pp: blocks the embedding and the head each count for in the split of the "
            "blocks among stages (torchtitan's first/last_stage_less_layers, 1 there)",
        ),
        (
            "max_active_stages",
            "with --pp over fully_shard or replicate: the most local stages whose parameters "
            "are gathered at once, a stage gathered again when it comes back (0: no bound, "
            "each gathered once per step; torch's runtime schedules hold 3)",
        ),
        ("microbatches", f"per step: pipeline microbatches or accumulation ({_AUTO})"),
        ("ac", "activation checkpointing of each block"),
        ("mp", "compute precision (bf16: fully_shard mixed precision)"),
        ("cpu_offload", "keep fully_shard's parameter shards in host memory"),
        ("reshard_after_forward", "free each block's gathered parameters after forward"),
    ],
    "speed": [
        (
            "compile",
            "torch.compile each transformer block (inductor); graphs and recompiles are "
            "counted in metrics.jsonl",
        ),
        (
            "float8",
            "train the blocks' linears in float8 (torchao; emulated on CPU), all-gathering "
            "float8 weights under fully_shard (needs the float8 extra)",
        ),
    ],
    "run directory, validation and checkpoints": [
        ("run_dir", "where metrics, checkpoints and plots go (default: runs/<time>)"),
        ("eval_every", "validate every N steps (0: first and last only)"),
        ("eval_batches", "validation batches per evaluation"),
        ("ckpt_every", "checkpoint every N steps (0: last only)"),
        ("keep", "checkpoints kept (the newest)"),
        (
            "async_checkpoint",
            "write checkpoints in the background from a host copy staged between two steps "
            "(at most one write in flight; published only once complete)",
        ),
        ("resume", "continue the run in --run-dir from its latest intact checkpoint"),
        (
            "stop_after",
            "stop after this step, with a checkpoint (0: at --steps); the learning-rate "
            "schedule still spans --steps",
        ),
    ],
    "faults": [
        ("fault_timeout", "seconds a worker waits for a peer before the run fails"),
        (
            "max_restarts",
            "when a worker fails, restart every worker from the latest intact checkpoint, up "
            "to this many times (under torchrun: give torchrun --max-restarts instead); with "
            "--replica-groups: restarts per group",
        ),
        (
            "replica_groups",
            "train this many fault-tolerant replica groups of --nproc workers each over "
            "torchft (the ft extra): a group that dies drops out, the others go on, and it "
            "heals from a live one when it comes back",
        ),
    ],
    "logging (metrics.jsonl is always written)": [
        ("tensorboard", "also write TensorBoard event files to <run-dir>/tensorboard"),
        ("wandb", "also log to a Weights & Biases run (files in <run-dir>/wandb)"),
        ("wandb_project", "the W&B project"),
        ("wandb_mode", "offline: no network, `wandb sync` later; online: upload as it runs"),
        (
            "peak_flops",
            "one device's peak FLOP/s for MFU (default: NVIDIA's dense peak for known GPUs, "
            "a matmul benchmark on CPU)",
        ),
    ],
}


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
        description=_TRAIN_HELP,
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
    for title, flags in _FLAGS.items():
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
    latest = latest_checkpoint(cfg.run_dir)
    for group in range(cfg.replica_groups if cfg.replica_groups > 1 else 0):
        latest = latest or latest_checkpoint(group_run_dir(cfg.run_dir, group))
    if cfg.resume and latest is None:
        raise ConfigError(f"--resume: {cfg.run_dir} holds no complete checkpoint to continue from")
    if not cfg.resume and latest is not None:
        raise ConfigError(
            f"--run-dir {cfg.run_dir} already holds a run's checkpoints: add --resume to "
            "continue it, or choose another --run-dir"
        )
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
    if under_torchrun():  # torchrun's --max-restarts; a restarted worker resumes
        cfg = restarted(check_torchrun_restarts(cfg))
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


def _resume_hint(run: RunConfig) -> str:
    """How to continue the failed run ``run`` from its last checkpoint ("" if none)."""
    latest = latest_checkpoint(run.run_dir)
    for group in range(run.replica_groups if run.replica_groups > 1 else 0):
        latest = latest or latest_checkpoint(group_run_dir(run.run_dir, group))
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
