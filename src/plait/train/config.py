"""The training configuration: one frozen dataclass, filled from defaults, TOML and flags.

Precedence, lowest first: the defaults below, a TOML file (``--config``), the configuration
saved in the run directory (when resuming; except ``stop_after``, which applies only to the
session that gives it), then command-line flags. Zero in a field marked
*auto* means "derive it" (see :func:`plait.train.resolve.resolve`), which also refuses
impossible combinations; the resolved configuration, with every auto field filled in, is
what the run directory records.

The TOML file is flat: the keys are the field names (``dp_shard = 2``), dashes allowed
(``dp-shard = 2``), so a TOML file and the command line speak the same words.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    "PRECISIONS",
    "WANDB_MODES",
    "ConfigError",
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
    resume: bool = False
    stop_after: int = 0  # stop (with a checkpoint) after this step; 0: run to --steps
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
