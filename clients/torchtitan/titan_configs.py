"""torchtitan configurations for the check: a config registry module for ``--module``.

Each function returns a ``Trainer.Config`` built from torchtitan's own
``llama3_debugmodel`` (the debug Llama: 6 layers, dim 256, vocab 2048) made small enough
for CPU processes. This is torchtitan configuration, not adaptation: the same config runs
on torch and on plait. Parallelism degrees, schedules, reshard policy, checkpointing and
compile are set with torchtitan's command-line flags by ``check.py``.
"""

from __future__ import annotations

from pathlib import Path

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.models.qwen3 import model_registry as qwen3_registry
from torchtitan.trainer import Trainer

HERE = Path(__file__).resolve().parent
TOKENIZER = HERE / "assets" / "tokenizer"
DATA = HERE / ".work" / "data"  # written by check.py (dataset.py)


def base() -> Trainer.Config:
    """Debug Llama, fp32, plain cross-entropy, no activation checkpointing."""
    config = llama3_debugmodel()
    assert config.model_spec is not None
    config.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    config.activation_checkpoint = None
    config.hf_assets_path = str(TOKENIZER)
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(DATA))
    config.training.seq_len = 64
    config.training.local_batch_size = 4
    config.training.steps = 3
    config.training.dtype = "float32"
    config.training.mixed_precision_param = "float32"
    config.training.mixed_precision_reduce = "float32"
    # torchtitan's default ("spmd_types") passes dp_mesh_dims, which torch 2.13's own
    # fully_shard cannot run; "partial_dtensor" is the path torch 2.13 runs.
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.disable_cuda_graphs = True  # torchtitan refuses them with PP
    config.lr_scheduler.warmup_steps = 1
    config.debug.seed = 0
    # debug.deterministic stays off: it re-installs a compiled flex_attention, undoing the
    # CPU attention shim; CPU kernels here are deterministic without it.
    config.checkpoint.interval = 2
    config.comm.init_timeout_seconds = 120
    config.comm.train_timeout_seconds = 300
    config.comm.trace_buf_size = 0
    return config


def spmd_types() -> Trainer.Config:
    """``base`` on torchtitan's default SPMD backend (fully_shard with dp_mesh_dims)."""
    config = base()
    config.parallelism.spmd_backend = "spmd_types"
    return config


def full_ac() -> Trainer.Config:
    config = base()
    config.activation_checkpoint = FullAC.Config()
    return config


def selective_ac() -> Trainer.Config:
    config = base()
    config.activation_checkpoint = SelectiveAC.Config()
    return config


def chunked_loss() -> Trainer.Config:
    """torchtitan's default loss: cross-entropy over chunks of the head's input."""
    config = base()
    assert config.model_spec is not None
    config.loss = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    )
    return config


def moe() -> Trainer.Config:
    """``base`` on torchtitan's DeepSeek-V3 debug model: a mixture of experts (8 routed and
    2 shared experts per MoE layer); ``--parallelism.expert_parallel_degree`` shards them."""
    config = base()
    config.model_spec = deepseek_v3_registry("debugmodel")
    config.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    return config


def moe_no_bias_balance() -> Trainer.Config:
    """``moe`` without the auxiliary-loss-free bias balancing (``load_balance_coeff`` None):
    the row that shows where the pipelined MoE row's difference comes from."""
    config = moe()
    assert config.model_spec is not None
    for layer in config.model_spec.model.layers:
        moe_config = getattr(layer, "moe", None)
        if moe_config is not None:
            moe_config.load_balance_coeff = None
    return config


def qwen3_moe() -> Trainer.Config:
    """``base`` on torchtitan's Qwen3 debug MoE (``debugmodel_moe``): top-k routing with
    torchtitan's load-balancing hook, no shared experts."""
    config = base()
    config.model_spec = qwen3_registry("debugmodel_moe")
    config.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    return config


def cp() -> Trainer.Config:
    """``base`` for context parallelism (``--parallelism.context_parallel_degree``).

    torch's CP sharding of a FlexAttention ``BlockMask`` needs the sequence length to be a
    multiple of CP degree x 128 (flex's block size); 256 serves CP 2, and a local batch of
    2 keeps about the base's tokens per step.
    """
    config = base()
    config.training.seq_len = 256
    config.training.local_batch_size = 2
    return config
