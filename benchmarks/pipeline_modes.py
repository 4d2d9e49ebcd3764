"""Pipeline modes: the GPT model split into stages, plait's schedules beside torch's.

Both sides run the very same stage modules (plait's ``split_model`` of the GPT by blocks),
the same whole batch (``cfg.batch`` sequences enter stage 0; every rank of the pipeline
shares it), ``cfg.microbatches`` microbatches, the same loss and AdamW step; only the
``PipelineStage`` / schedule classes differ. Interleaved modes hold two stages per rank.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness import BenchConfig, Mode, Step
from plait.pipeline import SCHEDULE_CLASSES, SCHEDULES, split_model, stages_of_rank
from plait.train.model import GPT, lm_loss

# Mode suffix -> schedule name; plait's class and torch's share the class name.
_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}


def _pipeline_batch(cfg: BenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch, identical on every rank (stage 0 uses inputs, the last targets)."""
    gen = torch.Generator().manual_seed(1000)
    tokens = torch.randint(0, cfg.gpt.vocab_size, (cfg.batch, cfg.gpt.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _api(which: str) -> Any:
    if which == "torch":
        import torch.distributed.pipelining as torch_pipelining

        return torch_pipelining
    import plait.pipeline as plait_pipelining

    return plait_pipelining


def _pipelined(cfg: BenchConfig, which: str, schedule: str) -> Step:
    """This rank's stages of the GPT under ``schedule``, by ``which`` ("plait" / "torch")."""
    spec = SCHEDULES[_SCHEDULES[schedule]]
    per_rank = spec.stages_per_rank or 2  # interleaved: two stages per rank
    rank, world = dist.get_rank(), dist.get_world_size()
    n_stages = world * per_rank
    ids = stages_of_rank(rank, world, n_stages, spec.style)
    torch.manual_seed(0)
    modules = split_model(GPT(cfg.gpt), n_stages, layers="blocks", stages=ids)
    api = _api(which)
    cpu = torch.device("cpu")
    stages = [api.PipelineStage(m, s, n_stages, cpu) for m, s in zip(modules, ids, strict=True)]
    cls = getattr(api, SCHEDULE_CLASSES[spec.name].__name__)
    pipe = cls(stages[0] if per_rank == 1 else stages, cfg.microbatches, loss_fn=lm_loss)
    return _pipeline_step(pipe, modules, cfg, first=0 in ids, last=n_stages - 1 in ids)


def _fsdp_pipelined(cfg: BenchConfig, which: str, max_active_stages: int | None = None) -> Step:
    """Interleaved1F1B over 4 stages per rank on a (dp 2, pp world/2) mesh, every block and
    each stage's root ``fully_shard``-ed over dp, by ``which`` ("plait" / "torch"); each dp
    replica runs its half of the batch (so the tokens are counted once, as a pipeline's).
    ``max_active_stages``: plait's bound on the stages gathered at once (torch's runtime
    holds 3)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % 2 or cfg.batch % 2:
        raise ValueError("the pp x fsdp modes need an even --nproc and --batch")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "pp"))
    pp_rank, pp_world = mesh["pp"].get_local_rank(), world // 2
    n_stages = pp_world * 4
    ids = stages_of_rank(pp_rank, pp_world, n_stages, SCHEDULES["Interleaved1F1B"].style)
    torch.manual_seed(0)
    modules = split_model(GPT(cfg.gpt), n_stages, layers="blocks", stages=ids)
    if which == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from plait.fsdp import fully_shard
    for module in modules:
        for block in module.blocks:  # type: ignore[union-attr]
            if any(True for _ in block.parameters()):  # kept on this stage
                fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
    api = _api(which)
    cpu, group = torch.device("cpu"), mesh["pp"].get_group()
    stages = [
        api.PipelineStage(m, s, n_stages, cpu, group=group)
        for m, s in zip(modules, ids, strict=True)
    ]
    extra = {} if which == "torch" else {"max_active_stages": max_active_stages}
    pipe = api.ScheduleInterleaved1F1B(stages, cfg.microbatches, loss_fn=lm_loss, **extra)
    half = cfg.batch // 2
    dp_rank = mesh["dp"].get_local_rank()
    inputs, targets = (t[dp_rank * half : (dp_rank + 1) * half] for t in _pipeline_batch(cfg))
    return _pipeline_step(
        pipe, modules, cfg, first=0 in ids, last=n_stages - 1 in ids, batch=(inputs, targets)
    )


def _pipeline_step(
    pipe: Any,
    modules: list[nn.Module],
    cfg: BenchConfig,
    *,
    first: bool,
    last: bool,
    batch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Step:
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-4)
    inputs, targets = _pipeline_batch(cfg) if batch is None else batch
    args = (inputs,) if first else ()
    kwargs = {"target": targets} if last else {}

    def step() -> None:
        pipe.step(*args, **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _modes() -> list[Mode]:
    modes = []
    for schedule in _SCHEDULES:
        plait_name, torch_name = f"pp_{schedule}", f"torch_pp_{schedule}"
        modes.append(
            Mode(
                plait_name,
                partial(_pipelined, which="plait", schedule=schedule),
                torch_counterpart=torch_name,
                pipeline=True,
            )
        )
        modes.append(
            Mode(torch_name, partial(_pipelined, which="torch", schedule=schedule), pipeline=True)
        )
    fsdp = "torch_pp_fsdp_interleaved"
    for name, bound in (("pp_fsdp_interleaved", None), ("pp_fsdp_interleaved_active2", 2)):
        build = partial(_fsdp_pipelined, which="plait", max_active_stages=bound)
        modes.append(Mode(name, build, torch_counterpart=fsdp, pipeline=True))
    modes.append(Mode(fsdp, partial(_fsdp_pipelined, which="torch"), pipeline=True))
    return modes


PIPELINE_MODES: dict[str, Mode] = {m.name: m for m in _modes()}
PIPELINE_SUITE = ["single", *PIPELINE_MODES]
