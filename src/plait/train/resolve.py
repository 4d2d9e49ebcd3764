"""How a run's processes are arranged: fill in the auto fields, refuse what cannot run.

:func:`resolve` runs before any worker starts (and again in each worker under torchrun,
before it joins the process group), so an impossible configuration costs nothing but a
message. Every message names the flag at fault and how to fix it. Which layouts can run is
:mod:`plait.layout`'s to say (the planner asks the same rules); what is ``plait train``'s
own is here: the auto fields (zero: derive it), devices, the launcher's world, and the
settings outside the layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import torch

from plait import layout as rules
from plait.pipeline import SCHEDULES
from plait.train import float8
from plait.train.config import CHOICES, DEFAULTS, ConfigError, TrainConfig, flag
from plait.train.llama import LlamaConfig, LlamaConfigError
from plait.train.model import GPTConfig
from plait.train.model_spec import ModelSpec
from plait.train.presets import config_bytes, config_object, preset_names
from plait.train.replicas import check_replica_groups
from plait.train.tokenizer import load_tokenizer

__all__ = [
    "default_device",
    "default_nproc",
    "gpt_config",
    "llama_config",
    "model_shape",
    "model_spec",
    "resolve",
]


_CPU_WORKERS = 4


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_nproc(device: str) -> int:
    """Workers on this machine when neither ``--nproc`` nor ``--dp-shard`` is given: 4 on
    CPU, one per GPU."""
    return max(1, torch.cuda.device_count()) if device == "cuda" else _CPU_WORKERS


def model_config_bytes(value: str) -> bytes:
    """The ``config.json`` of ``--model-config value`` (a file, or a preset of
    :mod:`plait.train.presets`), or ConfigError."""
    try:
        return config_bytes(value)
    except OSError as err:
        raise ConfigError(
            f"--model-config {value}: cannot read it ({err.strerror}); give a config.json "
            f"or a preset: {preset_names()}"
        ) from err


def model_config_values(value: str) -> dict[str, Any]:
    """The contents of ``--model-config value``'s config.json, or ConfigError."""
    return config_object(model_config_bytes(value), f"--model-config {value}", ConfigError)


def llama_config(cfg: TrainConfig) -> LlamaConfig:
    """The Llama-family configuration of ``--model-config`` (a config.json or a preset),
    or ConfigError saying what is wrong with it (or what it cannot train on: the byte
    data, ``--seq-len``)."""
    path = cfg.model_config
    try:
        llama = LlamaConfig.from_hf(model_config_values(path))
    except LlamaConfigError as err:
        raise ConfigError(f"--model-config {path}: {err}") from err
    vocab, tokenizer = tokenizer_vocab(cfg)
    if llama.vocab_size < vocab:
        raise ConfigError(
            f"--model-config {path}: vocab_size {llama.vocab_size} is smaller than the "
            f"{vocab} ids of the tokenizer ({tokenizer}): use a model whose vocab_size is at "
            f"least {vocab}, or the tokenizer it was made for (--tokenizer)"
        )
    if cfg.seq_len > llama.max_position_embeddings:
        raise ConfigError(
            f"--seq-len {cfg.seq_len} exceeds the model's max_position_embeddings "
            f"{llama.max_position_embeddings} ({path}): use --seq-len "
            f"{llama.max_position_embeddings} or less"
        )
    if llama.sliding_window is not None and cfg.seq_len > llama.sliding_window:
        raise ConfigError(
            f"--seq-len {cfg.seq_len} exceeds the model's sliding_window {llama.sliding_window} "
            f"({path}): plait's attention has no window, so use --seq-len "
            f"{llama.sliding_window} or less (or a config whose sliding_window is null)"
        )
    return llama


def tokenizer_vocab(cfg: TrainConfig) -> tuple[int, str]:
    """The vocabulary the model must hold: ``--vocab-size`` once resolved, else the
    ``--tokenizer``'s; and which file that is (for messages)."""
    name = cfg.tokenizer or "bytes, the default"
    if cfg.vocab_size:
        return cfg.vocab_size, name
    return load_tokenizer(cfg.tokenizer).vocab_size, name


def model_hash(path: str) -> str:
    """The sha256 of the model configuration ``path``'s bytes (:func:`model_config_bytes`:
    a preset's too, so another preset or file is another model)."""
    return hashlib.sha256(model_config_bytes(path)).hexdigest()


def gpt_config(cfg: TrainConfig) -> GPTConfig:
    """The shape of ``cfg``'s GPT: its model flags, its vocabulary the resolved one (by
    default the tokenizer's: :func:`tokenizer_vocab`). Dropout and the balance settings
    keep their defaults: they change no shape (``plait.train.loop.model_config`` adds them)."""
    return GPTConfig(
        vocab_size=tokenizer_vocab(cfg)[0],
        seq_len=cfg.seq_len,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        d_model=cfg.d_model,
        experts=cfg.experts,
        top_k=cfg.top_k,
        shared_experts=cfg.shared_experts,
        expert_hidden=cfg.expert_hidden,
    )


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The model ``plait train`` builds from ``cfg``, described once (what ``plait train
    --plan`` prices and :func:`model_shape` derives from): the Llama of ``--model-config``
    (named as its config.json's ``_name_or_path`` says, by default the ``--model-config``
    value, its source), else the GPT of :func:`gpt_config`. ConfigError as
    :func:`llama_config`'s."""
    if cfg.model_config:
        name = str(model_config_values(cfg.model_config).get("_name_or_path", cfg.model_config))
        return llama_config(cfg).spec(name=name, source=cfg.model_config)
    return gpt_config(cfg).spec()


