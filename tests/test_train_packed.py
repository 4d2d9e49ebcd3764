"""Packed documents and loss masks through ``plait train``'s models and steps.

* A document-masked forward equals the model run on each document alone (GPT and Llama):
  attention stays inside documents and positions restart at 0 in each.
* One training step on a hand-made batch (several documents per row, ``IGNORE`` targets
  spread unevenly over rows, so ranks and microbatches hold different numbers of loss
  tokens) gives the loss and the gradients of one process, computed here from first
  principles (the token-weighted mean over the global batch), at dp_shard 2, tp 2 with
  sequence parallelism, pp 2 (1F1B, 2 microbatches), cp 2 (allgather and ring, load
  balanced), full activation checkpointing and 2 microbatches.
* ``plait train`` of a Llama at cp 2 equals one process; ``plait train`` on a small
  JSON-lines dataset stopped mid-epoch and resumed equals the uninterrupted run.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plait.layout import DP_REPLICATE, DP_SHARD
from plait.mesh import mesh_coordinate
from plait.train.config import TrainConfig
from plait.train.llama import Llama, LlamaConfig
from plait.train.loop import Trainable, build_model
from plait.train.model import GPT, IGNORE, GPTConfig, document_positions, token_loss
from plait.train.parallelize import build_mesh
from plait.train.resolve import resolve
from plait.train.step import global_loss, step_batch

from harness import run_on_ranks
from train_helpers import TINY, assert_losses_close, documents_of, run_train, train_on_rank

HF: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64,
    "hidden_act": "silu",
}

T = 16  # tokens per row: 4 chunks of 4 under cp 2's load-balanced layout
#: Per row, where each document starts (row 1: one document; the rest: several, their
#: boundaries cutting the cp chunks).
STARTS = ((0, 5, 12), (0,), (0, 3), (0, 8))
#: Per row, how many leading targets take no loss (a chat's prompt): 14, 2, 6 and 16 loss
#: tokens, so the data-parallel ranks and microbatches hold unequal counts.
PROMPT = (2, 14, 10, 0)

#: One step of a tiny model; fp32, no clipping, no dropout.
BASE = TINY.replace(seq_len=T, n_layer=2, n_head=2, d_model=16, batch_size=4, steps=1)


def _documents(starts: tuple[tuple[int, ...], ...], t: int = T) -> torch.Tensor:
    return documents_of(starts, t)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A global batch: inputs, targets (IGNORE on each row's prompt), documents."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, 256, (len(STARTS), T), generator=generator)
    targets = torch.randint(0, 256, (len(STARTS), T), generator=generator)
    for row, prompt in enumerate(PROMPT):
        targets[row, :prompt] = IGNORE
    return inputs, targets, _documents(STARTS)


# ----------------------------------------------------------------------------------------
# The masked forward equals each document alone
# ----------------------------------------------------------------------------------------


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=T, n_layer=2, n_head=2, d_model=16))


def _llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_hf(HF), seq_len=T)


@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
def test_masked_forward_equals_each_document_alone(make: Any) -> None:
    model = make()
    inputs, _, documents = _batch(0)
    with torch.no_grad():
        packed = model(inputs, documents)
        for row, starts in enumerate(STARTS):
            ends = (*starts[1:], T)
            for s, e in zip(starts, ends, strict=True):
                alone = model(inputs[row : row + 1, s:e])[0]
                torch.testing.assert_close(packed[row, s:e], alone, rtol=0, atol=1e-5)
        # One document per row: the plain causal path, and the masked one agrees with it.
        one = torch.zeros_like(documents)
        torch.testing.assert_close(model(inputs, one), model(inputs), rtol=0, atol=1e-5)


def test_document_positions_restart_in_each_document() -> None:
    documents = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    expected = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]])
    assert torch.equal(document_positions(documents), expected)


def test_loss_ignores_masked_targets() -> None:
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[1, IGNORE, 2], [IGNORE, IGNORE, 4]])
    keep = targets != IGNORE
    expected = torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum")
    torch.testing.assert_close(token_loss(logits, targets), expected)


# ----------------------------------------------------------------------------------------
# One step at every layout equals one process
# ----------------------------------------------------------------------------------------

Grads = dict[str, torch.Tensor]


def _config(fields: dict[str, Any], world: int, model_config: str = "") -> TrainConfig:
    return resolve(BASE.replace(model_config=model_config, **fields), world)


#: A mixture of experts whose balance loss (over the global batch) joins the gradients.
MOE = {"experts": 4, "top_k": 2, "aux_loss_coeff": 0.01, "aux_loss_type": "global"}


@functools.cache
def _reference(model_config: str, moe: bool = False) -> tuple[float, float, Grads]:
    """The definition, in this process: the training loss (token-weighted mean over the
    global batch), its gradients, and the validation loss of another batch."""
    cfg = _config({"dp_shard": 1, **(MOE if moe else {})}, 1, model_config)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    inputs, targets, documents = _batch(1)
    loss = token_loss(model(inputs, documents), targets) / (targets != IGNORE).sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    inputs, targets, documents = _batch(2)
    with torch.no_grad():
        val = token_loss(model(inputs, documents), targets) / (targets != IGNORE).sum()
    return float(loss.detach()), float(val), grads


def _whole(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _step_on_rank(fields: dict[str, Any], model_config: str) -> tuple[float, float, Grads]:
    """One training step of BASE with ``fields`` on this rank, as ``plait train`` runs it:
    the global loss, the validation loss of another batch, this rank's whole gradients."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = _config(fields, world, model_config)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    mesh = build_mesh(cfg)
    parts = Trainable(model, cfg, mesh)
    dp_rank = mesh_coordinate(mesh, DP_REPLICATE) * cfg.dp_shard + mesh_coordinate(mesh, DP_SHARD)
    rows = cfg.batch_size // cfg.dp

    def local(seed: int) -> Any:
        x, y, d = (t[dp_rank * rows : (dp_rank + 1) * rows] for t in _batch(seed))
        return step_batch(x, y, d, cfg, mesh)

    loss = global_loss(parts.stepper.train(local(1)), cfg)[0]
    grads = {
        name: _whole(p.grad).detach().clone()
        for name, p in parts.stages[0].module.named_parameters()
        if p.grad is not None
    }
    for stage in parts.stages[1:]:
        grads |= {n: _whole(p.grad).clone() for n, p in stage.module.named_parameters()}
    for module in parts.modules:
        module.eval()
    val = global_loss(parts.stepper.evaluate(local(2)), cfg)[0]
    return loss, val, grads


