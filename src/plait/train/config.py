"""The training configuration: one frozen dataclass, filled from defaults, TOML and flags.

Precedence, lowest first: the defaults below, a TOML file (``--config``), the configuration
saved in the run directory (when resuming; except ``stop_after``, which applies only to the
session that gives it), then command-line flags. Zero in a field marked
*auto* means "derive it" (see :func:`plait.train.resolve.resolve`), which also refuses
impossible combinations; the resolved configuration, with every auto field filled in, is
what the run directory records.

The TOML file is flat: the keys are the field names (``dp_shard = 2``), dashes allowed
(``dp-shard = 2``), so a TOML file and the command line speak the same words.

**Groups.** The flat :class:`TrainConfig` stays the one source (its constructor, TOML keys,
``replace``, ``to_dict`` and the run directory's config.json); read-only properties give
its fields by concern, each a small frozen dataclass built from them: ``cfg.corpus``
(:class:`DataConfig`), ``cfg.optim`` (:class:`OptimConfig`), ``cfg.balance``
(:class:`BalanceConfig`), ``cfg.execution`` (:class:`ExecutionConfig`, which holds
``cfg.layout``, a :class:`plait.layout.Layout`), ``cfg.run`` (:class:`RunConfig`) and
``cfg.logging`` (:class:`LogConfig`); the model's fields (:data:`MODEL_FIELDS`) are read by
the model's builders. A function that needs one concern takes its group, so its signature
says what it depends on. A group's fields have the same names as TrainConfig's, so a
public function that takes a group also accepts the whole TrainConfig (annotated
``OptimConfig | TrainConfig``: the body may read only names both have, which mypy checks).
Every field belongs to exactly one group or to :data:`MODEL_FIELDS`
(tests/test_train_config_groups.py): a new field must be placed in one.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from plait.layout import CP_METHODS, LAYOUT_FIELDS, Layout, flag

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = [
    "AC_MODES",
    "AUX_LOSS_TYPES",
    "CHOICES",
    "DEFAULTS",
    "DEVICES",
    "GROUPS",
    "MODEL_FIELDS",
    "PRECISIONS",
    "WANDB_MODES",
    "BalanceConfig",
    "ConfigError",
    "DataConfig",
    "ExecutionConfig",
    "LogConfig",
    "OptimConfig",
    "RunConfig",
    "TrainConfig",
    "flag",
    "from_mapping",
    "load_toml",
]

AC_MODES = ("none", "full", "selective", "offload")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("cpu", "cuda")
AUX_LOSS_TYPES = ("sequence", "global")
WANDB_MODES = ("offline", "online", "disabled")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the flag and the fix."""


_G = TypeVar("_G", bound="_Group")


@dataclass(frozen=True)
class _Group:
    """A group of :class:`TrainConfig`'s fields, under the same names (module docstring).
    No defaults: a group is built from a TrainConfig, which holds them."""

    @classmethod
    def of(cls: type[_G], source: _G | TrainConfig) -> _G:
        """This group of ``source``: ``source`` itself if it is one, else built from the
        same-named attributes of the TrainConfig."""
        if isinstance(source, cls):
            return source
        values = {f.name: getattr(source, f.name) for f in dataclasses.fields(cls)}
        return cls(**values)


@dataclass(frozen=True)
class DataConfig(_Group):
    """The corpus and how it becomes rows (:func:`plait.train.data.load_data`): the files,
    the tokenizer and its vocabulary, the record fields, the chat template, the row length,
    and the seed (the split and batch order draw from it; so do the initial weights)."""

    data: str
    tokenizer: str
    vocab_size: int
    text_field: str
    messages_field: str
    chat_template: str
    seq_len: int
    seed: int


@dataclass(frozen=True)
class OptimConfig(_Group):
    """The optimisation (:mod:`plait.train.optimizer`): how many steps of how many
    sequences, AdamW's learning-rate schedule and weight decay, and gradient clipping."""

    steps: int
    batch_size: int
    lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    grad_clip: float


@dataclass(frozen=True)
class BalanceConfig(_Group):
    """How a mixture of experts balances its load: the auxiliary and router z losses, and
    the auxiliary-loss-free bias (they change training, not the shape of the weights)."""

    aux_loss_coeff: float
    aux_loss_type: str
    z_loss_coeff: float
    bias_update_speed: float


@dataclass(frozen=True)
class ExecutionConfig(_Group):
    """How the ranks run the model: the parallel ``layout`` (every mesh size and its
    choices), the processes and their device, precision and CPU offload, the speed flags
    (``compile``, ``float8``: they change how each rank computes, as the layout does), and
    ``fault_timeout``, how long a collective waits for a peer."""

    layout: Layout
    nproc: int
    device: str
    mp: str
    cpu_offload: bool
    compile: bool
    float8: bool
    fault_timeout: float


