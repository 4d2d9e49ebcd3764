"""``plait train --async-checkpoint``: checkpoints written from a staged copy on a background
thread equal synchronous ones, become visible only once complete, never overlap, and a
failed write fails the run on the training thread.

In this process (one rank, a tiny model). A kill during an asynchronous write, across
processes, is in tests/test_train_restart.py; the background thread's write is held at
its manifest (the last file) by patching it, so the tests need no timing.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.train import checkpointing
from plait.train.checkpointer import ALIGN, Checkpointer, Stager
from plait.train.checkpointing import list_checkpoints, load_checkpoint, load_weights
from plait.train.config import TrainConfig
from plait.train.loop import model_config
from plait.train.metrics import read_metrics
from plait.train.model import GPT
from plait.train.optimizer import build_optimizer

import train_helpers
from train_helpers import run_train

TINY = train_helpers.TINY.replace(
    seq_len=16, n_layer=2, d_model=16, steps=4, batch_size=4, ckpt_every=2, keep=5
)
MODEL = TrainConfig(seq_len=16, n_layer=1, n_head=2, d_model=16, vocab_size=256, device="cpu")
PATIENCE = 60  # seconds any wait here may take before the test fails instead of hanging


def _loaded(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], torch.Tensor]:
    """Checkpoint ``path``'s weights, optimizer state and CPU RNG state, as loaded."""
    model = GPT(model_config(TINY.replace(vocab_size=256)))
    optimizer = build_optimizer([model], TINY)
    torch.manual_seed(12345)  # overwritten by the checkpoint's RNG state
    load_checkpoint(path, [model], optimizer, "cpu")
    return model.state_dict(), optimizer.state_dict()["state"], torch.get_rng_state()


def test_async_checkpoints_equal_sync_ones(tmp_path: Path) -> None:
    sync = run_train(TINY, 1, tmp_path / "sync")
    background = run_train(TINY.replace(async_checkpoint=True), 1, tmp_path / "async")
    assert background.losses == sync.losses
    for step in (2, 4):
        name = f"checkpoints/step_{step:06d}"
        weights, optim, rng = _loaded(tmp_path / "async" / name)
        weights_sync, optim_sync, rng_sync = _loaded(tmp_path / "sync" / name)
        assert weights.keys() == weights_sync.keys()
        assert all(torch.equal(weights[k], weights_sync[k]) for k in weights)
        assert optim.keys() == optim_sync.keys()
        for i, entry in optim.items():
            assert all(torch.equal(entry[k], optim_sync[i][k]) for k in entry)
        assert torch.equal(rng, rng_sync)
    rows = [r for r in read_metrics(tmp_path / "async") if r.get("event")]
    saves = [r for r in rows if r["event"] == "checkpoint"]
    assert [(r["step"], r["async"]) for r in saves] == [(2, True), (4, True)]
    assert all(r["staged_bytes"] > 0 for r in saves)
    written = [r["checkpoint"] for r in rows if r["event"] == "checkpoint_written"]
    assert written == ["step_000002", "step_000004"]  # the last one waited for at the end
    sync_saves = [r for r in read_metrics(tmp_path / "sync") if r.get("event") == "checkpoint"]
    assert [(r["async"], r["staged_bytes"]) for r in sync_saves] == [(False, 0), (False, 0)]