def _check(results: list[tuple[float, float, Grads]], model_config: str, moe: bool) -> None:
    loss, val, grads = _reference(model_config, moe)
    for rank_loss, rank_val, rank_grads in results:
        assert abs(rank_loss - loss) < 1e-6, (rank_loss, loss)
        assert abs(rank_val - val) < 1e-6, (rank_val, val)
        assert rank_grads, "no gradients"
        for name, grad in rank_grads.items():
            torch.testing.assert_close(grad, grads[name], rtol=0, atol=2e-6, msg=name)
    # Every parameter's gradient is checked on some rank (pipeline ranks hold parts).
    assert set().union(*(r[2] for r in results)) == set(grads)


#: (world size, layout) for the GPT; the Llama runs a subset.
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "dp_shard2": (2, {"dp_shard": 2}),
    "tp2_sp": (2, {"tp": 2, "dp_shard": 1, "sequence_parallel": True}),
    "pp2_1f1b": (2, {"pp": 2, "dp_shard": 1, "schedule": "1F1B", "microbatches": 2}),
    "cp2_allgather": (2, {"cp": 2, "dp_shard": 1, "cp_method": "allgather"}),
    "cp2_ring": (2, {"cp": 2, "dp_shard": 1, "cp_method": "ring"}),
    "cp2_alltoall": (2, {"cp": 2, "dp_shard": 1, "cp_method": "alltoall"}),
    "ac_full": (1, {"dp_shard": 1, "ac": "full"}),
    "microbatches2": (1, {"dp_shard": 1, "microbatches": 2}),
    # Compositions: a recompute sees its own documents (under cp through the attention's
    # packed_documents, in a pipeline its own microbatch's); microbatches of unequal counts
    # on data-parallel ranks of unequal counts.
    "cp2_ring_ac_full": (2, {"cp": 2, "dp_shard": 1, "cp_method": "ring", "ac": "full"}),
    "pp2_ac_full": (2, {"pp": 2, "dp_shard": 1, "schedule": "1F1B", "ac": "full"}),
    "dp_shard2_microbatches2": (2, {"dp_shard": 2, "microbatches": 2}),
    "moe_dp_shard2": (2, {"dp_shard": 2, **MOE}),
    "moe_ep2": (2, {"dp_shard": 2, "ep": 2, **MOE}),
}
LLAMA_LAYOUTS = ("tp2_sp", "pp2_1f1b", "cp2_ring", "ac_full")


