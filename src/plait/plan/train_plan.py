"""The plan of one ``plait train`` configuration: what ``plait train --plan`` prints before
it starts workers (memory per rank, bubble, predicted tokens/s, and whether it fits), and
after the run, the prediction beside what the run measured (:func:`plan_versus_run`).

The layout goes both ways whole: :class:`~plait.train.config.TrainConfig`'s layout fields
(``cp`` and ``cp_method`` among them) are :class:`~plait.layout.Layout`'s. Its speed
flags are the planner's :class:`~plait.plan.spec.Software` (:func:`software_of_config`):
``--compile`` is ``compiled``, ``--float8`` torchao's tensorwise recipe, with the blocks'
weights all-gathered in fp8 where ``fully_shard`` shards them (``dp_shard x cp > 1``, as
:func:`plait.train.float8.gathers_float8`). A device without an fp8 peak (an A100, a CPU,
where plait emulates float8) has no float8 prediction: ValueError.

``--replica-groups R`` is priced as the one job it trains like (:func:`planned_layout`):
HSDP with the groups as its ``R`` replicas, each group's gradients averaged with the
others' over the network as HSDP's replicas average theirs (torchft's per-step quorum is
not priced)."""

from __future__ import annotations

import dataclasses
import statistics

from plait.plan.devices import device as device_preset
from plait.plan.report import all_to_all_per_step, cp_per_step, size
from plait.plan.search import Candidate, describe, evaluate
from plait.plan.spec import DeviceSpec, Layout, ModelSpec, Software, Workload
from plait.train.config import TrainConfig

__all__ = [
    "config_of_layout",
    "local_device",
    "model_of_config",
    "plan_of_config",
    "plan_summary",
    "plan_versus_run",
    "planned_layout",
    "software_of_config",
]


def local_device(kind: str) -> DeviceSpec:
    """The preset of this machine's devices: ``cpu``, or the GPU preset whose name appears
    in CUDA's device name (H100, H200, A100, B200; H100 when none matches)."""
    if kind != "cuda":
        return device_preset("cpu")
    import torch

    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
    for preset in ("h200", "h100", "a100", "b200"):
        if preset in name:
            return device_preset(preset)
    return device_preset("h100")


def model_of_config(cfg: TrainConfig) -> ModelSpec:
    """The planner's description of the model ``plait train`` builds from ``cfg``: the
    trainer's own (:func:`plait.train.resolve.model_spec`), the GPT's vocabulary the
    tokenizer's, or the ``--model-config`` file or preset."""
    from plait.train.resolve import model_spec  # here: resolve imports torch, the plan needs none

    return model_spec(cfg)


def software_of_config(cfg: TrainConfig) -> Software:
    """What ``cfg``'s ``--compile`` and ``--float8`` run (module docstring): plait's
    kernels, compiled or not; tensorwise Float8Linears, gathered in fp8 under
    ``fully_shard`` (:func:`plait.train.float8.gathers_float8`'s rule)."""
    layout = cfg.layout
    return Software(
        compiled=cfg.compile,
        float8="tensorwise" if cfg.float8 else "none",
        float8_all_gather=cfg.float8 and layout.dp_shard * layout.cp > 1,
    )


def plan_of_config(cfg: TrainConfig, device: DeviceSpec | None = None) -> Candidate:
    """Predict a resolved configuration (:func:`plait.train.resolve.resolve`) on ``device``
    (default: :func:`local_device`), with its ``--compile`` and ``--float8``
    (:func:`software_of_config`). ValueError for ``--ac offload`` (not modelled) and for
    ``--float8`` on a device without fp8 (an A100, a CPU)."""
    model = model_of_config(cfg)
    layout = planned_layout(cfg)
    if cfg.ac not in ("none", "selective", "full"):
        raise ValueError(f"--plan: --ac {cfg.ac} is not modelled (none, selective, full are)")
    work = Workload(cfg.seq_len, cfg.batch_size, cfg.mp)
    software = software_of_config(cfg)
    return evaluate(model, layout, work, device or local_device(cfg.device), software=software)