def model_shape(cfg: TrainConfig) -> rules.ModelShape:
    """What the layout rules need of ``cfg``'s model (:meth:`ModelSpec.shape` of
    :func:`model_spec`): the GPT, whose messages name its flags and its byte tokens
    unless a ``--tokenizer`` is given, or the Llama of ``--model-config``."""
    gpt = not cfg.model_config
    tokens = "byte tokens" if gpt and not cfg.tokenizer else "tokens"
    return model_spec(cfg).shape(cfg.seq_len, from_flags=gpt, tokens=tokens)


def resolve(cfg: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """``cfg`` with every auto field filled in, or :class:`ConfigError` saying what to change.

    ``world_size`` is the number of processes that will run (under torchrun, its
    ``WORLD_SIZE``); by default ``cfg.nproc`` (itself auto: see :func:`default_nproc`).
    """
    _check_choices(cfg)
    _check_positive(cfg)
    cfg = cfg.replace(vocab_size=_vocab_size(cfg))
    shape = model_shape(cfg)
    _refuse(rules.check_tp(shape, cfg.tp, cfg.sequence_parallel))
    device = cfg.device or default_device()
    _check_device(device)
    # Every mesh size given (--dp-shard too): as many workers as the layout has ranks.
    nproc = cfg.nproc or (math.prod(cfg.mesh_dims.values()) if cfg.dp_shard else 0)
    groups = max(cfg.replica_groups, 1) if world_size is None else 1  # launched here, side by side
    nproc = nproc or max(1, default_nproc(device) // groups)
    if world_size is None:
        _check_local_gpus(device, nproc, groups)
    size = world_size if world_size is not None else nproc
    world = rules.World(size, "--nproc", "processes", auto=(rules.DP_SHARD,))
    if cfg.nproc and world.size != cfg.nproc:
        raise ConfigError(
            f"--nproc {cfg.nproc} but {world.size} processes were started (torchrun's "
            "WORLD_SIZE): drop --nproc under torchrun, the launcher decides"
        )
    layout = _fill(cfg, world)
    _refuse(rules.check(layout, shape, cfg.batch_size, world, SCHEDULES))
    digest = model_hash(cfg.model_config) if cfg.model_config else ""
    cfg = cfg.replace(
        device=device, nproc=world.size, model_hash=digest, **dataclasses.asdict(layout)
    )
    _check_features(cfg)
    float8.check(cfg, shape.d_model)
    check_replica_groups(cfg)
    return cfg


def _vocab_size(cfg: TrainConfig) -> int:
    """``--vocab-size``, by default the tokenizer's; never smaller than the tokenizer's."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    if cfg.vocab_size and cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"--vocab-size {cfg.vocab_size} is smaller than the {tokenizer.vocab_size} ids of "
            f"the tokenizer ({cfg.tokenizer or 'bytes, the default'}): drop --vocab-size (it "
            "follows the tokenizer) or give one at least as large"
        )
    if cfg.model_config and cfg.vocab_size not in (0, tokenizer.vocab_size):
        # (A resumed run's recorded value is the tokenizer's: it passes.)
        raise ConfigError(
            f"--vocab-size {cfg.vocab_size} with --model-config {cfg.model_config}: the "
            "model's vocabulary is its config's vocab_size; drop --vocab-size"
        )
    return cfg.vocab_size or tokenizer.vocab_size


def _refuse(reasons: list[rules.Reason]) -> None:
    if reasons:
        raise ConfigError(reasons[0].message)


def _fill(cfg: TrainConfig, world: rules.World) -> rules.Layout:
    """``cfg``'s layout with the auto fields filled in: ``dp_shard`` takes the processes
    the other dimensions leave, the schedule sets the stages per rank, and the stages the
    microbatches. ConfigError when the sizes cannot fill ``world``."""
    sizes: dict[str, int | None] = {**cfg.mesh_dims, rules.DP_SHARD: cfg.dp_shard or None}
    _refuse(rules.check_world(sizes, world))
    layout = cfg.layout.with_sizes(next(rules.grids(sizes, world.size)))
    spec = rules.find_schedule(SCHEDULES, cfg.schedule)
    assert spec is not None  # _check_choices refused an unknown one
    v = cfg.stages_per_rank or rules.default_stages_per_rank(spec, cfg.pp)
    layout = dataclasses.replace(layout, stages_per_rank=v)
    return dataclasses.replace(
        layout, microbatches=cfg.microbatches or rules.default_microbatches(layout)
    )


def _check_choices(cfg: TrainConfig) -> None:
    for name, choices in CHOICES.items():
        value = getattr(cfg, name)
        if value not in choices and value != getattr(DEFAULTS, name):  # default: auto
            raise ConfigError(f"{flag(name)} {value}: unknown; choose one of {', '.join(choices)}")
    _refuse(rules.check_schedule(SCHEDULES, cfg.schedule))


_AT_LEAST_ONE = (
    "steps",
    "batch_size",
    "seq_len",
    "n_layer",
    "n_head",
    "d_model",
    rules.DP_REPLICATE,
    rules.PP,
    rules.TP,
    rules.EP,
    rules.CP,
    "top_k",
    "keep",
    "eval_batches",
)
_AT_LEAST_ZERO = (  # 0: auto, or off (see TrainConfig)
    "nproc",
    "vocab_size",
    rules.DP_SHARD,
    "stages_per_rank",
    "end_blocks",
    "max_active_stages",
    "microbatches",
    "warmup",
    "ckpt_every",
    "snapshot_every",
    "eval_every",
    "stop_after",
    "max_restarts",
    "replica_groups",
    "experts",
    "shared_experts",
    "expert_hidden",
    "aux_loss_coeff",
    "z_loss_coeff",
    "bias_update_speed",
)


def _check_positive(cfg: TrainConfig) -> None:
    for name in _AT_LEAST_ONE:
        if (value := getattr(cfg, name)) < 1:
            raise ConfigError(f"{flag(name)} {value}: must be at least 1")
    for name in _AT_LEAST_ZERO:
        if (value := getattr(cfg, name)) < 0:
            raise ConfigError(f"{flag(name)} {value}: must be 0 or more")
    if cfg.lr <= 0:
        raise ConfigError(f"--lr {cfg.lr}: must be positive")
    if cfg.fault_timeout <= 0:
        raise ConfigError(f"--fault-timeout {cfg.fault_timeout}: must be positive seconds")
    if cfg.stop_after > cfg.steps:
        raise ConfigError(
            f"--stop-after {cfg.stop_after} is past --steps {cfg.steps}: stop at a step of "
            "the run (--steps is where it ends, and sets the learning-rate schedule)"
        )
    if cfg.experts and cfg.top_k > cfg.experts:
        raise ConfigError(
            f"--top-k {cfg.top_k}: each token goes to {cfg.top_k} different experts, but "
            f"--experts is {cfg.experts}: use --top-k {cfg.experts} or less, or more --experts"
        )
    if cfg.d_model % cfg.n_head:
        raise ConfigError(
            f"--d-model {cfg.d_model} is not divisible by --n-head {cfg.n_head}: "
            "pick a d_model that is a multiple of n_head"
        )


def _check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible here; use --device cpu")


def _check_local_gpus(device: str, nproc: int, groups: int = 1) -> None:
    """Each local worker needs a GPU of its own (``groups`` replica groups of ``nproc``)."""
    gpus = torch.cuda.device_count() if device == "cuda" else nproc * groups
    if nproc * groups > gpus:
        each = f" in each of {groups} replica groups" if groups > 1 else ""
        raise ConfigError(
            f"--nproc {nproc} CUDA workers{each} but this machine has {gpus} GPU(s): use "
            f"--nproc {max(gpus // groups, 1)} or fewer (or torchrun across several machines)"
        )


def _check_features(cfg: TrainConfig) -> None:
    if cfg.model_config and cfg.experts:
        raise ConfigError(
            f"--experts {cfg.experts} with --model-config: the model's config.json says "
            "whether it has experts (Mixtral's num_local_experts, Qwen3-MoE's num_experts) "
            "and how many; drop --experts"
        )
    if cfg.model_config and cfg.dropout:
        raise ConfigError(
            f"--dropout {cfg.dropout} with --model-config: the Llama model has no dropout "
            "(as its Hugging Face configs); drop --dropout"
        )
    if cfg.cp > 1 and cfg.dropout:
        raise ConfigError(
            f"--dropout {cfg.dropout} with --cp {cfg.cp}: context-parallel attention has no "
            "attention dropout (its masks span ranks): use --dropout 0, or --cp 1"
        )
    if cfg.cp > 1 and cfg.experts and cfg.aux_loss_coeff and cfg.aux_loss_type == "sequence":
        raise ConfigError(
            f"--aux-loss-type sequence balances each whole sequence, but --cp {cfg.cp} splits "
            "every sequence over ranks: use --aux-loss-type global (over the global batch), "
            "or --aux-loss-coeff 0"
        )
    if cfg.compile and cfg.ac == "selective":
        raise ConfigError(
            "--compile with --ac selective: selective checkpointing picks the matmul "
            "outputs to keep through a torch dispatch mode, which torch.compile cannot "
            "trace; use --ac full (recomputes the compiled block) or --ac none, or drop "
            "--compile"
        )
    if cfg.cpu_offload and cfg.dp_shard * cfg.cp == 1:
        raise ConfigError(
            "--cpu-offload keeps fully_shard's parameter shards in host memory, but "
            "--dp-shard is 1 (nothing is sharded): use --dp-shard 2 or more, or drop "
            "--cpu-offload"
        )