def _run(name: str, model_config: str) -> None:
    world, fields = LAYOUTS[name]
    if world == 1:
        results = [_step_on_rank(fields, model_config)]
    else:
        results = run_on_ranks(world, _step_on_rank, fields, model_config)
    _check(results, model_config, "experts" in fields)


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("packed") / "config.json"
    path.write_text(json.dumps(HF))
    return str(path)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpt_step_matches_one_process(name: str) -> None:
    _run(name, "")


@pytest.mark.parametrize("name", LLAMA_LAYOUTS)
def test_llama_step_matches_one_process(name: str, llama_config: str) -> None:
    _run(name, llama_config)


# ----------------------------------------------------------------------------------------
# plait train: a Llama at cp 2; an exact mid-epoch resume on a JSON-lines dataset
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ring", "allgather", "alltoall"])
def test_llama_cp2_trains_like_one_process(method: str, llama_config: str, tmp_path: Path) -> None:
    """Each method exchanges the grouped key/value heads (2 of 4) its Llama hands it."""
    cfg = TINY.replace(model_config=llama_config, grad_clip=0.5, steps=2)
    expected = run_train(cfg, 1, tmp_path / "one")
    cp = cfg.replace(cp=2, dp_shard=1, cp_method=method)
    for result in run_on_ranks(2, train_on_rank, cp, str(tmp_path / "cp2")):
        assert_losses_close(result.losses, expected.losses)
        assert_losses_close(list(result.val_losses.values()), list(expected.val_losses.values()))


def _write_dataset(path: Path) -> str:
    """A few dozen short documents, texts and chats (whose prompts take no loss)."""
    lines = []
    for i in range(24):
        if i % 3 == 2:
            messages = [
                {"role": "user", "content": f"question {i}?"},
                {"role": "assistant", "content": "answer " + "ok " * (i % 5)},
            ]
            lines.append(json.dumps({"messages": messages}))
        else:
            lines.append(json.dumps({"text": f"document {i}: " + "word " * (3 + i % 7)}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_resume_mid_epoch_on_documents(tmp_path: Path) -> None:
    data = _write_dataset(tmp_path / "data.jsonl")
    cfg = TINY.replace(data=data, steps=6, batch_size=8, eval_every=3, dp_shard=1)
    whole = run_train(cfg, 1, tmp_path / "whole")
    from plait.train.data import load_data

    rows = load_data(resolve(cfg, 1)).rows_per_epoch("train")
    assert rows < cfg.steps * cfg.batch_size  # an epoch ends within the run
    assert (2 * cfg.batch_size) % rows  # stopped mid-epoch
    run_train(cfg.replace(stop_after=2), 1, tmp_path / "resumed")
    resumed = run_train(cfg.replace(resume=True), 1, tmp_path / "resumed")
    assert resumed.start_step == 2
    assert resumed.losses == whole.losses[2:]
    assert resumed.val_losses == {k: v for k, v in whole.val_losses.items() if k > 2}
