"""What ``plait train --help`` says: the command's description and, per group, each flag's
help (:data:`FLAGS`: the flag's name, type or choices and default come from
:class:`~plait.train.config.TrainConfig`; :mod:`plait.train.cli` builds the parser)."""

from __future__ import annotations

from plait.layout import CP, DP_REPLICATE, DP_SHARD, EP, PP, TP
from plait.pipeline import SCHEDULES
from plait.train.llama import families_help
from plait.train.presets import preset_names

__all__ = ["FLAGS", "TRAIN_HELP"]

_AUTO = "0 = auto"
TRAIN_HELP = """\
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
  plait train --run-dir runs/a --max-restarts 3 --ckpt-every 500 --snapshot-every 10
  plait tokenizer train --data texts/ --vocab 8192 --out tok/tokenizer.json
  plait train --data texts/ --tokenizer tok/tokenizer.json
  plait train --init-from path/to/hf-model --tokenizer path/to/hf-model/tokenizer.json
  plait export --run-dir runs/a --out runs/a-hf
"""

# Per group: (field, help). The flag, its type or choices and the default shown come from
# TrainConfig.
FLAGS: dict[str, list[tuple[str, str]]] = {
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
        (
            "snapshot_every",
            "also save each rank's state every N steps into its machine's memory (/dev/shm, "
            "or $PLAIT_SNAPSHOT_DIR), the newest kept, for --max-restarts and --resume on "
            "the same machines to continue from (0: none)",
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