def test_stager_copies_once_and_reuses_its_buffers() -> None:
    weight, count = torch.arange(6.0).reshape(2, 3), torch.tensor(3)
    stager = Stager(pin=False)
    staged = stager.stage({"model": {"w": weight}, "optim": {"step": count}})
    weight.add_(100)  # training goes on: the staged copy keeps the saved values
    assert torch.equal(staged["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert stager.nbytes == 6 * 4 + 8
    again = stager.stage({"model": {"w": weight}, "optim": {"step": count}})
    assert again["model"]["w"].data_ptr() == staged["model"]["w"].data_ptr()  # reused
    assert torch.equal(again["model"]["w"], weight)
    with pytest.raises(TypeError, match="cannot stage checkpoint entry model.w: str"):
        stager.stage({"model": {"w": "text"}})


def test_stager_holds_one_arena_of_the_checkpoints_size() -> None:
    """The staged tensors are views of one host arena of their size (each start aligned
    to ALIGN bytes), not tensors rounded up one by one; a checkpoint of other shapes gets
    a new arena; close releases it."""
    state = {"model": {"w": torch.randn(3, 5), "b": torch.ones(7, dtype=torch.bfloat16)}}
    state["optim"] = {"step": torch.tensor(4), "flags": torch.tensor([True, False, True])}
    stager = Stager(pin=False)
    staged = stager.stage(state)
    sizes = [15 * 4, 7 * 2, 8, 3]
    assert stager.nbytes == sum(sizes)
    starts = _aligned_starts(sizes)
    assert stager.reserved == starts[-1] + sizes[-1] == 99
    tensors = [staged["model"]["w"], staged["model"]["b"]]
    tensors += [staged["optim"]["step"], staged["optim"]["flags"]]
    base = tensors[0].untyped_storage().data_ptr()
    assert [t.data_ptr() - base for t in tensors] == starts
    wanted = [*state["model"].values(), *state["optim"].values()]
    for got, want in zip(tensors, wanted, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert not stager.pinned  # pin=False: a CPU run's arena stays pageable
    state["model"]["w"] = torch.zeros(4, 5)  # another shape: another arena
    again = stager.stage(state)
    assert again["model"]["w"].untyped_storage().data_ptr() != base
    assert stager.reserved == _aligned_starts([20 * 4, *sizes[1:]])[-1] + sizes[-1] == 115
    stager.close()
    assert stager.reserved == stager.nbytes == 0


def _aligned_starts(sizes: list[int]) -> list[int]:
    """Where tensors of ``sizes`` bytes start, one after another, each aligned to ALIGN."""
    starts = [0]
    for size in sizes[:-1]:
        starts.append(-(-(starts[-1] + size) // ALIGN) * ALIGN)
    return starts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stager_page_locks_its_arena_on_cuda() -> None:
    """On CUDA the arena is registered (page-locked): the staged copies are pinned, the
    device-to-host copies asynchronous, and the host memory is the checkpoint's size,
    not each tensor rounded up to a power of two."""
    state = {"w": torch.randn(1000, 1000, device="cuda"), "b": torch.randn(3, device="cuda")}
    stager = Stager(pin=True)
    staged = stager.stage(state)
    assert stager.pinned and all(t.is_pinned() for t in staged.values())
    assert stager.reserved == -(-4_000_000 // ALIGN) * ALIGN + 12
    assert all(torch.equal(staged[k], state[k].cpu()) for k in state)
    stager.close()
    assert not stager.pinned


class _HeldManifest:
    """Holds every background write at its manifest (the last file) until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, error: Exception | None = None) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()
        self.error = error
        original = checkpointing.write_manifest

        def held(directory: Path, group: Any = None) -> None:
            self.reached.set()
            assert self.release.wait(PATIENCE), "the test never released the write"
            if self.error is not None:
                raise self.error
            original(directory, group)

        monkeypatch.setattr(checkpointing, "write_manifest", held)


@pytest.fixture
def checkpointer(tmp_path: Path) -> Checkpointer:
    """An asynchronous checkpointer of a tiny GPT whose AdamW has taken one step."""
    model = GPT(model_config(MODEL))
    optimizer = build_optimizer([model], MODEL)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return Checkpointer(
        tmp_path, [model], optimizer, MODEL.to_dict(), keep=5, group=None, background=True
    )


def _model(saver: Checkpointer) -> torch.nn.Module:
    return saver.modules[0]


def test_async_checkpoint_is_visible_only_once_complete(
    checkpointer: Checkpointer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    held = _HeldManifest(monkeypatch)
    saved = {k: v.clone() for k, v in _model(checkpointer).state_dict().items()}
    report, finished = checkpointer.save(2)  # returns while the write goes on
    assert report.background and report.staged_bytes == checkpointer.staged_bytes > 0
    assert finished == []
    assert held.reached.wait(PATIENCE)
    assert list_checkpoints(tmp_path) == []  # half-written: not a checkpoint yet
    assert (tmp_path / "checkpoints" / ".tmp-step_000002").is_dir()
    with torch.no_grad():  # training goes on, changing the live weights
        for p in _model(checkpointer).parameters():
            p.add_(1.0)
    held.release.set()
    [written] = checkpointer.close()
    assert written.step == 2 and written.path.name == "step_000002"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002"]
    model = GPT(model_config(MODEL))
    load_weights(written.path, model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_the_next_checkpoint_waits_for_the_previous_write(
    checkpointer: Checkpointer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    held = _HeldManifest(monkeypatch)
    at_step_2 = {k: v.clone() for k, v in _model(checkpointer).state_dict().items()}
    checkpointer.save(2)
    assert held.reached.wait(PATIENCE)
    with torch.no_grad():
        for p in _model(checkpointer).parameters():
            p.mul_(2.0)
    results: list[Any] = []
    second = threading.Thread(target=lambda: results.append(checkpointer.save(4)))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # staging step 4 would overwrite step 2's staged copy
    held.release.set()
    second.join(PATIENCE)
    assert not second.is_alive()
    [(report, finished)] = results
    assert report.step == 4 and [w.step for w in finished] == [2]
    checkpointer.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000004"]
    model = GPT(model_config(MODEL))
    load_weights(tmp_path / "checkpoints" / "step_000002", model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in at_step_2.items())


def test_a_failed_background_write_fails_on_the_training_thread(
    checkpointer: Checkpointer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    held = _HeldManifest(monkeypatch, error=OSError(28, "No space left on device"))
    held.release.set()
    checkpointer.save(2)
    with pytest.raises(OSError, match="No space left on device"):
        checkpointer.close()
    assert list_checkpoints(tmp_path) == []
