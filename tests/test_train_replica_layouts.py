"""``plait train --replica-groups`` with other parallelism inside each group: a kill and a
heal, checked against one HSDP job of the same layout whose replicas are the groups.

Each group of 2 ranks runs context parallelism over both (``--cp 2``, fully_shard over
them), 4 experts over ``--ep 2`` balanced by token counts over the global batch (a loss and
a bias), and float8 all-gathers, checkpointing every 2 steps; group 1's rank 1 is
SIGKILLed in step 3 and the launcher restarts the group, which resumes its step-2
checkpoint, heals from group 0 and rejoins at step 5 (``tests/test_train_replicas.py`` has
the plain layout against torch's reference, and the checks). Groups of 4 ranks with tensor
parallelism or a pipeline go through the same kill and heal in
``benchmarks/replica_layouts.py`` (8 workers: too many for the suite on 2 cores). Its own
file, so that the test processes can run it beside the other replica test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from harness import run_on_ranks
from test_train_replicas import (
    FLAGS,
    KILL_STEP,
    MODEL,
    REJOIN_STEP,
    assert_groups_equal,
    final_weights,
    grad_norms,
    losses,
    plait_train,
)
from train_helpers import assert_losses_close, train_on_rank

#: The groups' layout (gradients clipped: the norm of the quorum's averaged gradients):
#: name -> (flags, the layout's settings, ranks per group). Its steps 1 and 2 run as one
#: HSDP job with the groups as its replicas (one process would not be bitwise: each rank
#: scales its own activations to float8).
LAYOUTS = {
    "cp2_moe_ep2_float8": (
        "--dp-shard 1 --cp 2 --experts 4 --top-k 2 --ep 2 --float8 --aux-loss-type global "
        "--bias-update-speed 0.01",
        {"cp": 2, "experts": 4, "top_k": 2, "ep": 2, "float8": True}
        | {"aux_loss_type": "global", "bias_update_speed": 0.01},
        2,
    ),
}
HSDP = MODEL.replace(
    device="cpu", batch_size=8, steps=2, warmup=1, eval_every=0, eval_batches=1,
    ckpt_every=0, min_lr_ratio=1, grad_clip=1, dp_replicate=2,
)  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_groups_of_other_layouts_heal_and_train_like_hsdp(name: str, tmp_path: Path) -> None:
    """Group 1's rank 1 is SIGKILLed in step 3. In the steps both groups trained (1 and 2)
    their gradient norm and mean loss are those of the HSDP job, and after them both hold
    its weights bitwise; the restarted group resumes its step-2 checkpoint, heals, and ends
    with bitwise the live group's weights: the all-reduce hooks and the healing state hold
    context-parallel, float8 and expert shards as they hold plain ones."""
    flags, layout, nproc = LAYOUTS[name]
    if layout.get("float8") and importlib.util.find_spec("torchao") is None:
        pytest.skip("needs torchao (the float8 extra)")
    inner = f"{flags} --nproc {nproc} --grad-clip 1 --ckpt-every 2 --keep 3"
    composed = FLAGS.replace("--grad-clip 0 ", "").replace("--ckpt-every 0 ", "")
    run_dir = tmp_path / "plait"
    plait_train(
        run_dir,
        *composed.replace("--dp-shard 2", inner).split(),
        PLAIT_TEST_KILL_RANK_AT_STEP=f"{nproc + 1}:{KILL_STEP}",  # group 1's rank 1
        PLAIT_TEST_REPLICAS_REJOIN_AT_STEP=str(REJOIN_STEP),
    )
    group0, group1 = losses(run_dir / "group0"), losses(run_dir / "group1")
    assert [group0[s][1] for s in range(1, 7)] == [2, 2, 1, 1, 2, 2]
    assert sorted(group1) == [1, 2, REJOIN_STEP, 6]
    reference = HSDP.replace(**layout)
    model = MODEL.replace(experts=reference.experts, top_k=reference.top_k)
    assert_groups_equal(run_dir, 6, model)

    hsdp = run_on_ranks(2 * nproc, train_on_rank, reference, str(tmp_path / "hsdp"))[0]
    assert_losses_close([(group0[s][0] + group1[s][0]) / 2 for s in (1, 2)], hsdp.losses)
    expected, norms = final_weights(tmp_path / "hsdp", 2, model), grad_norms(tmp_path / "hsdp")
    for g in (0, 1):
        # (a sum over the groups instead of their mean would double the norm)
        assert [grad_norms(run_dir / f"group{g}")[s] for s in (1, 2)] == [norms[1], norms[2]]
        weights = final_weights(run_dir / f"group{g}", 2, model, latest=False)
        for key, value in expected.items():
            assert torch.equal(weights[key], value), (g, key)
