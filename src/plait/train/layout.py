"""How a run's processes are arranged: fill in the auto fields, refuse what cannot run.

:func:`resolve` runs before any worker starts (and again in each worker under torchrun,
before it joins the process group), so an impossible configuration costs nothing but a
message. Every message names the flag at fault and how to fix it.
"""

from __future__ import annotations

import torch

from plait.pipeline import SCHEDULES, schedule_spec
from plait.train.config import CHOICES, DEFAULTS, ConfigError, TrainConfig, flag
from plait.train.model import GPTConfig

__all__ = ["default_device", "default_nproc", "resolve"]

_CPU_WORKERS = 4


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_nproc(device: str) -> int:
    """Workers on this machine when ``--nproc`` is not given: 4 on CPU, one per GPU."""
    return max(1, torch.cuda.device_count()) if device == "cuda" else _CPU_WORKERS


def resolve(cfg: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """``cfg`` with every auto field filled in, or :class:`ConfigError` saying what to change.

    ``world_size`` is the number of processes that will run (under torchrun, its
    ``WORLD_SIZE``); by default ``cfg.nproc`` (itself auto: see :func:`default_nproc`).
    """
    _check_choices(cfg)
    _check_positive(cfg)
    _check_tensor_parallel(cfg)
    device = cfg.device or default_device()
    _check_device(device)
    nproc = cfg.nproc or default_nproc(device)
    if world_size is None:
        _check_local_gpus(device, nproc)
    world = world_size if world_size is not None else nproc
    if cfg.nproc and world != cfg.nproc:
        raise ConfigError(
            f"--nproc {cfg.nproc} but {world} processes were started (torchrun's WORLD_SIZE): "
            "drop --nproc under torchrun, the launcher decides"
        )
    cfg = cfg.replace(device=device, nproc=world, dp_shard=_dp_shard(cfg, world))
    cfg = cfg.replace(stages_per_rank=_stages_per_rank(cfg))
    _check_stages(cfg)
    cfg = cfg.replace(microbatches=cfg.microbatches or (cfg.n_stages if cfg.pp > 1 else 1))
    _check_batch(cfg)
    _check_features(cfg)
    return cfg


def _check_choices(cfg: TrainConfig) -> None:
    for name, choices in CHOICES.items():
        value = getattr(cfg, name)
        if value not in choices and value != getattr(DEFAULTS, name):  # default: auto
            raise ConfigError(f"{flag(name)} {value}: unknown; choose one of {', '.join(choices)}")
    try:
        schedule_spec(cfg.schedule)
    except ValueError as err:
        raise ConfigError(f"--schedule {cfg.schedule}: {err}") from err


_AT_LEAST_ONE = (
    "steps",
    "batch_size",
    "seq_len",
    "n_layer",
    "n_head",
    "d_model",
    "dp_replicate",
    "pp",
    "tp",
    "keep",
    "eval_batches",
)
_AT_LEAST_ZERO = (  # 0: auto, or off (see TrainConfig)
    "nproc",
    "dp_shard",
    "stages_per_rank",
    "microbatches",
    "warmup",
    "ckpt_every",
    "eval_every",
    "stop_after",
)


def _check_positive(cfg: TrainConfig) -> None:
    for name in _AT_LEAST_ONE:
        if (value := getattr(cfg, name)) < 1:
            raise ConfigError(f"{flag(name)} {value}: must be at least 1")
    for name in _AT_LEAST_ZERO:
        if (value := getattr(cfg, name)) < 0:
            raise ConfigError(f"{flag(name)} {value}: must be 0 (auto) or more")
    if cfg.lr <= 0:
        raise ConfigError(f"--lr {cfg.lr}: must be positive")
    if cfg.fault_timeout <= 0:
        raise ConfigError(f"--fault-timeout {cfg.fault_timeout}: must be positive seconds")
    if cfg.stop_after > cfg.steps:
        raise ConfigError(
            f"--stop-after {cfg.stop_after} is past --steps {cfg.steps}: stop at a step of "
            "the run (--steps is where it ends, and sets the learning-rate schedule)"
        )
    if cfg.d_model % cfg.n_head:
        raise ConfigError(
            f"--d-model {cfg.d_model} is not divisible by --n-head {cfg.n_head}: "
            "pick a d_model that is a multiple of n_head"
        )


def _check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible here; use --device cpu")


def _check_local_gpus(device: str, nproc: int) -> None:
    gpus = torch.cuda.device_count() if device == "cuda" else nproc
    if nproc > gpus:
        raise ConfigError(
            f"--nproc {nproc} CUDA workers but this machine has {gpus} GPU(s): use --nproc "
            f"{gpus} or fewer (or torchrun across several machines)"
        )


def _dp_shard(cfg: TrainConfig, world: int) -> int:
    others = cfg.pp * cfg.dp_replicate * cfg.tp
    tp = f" x --tp {cfg.tp}" if cfg.tp > 1 else ""
    if cfg.dp_shard == 0:  # auto: whatever the other dimensions leave
        if world % others:
            raise ConfigError(
                f"--pp {cfg.pp} x --dp-replicate {cfg.dp_replicate}{tp} = {others} does not "
                f"divide the {world} processes (--nproc {world}): make --nproc a multiple of "
                f"{others}"
            )
        return world // others
    if others * cfg.dp_shard != world:
        raise ConfigError(
            f"--dp-replicate {cfg.dp_replicate} x --dp-shard {cfg.dp_shard} x --pp {cfg.pp}"
            f"{tp} = {others * cfg.dp_shard} processes, but {world} will run (--nproc "
            f"{world}): make the product equal the number of processes (or leave --dp-shard "
            "out: auto)"
        )
    return cfg.dp_shard


def _check_tensor_parallel(cfg: TrainConfig) -> None:
    """Every dimension the tensor-parallel plan splits must divide by ``--tp``."""
    if cfg.tp == 1:
        return
    model = GPTConfig(seq_len=cfg.seq_len, n_head=cfg.n_head, d_model=cfg.d_model)
    # What is split --tp ways ({} is its size), and the flag that changes it. The widths
    # divide whenever the heads do (d_model is a multiple of n_head), so they name the fix
    # only if the model's shape rules change.
    split = {
        "the {} attention heads": (cfg.n_head, "--n-head"),
        "the model width {}": (cfg.d_model, "--d-model"),
        "the MLP width {} (4 x --d-model)": (model.d_mlp, "--d-model"),
        "the vocabulary of {} byte tokens (embedding and head)": (model.vocab_size, ""),
    }
    if cfg.sequence_parallel:
        split["each sequence of {} tokens (sequence parallelism)"] = (cfg.seq_len, "--seq-len")
    # The largest --tp up to the given one that splits everything: the fix to suggest.
    fits = max(t for t in range(1, cfg.tp + 1) if all(n % t == 0 for n, _ in split.values()))
    for what, (size, option) in split.items():
        if size % cfg.tp == 0:
            continue
        fixes = [f"use --tp {fits}" if fits > 1 else "drop --tp"]
        if option:
            fixes.append(f"set {option} to a multiple of {cfg.tp}")
        if option == "--seq-len":
            fixes.append("turn it off with --no-sequence-parallel")
        raise ConfigError(
            f"--tp {cfg.tp} splits {what.format(size)} {cfg.tp} ways, but {size} does not "
            f"divide by {cfg.tp}: {', or '.join(fixes)}"
        )


def _stages_per_rank(cfg: TrainConfig) -> int:
    if cfg.pp == 1:
        if cfg.stages_per_rank > 1:
            raise ConfigError(
                f"--stages-per-rank {cfg.stages_per_rank} needs a pipeline: add --pp 2 or more"
            )
        return 1
    spec = schedule_spec(cfg.schedule)
    fixed = spec.stages_per_rank
    if fixed is not None:
        if cfg.stages_per_rank not in (0, fixed):
            *others, last = [s.name for s in SCHEDULES.values() if s.stages_per_rank is None]
            multi = f"{', '.join(others)} or {last}"
            raise ConfigError(
                f"--schedule {spec.name} runs exactly {fixed} stage(s) per rank, but "
                f"--stages-per-rank is {cfg.stages_per_rank}: drop --stages-per-rank, or use a "
                f"schedule for several stages per rank ({multi})"
            )
        return fixed
    if cfg.stages_per_rank == 1:
        raise ConfigError(
            f"--schedule {spec.name} interleaves several stages per rank, but "
            "--stages-per-rank is 1: use --stages-per-rank 2 (or more), or --schedule 1F1B / "
            "GPipe for one stage per rank"
        )
    return cfg.stages_per_rank or 2


def _check_stages(cfg: TrainConfig) -> None:
    if cfg.n_stages > cfg.n_layer:
        raise ConfigError(
            f"--pp {cfg.pp} x {cfg.stages_per_rank} stage(s) per rank = {cfg.n_stages} pipeline "
            f"stages, but the model has only --n-layer {cfg.n_layer} blocks (a stage needs at "
            f"least one): use --n-layer {cfg.n_stages} or more, or fewer stages"
        )


def _check_batch(cfg: TrainConfig) -> None:
    if cfg.pp > 1:
        fewest = schedule_spec(cfg.schedule).min_microbatches(cfg.n_stages)
        if cfg.microbatches < fewest:
            raise ConfigError(
                f"--schedule {cfg.schedule} over {cfg.n_stages} pipeline stages needs at least "
                f"{fewest} microbatches, got --microbatches {cfg.microbatches}: use "
                f"--microbatches {fewest} or more"
            )
    if cfg.batch_size % cfg.dp:
        fix = cfg.dp * max(1, round(cfg.batch_size / cfg.dp))
        raise ConfigError(
            f"--batch-size {cfg.batch_size} does not split evenly over {cfg.dp} data-parallel "
            f"ranks (--dp-replicate {cfg.dp_replicate} x --dp-shard {cfg.dp_shard}): use a "
            f"multiple of {cfg.dp}, e.g. --batch-size {fix}"
        )
    if cfg.local_batch % cfg.microbatches:
        per_rank = f"{cfg.local_batch} sequences per data-parallel rank"
        raise ConfigError(
            f"--microbatches {cfg.microbatches} does not divide the {per_rank} "
            f"(--batch-size {cfg.batch_size} / {cfg.dp}): use a --microbatches that divides "
            f"{cfg.local_batch}, or a --batch-size that is a multiple of "
            f"{cfg.dp * cfg.microbatches}"
        )


def _check_features(cfg: TrainConfig) -> None:
    if cfg.cpu_offload and cfg.dp_shard == 1:
        raise ConfigError(
            "--cpu-offload keeps fully_shard's parameter shards in host memory, but "
            "--dp-shard is 1 (nothing is sharded): use --dp-shard 2 or more, or drop "
            "--cpu-offload"
        )
