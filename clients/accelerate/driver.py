"""Train a tiny transformers Llama with accelerate's FSDP2 plugin, or with transformers' own
FSDP2 / TP x FSDP2 (``from_pretrained(distributed_config=...)``); one rank of one run.

    torchrun --standalone --nproc_per_node 2 driver.py {torch|plait} CONFIG OUT_DIR

On ``plait`` the only change is :func:`redirect.install` (before accelerate and
transformers are imported). Writes ``OUT_DIR/rank<r>.json``: the loss of every step (and,
for the state-dict configuration, the losses after a save / load round trip) plus what
each redirected name resolved to.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

impl, config_name, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
if impl == "plait":
    import redirect

    redirect.install()

import cpu_shims  # noqa: E402
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

# Configuration name -> FullyShardedDataParallelPlugin keyword arguments beyond the base.
CONFIGS: dict[str, dict[str, object]] = {
    "fsdp2": {},
    "fsdp2-ac": {"activation_checkpointing": True},
    "fsdp2-cpu-offload": {"cpu_offload": True},
    "fsdp2-no-reshard": {"reshard_after_forward": False},
    "fsdp2-state-dict": {"state_dict_type": "SHARDED_STATE_DICT"},
}
# transformers' own entry point: DistributedConfig keyword arguments (no accelerate).
NATIVE: dict[str, dict[str, int]] = {
    "transformers-fsdp2": {"fsdp_size": 2},
    "transformers-tp2-fsdp2": {"fsdp_size": 2, "tp_size": 2},
}
STEPS = 3


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def native() -> None:
    """transformers shards the model itself while loading it: every rank saves the same
    seeded model, then loads it with ``distributed_config`` (its FSDP plan, and its TP plan
    with ``tp_size``). Every rank trains the same batches (the data-parallel split is not
    what is compared here: the sharded model is)."""
    from transformers.distributed import DistributedConfig

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    pretrained = out_dir / f"pretrained{rank}"
    LlamaForCausalLM(tiny_config()).save_pretrained(pretrained)
    model = LlamaForCausalLM.from_pretrained(
        pretrained, distributed_config=DistributedConfig(**NATIVE[config_name]), dtype=torch.float32
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(100)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 128, (2, 32), generator=generator)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weight = next(model.parameters())
    result: dict[str, object] = {
        "model_class": [c.__module__ + "." + c.__name__ for c in type(model).__mro__[:2]],
        "param_type": type(weight).__name__,
        "placements": str(getattr(weight, "placements", None)),
        "losses": losses,
    }
    if impl == "plait":
        import redirect

        result["redirects"] = redirect.RESOLVED
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    torch.distributed.destroy_process_group()


def main() -> None:
    torch.manual_seed(0)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        **CONFIGS[config_name],  # type: ignore[arg-type]
    )
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="no", cpu=True)
    cpu_shims.enable_fsdp_on_cpu(accelerator, plugin)
    model = LlamaForCausalLM(tiny_config()).to(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)

    rank = accelerator.process_index
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, 128, (2, 32), generator=generator) for _ in range(STEPS)]

    def train(steps: list[torch.Tensor]) -> list[float]:
        losses = []
        for tokens in steps:
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    # Evidence that the FSDP2 path ran: the class fully_shard made, the parameters' type.
    result: dict[str, object] = {
        "model_class": [c.__module__ + "." + c.__name__ for c in type(model).__mro__[:2]],
        "param_type": type(next(model.parameters())).__name__,
        "losses": train(batches),
    }
    if config_name == "fsdp2-state-dict":
        ckpt = out_dir / "ckpt"
        accelerator.save_state(str(ckpt))
        full = accelerator.get_state_dict(model)
        result["full_state_dict_keys"] = len(full) if full is not None else None
        after = train(batches)  # diverge, then restore and replay
        accelerator.load_state(str(ckpt))
        result["losses_after_load"] = train(batches)
        result["replay_matches"] = after == result["losses_after_load"]
    if impl == "plait":
        import redirect

        result["redirects"] = redirect.RESOLVED
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    accelerator.end_training()


if __name__ == "__main__":
    os.makedirs(out_dir, exist_ok=True)
    native() if config_name in NATIVE else main()