def planned_layout(cfg: TrainConfig) -> Layout:
    """The layout ``cfg`` trains as: its own, or with ``--replica-groups R`` its groups'
    layout with ``R`` times the replicas (every group a replica of one HSDP job: each
    reads ``1 / R`` of the global batch)."""
    layout = cfg.layout
    if cfg.replica_groups > 1:
        return dataclasses.replace(layout, dp_replicate=layout.dp_replicate * cfg.replica_groups)
    return layout


def config_of_layout(model: ModelSpec, layout: Layout, work: Workload) -> TrainConfig:
    """The ``plait train`` configuration of ``layout`` for plait's GPT ``model`` (the
    inverse of :func:`plan_of_config`); ValueError for a model that is not plait's GPT."""
    if model.gated or model.vocab != 256 or model.positions != work.seq_len or model.dense_layers:
        raise ValueError(f"{model.name} is not plait's GPT: plait train cannot run it")
    cfg = TrainConfig(
        n_layer=model.layers,
        n_head=model.heads,
        d_model=model.d_model,
        seq_len=work.seq_len,
        batch_size=work.global_batch,
        mp=work.precision,
        **dataclasses.asdict(layout),
    )
    if not model.experts:
        return cfg
    return dataclasses.replace(
        cfg,
        experts=model.experts,
        top_k=model.top_k,
        shared_experts=model.shared_experts,
        expert_hidden=model.expert_hidden,
    )


def plan_summary(cfg: TrainConfig, device: DeviceSpec | None = None) -> str:
    """A few lines on ``cfg``'s plan, ending in a warning when it will not fit."""
    dev = device or local_device(cfg.device)
    c = plan_of_config(cfg, dev)
    m, t = c.memory, c.timing
    parts = {
        "params": m.params,
        "grads": m.grads,
        "optimizer": m.optimizer,
        "unsharded": m.unsharded,
        "activations": m.activations,
        "buffers": m.buffers,
        **m.extra,
    }
    lines = [
        f"plan ({describe(c.layout)} on {dev.name}): peak memory per rank {size(m.total)} "
        f"({', '.join(f'{k} {size(v)}' for k, v in parts.items() if v)})",
        f"  bubble {t.bubble:.1%}, step {t.step_time:.3g} s, "
        f"{t.tokens_per_s_per_device:,.0f} tokens/s per device, MFU {t.mfu:.1%}",
    ]
    if cfg.experts:
        lines.append(
            f"  experts: ep={c.layout.ep}, all-to-all {size(all_to_all_per_step(t.collectives))}"
            " per rank per step"
        )
    if c.layout.cp > 1:
        lines.append(
            f"  context parallelism: cp={c.layout.cp} ({c.layout.cp_method}), each rank "
            f"{cfg.seq_len // c.layout.cp} tokens of each sequence, "
            f"{size(cp_per_step(t.collectives))} sent per rank per step in attention"
        )
    if not c.fits:
        lines.append(
            f"  warning: {size(m.total)} per rank will not fit in {dev.name}'s "
            f"{size(dev.memory)} (planner's usable share: 90%)"
        )
    return "\n".join(lines)


def plan_versus_run(
    cfg: TrainConfig, step_times: list[float], device: DeviceSpec | None = None
) -> str:
    """What ``plait train --plan`` prints after the run: the predicted step time and
    tokens/s per device beside what the run measured, the median of ``step_times`` (this
    session's, in order) without the first (it pays for warm-up and compilation) unless it
    is the only one. ValueError as :func:`plan_of_config`, or for no step time."""
    if not step_times:
        raise ValueError("--plan: the run recorded no step time to compare with")
    dev = device or local_device(cfg.device)
    t = plan_of_config(cfg, dev).timing
    steady = step_times[1:] or step_times
    measured = statistics.median(steady)
    tokens = cfg.batch_size * cfg.seq_len / measured / planned_layout(cfg).world
    which = f"median of {len(steady)} step(s)" + (", the first left out" if step_times[1:] else "")
    return (
        f"plan vs run on {dev.name}: step {t.step_time:.3g} s predicted, {measured:.3g} s "
        f"measured ({which}), measured / predicted {measured / t.step_time:.2f}x; "
        f"{t.tokens_per_s_per_device:,.0f} tokens/s per device predicted, {tokens:,.0f} measured"
    )