@dataclass(frozen=True)
class RunConfig(_Group):
    """The run directory and what a session leaves in it: validation, checkpoints (how
    often, how many kept, written in the background or not; snapshots in memory), resuming,
    restarting after a failed worker, and where this session stops."""

    run_dir: str
    eval_every: int
    eval_batches: int
    ckpt_every: int
    keep: int
    async_checkpoint: bool
    snapshot_every: int
    resume: bool
    max_restarts: int
    stop_after: int
    replica_groups: int


@dataclass(frozen=True)
class LogConfig(_Group):
    """Where rank 0's records go besides metrics.jsonl (:mod:`plait.train.loggers`), and
    the peak FLOP/s its MFU is measured against."""

    tensorboard: bool
    wandb: bool
    wandb_project: str
    wandb_mode: str
    peak_flops: float


#: The groups by the name of their :class:`TrainConfig` property.
GROUPS: dict[str, type[_Group]] = {
    "corpus": DataConfig,
    "optim": OptimConfig,
    "balance": BalanceConfig,
    "execution": ExecutionConfig,
    "run": RunConfig,
    "logging": LogConfig,
}
#: The model's fields, in no group: the model's builders (:mod:`plait.train.loop`) read
#: them, with ``seq_len`` and ``vocab_size`` of the data and the balancing settings.
MODEL_FIELDS = (
    "n_layer",
    "n_head",
    "d_model",
    "dropout",
    "model_config",
    "model_hash",
    "init_from",
    "experts",
    "top_k",
    "shared_experts",
    "expert_hidden",
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run depends on. See ``plait train --help`` for each field."""

    # data and model
    data: str = ""  # "": the Python standard library's own source files
    # "": bytes (vocabulary 256); else a Hugging Face tokenizer.json (plait.train.tokenizer)
    tokenizer: str = ""
    vocab_size: int = 0  # auto: the tokenizer's (set by resolve); more pads the model's
    text_field: str = "text"  # the field of a JSON-lines / Parquet record holding a text
    messages_field: str = "messages"  # ... or a chat: a list of {role, content}
    chat_template: str = ""  # "": the tokenizer's; else a file holding a Jinja template
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    # "": plait's GPT (the flags above); else a Hugging Face config.json of a Llama model
    model_config: str = ""
    model_hash: str = ""  # auto: the sha256 of the model_config file (set by resolve)
    # "": random initial weights; else a Hugging Face model directory (config.json and
    # model.safetensors or its shards) whose weights the run starts from (plait.train.hf).
    # Without model_config on the command line, the directory's config.json is the model's.
    # Ignored when resuming: the run's checkpoint holds its weights.
    init_from: str = ""
    # mixture of experts (0 experts: dense MLPs)
    experts: int = 0
    top_k: int = 2
    shared_experts: int = 0
    expert_hidden: int = 0  # auto: 4 * d_model / (top_k + shared_experts)
    aux_loss_coeff: float = 0.01
    aux_loss_type: str = "sequence"
    z_loss_coeff: float = 0.001
    bias_update_speed: float = 0.0  # 0: no auxiliary-loss-free balancing bias
    # optimisation
    steps: int = 300
    batch_size: int = 32  # global: sequences per optimizer step, over all data-parallel ranks
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0: no clipping
    seed: int = 0
    # parallelism
    # auto: the layout's product when dp_shard is given, else 4 on CPU, the number of GPUs
    # on CUDA (WORLD_SIZE under torchrun)
    nproc: int = 0
    device: str = ""  # auto: cuda when available, else cpu
    dp_replicate: int = 1
    dp_shard: int = 0  # auto: whatever nproc / (pp * dp_replicate * tp) leaves
    pp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    cp_method: str = "allgather"
    sequence_parallel: bool = True  # with tp > 1: norms and activations split by sequence
    schedule: str = "1F1B"
    stages_per_rank: int = 0  # auto: what the schedule holds (1, or 2 for looped schedules)
    end_blocks: int = 0  # with pp: the embedding and the head each weigh this many blocks
    # with pp and fully_shard / replicate: local stages full at once (0: no bound, each
    # stage gathered once per step; torch's runtime schedules hold 3)
    max_active_stages: int = 0
    microbatches: int = 0  # auto: pp * stages_per_rank with a pipeline, else 1
    ac: str = "none"
    mp: str = "fp32"
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    # speed (plait.train.compiled, plait.train.float8)
    compile: bool = False  # torch.compile each block (torchtitan's way)
    float8: bool = False  # torchao float8 linears (emulated on CPU), float8 all-gather
    # run directory, evaluation and checkpoints
    run_dir: str = ""  # auto: runs/<date>-<time>
    eval_every: int = 50  # 0: only before the first and after the last step
    eval_batches: int = 4
    ckpt_every: int = 100  # 0: only after the last step
    keep: int = 2
    # write checkpoints from a staged copy in a background thread (plait.train.checkpointer)
    async_checkpoint: bool = False
    # also a checkpoint every N steps in this machine's memory (plait.train.snapshots)
    snapshot_every: int = 0
    resume: bool = False
    # a failed worker restarts every worker from the latest intact checkpoint, this many
    # times at most (plait.train.restart); under torchrun, torchrun's --max-restarts
    max_restarts: int = 0
    stop_after: int = 0  # stop (with a checkpoint) after this step; 0: run to --steps
    # fault-tolerant replica groups over torchft (plait.train.replicas); 0 or 1: none
    replica_groups: int = 0
    # faults
    fault_timeout: float = 30.0  # seconds a collective may wait for a peer before failing
    # logging (rank 0; metrics.jsonl is always written)
    tensorboard: bool = False  # event files under <run_dir>/tensorboard
    wandb: bool = False  # a Weights & Biases run under <run_dir>/wandb
    wandb_project: str = "plait"
    wandb_mode: str = "offline"  # offline: no network; online: sync as it runs
    peak_flops: float = 0.0  # one device's peak FLOP/s for MFU; 0: auto (table or measured)

    @property
    def layout(self) -> Layout:
        """The parallel layout: this configuration's fields of :class:`plait.layout.Layout`
        (auto fields stay 0 until :func:`plait.train.resolve.resolve` fills them in)."""
        return Layout(**{name: getattr(self, name) for name in LAYOUT_FIELDS})

    @property
    def mesh_dims(self) -> dict[str, int]:
        """The parallel dimensions' sizes by mesh dimension name, outermost first (``tp``
        innermost: its ranks are neighbours, on one node)."""
        return self.layout.sizes

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the ways each global batch is split (the ``tp`` ranks of
        one data-parallel rank share its batch)."""
        return self.layout.dp

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all (1 without a pipeline)."""
        return self.layout.n_stages

    @property
    def local_batch(self) -> int:
        """Sequences each data-parallel rank takes from a global batch."""
        return self.batch_size // self.dp

    # The groups (module docstring): each built from this configuration's own fields.

    @property
    def corpus(self) -> DataConfig:
        """The data group (named ``corpus``: ``data`` is the field naming the files)."""
        return DataConfig.of(self)

    @property
    def optim(self) -> OptimConfig:
        """The optimisation group."""
        return OptimConfig.of(self)

    @property
    def balance(self) -> BalanceConfig:
        """The experts' load-balancing group."""
        return BalanceConfig.of(self)

    @property
    def execution(self) -> ExecutionConfig:
        """The execution group: the layout, the device, precision and speed flags."""
        return ExecutionConfig.of(self)

    @property
    def run(self) -> RunConfig:
        """The run directory group: validation, checkpoints, resuming, stopping."""
        return RunConfig.of(self)

    @property
    def logging(self) -> LogConfig:
        """The logging group."""
        return LogConfig.of(self)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied (names checked, values type-checked)."""
        return from_mapping(changes, base=self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
DEFAULTS = TrainConfig()
#: The fields that take one of a few values (besides the default: ``device`` "" is auto).
CHOICES: dict[str, tuple[str, ...]] = {
    "ac": AC_MODES,
    "mp": PRECISIONS,
    "device": DEVICES,
    "aux_loss_type": AUX_LOSS_TYPES,
    "cp_method": CP_METHODS,
    "wandb_mode": WANDB_MODES,
}


def _coerce(name: str, value: Any) -> Any:
    """``value`` as the type of field ``name``; ints are accepted for float fields."""
    expected = type(getattr(DEFAULTS, name))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not expected:
        raise ConfigError(
            f"config key {name!r} must be a {expected.__name__}, got {value!r} "
            f"({type(value).__name__})"
        )
    return value


def from_mapping(values: Mapping[str, Any], base: TrainConfig | None = None) -> TrainConfig:
    """``base`` (default: the defaults) with ``values`` applied; unknown keys are refused."""
    changes: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in _FIELDS:
            raise ConfigError(f"unknown config key {key!r}; known keys: {', '.join(_FIELDS)}")
        changes[name] = _coerce(name, value)
    return dataclasses.replace(base or TrainConfig(), **changes)


def load_toml(path: str | Path, base: TrainConfig | None = None) -> TrainConfig:
    """The configuration in the flat TOML file ``path``, over ``base``."""
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.strerror})") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--config {path}: not valid TOML: {err}") from err
    nested = [key for key, value in values.items() if isinstance(value, dict)]
    if nested:
        raise ConfigError(
            f"--config {path}: tables ({', '.join(nested)}) are not supported; the file is "
            "flat, one 'key = value' per field, e.g. dp_shard = 2"
        )
    return from_mapping(values, base)
