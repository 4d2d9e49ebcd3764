"""``plait plan``: which layout fits, and how fast it runs (issue 16).

``plan(model, work, device, gpus, **fixed)`` ranks every layout that fits, fastest first;
``evaluate`` predicts one layout; ``predict_memory`` gives one layout's memory by part.
The cost model is documented in docs/plan.md and in each module's docstring.
"""

from plait.plan.devices import DEVICES, device
from plait.plan.memory import predict_memory
from plait.plan.models import PRESET_ALIASES, from_hf_config, gpt, preset
from plait.plan.search import Candidate, PlanError, evaluate, plan
from plait.plan.spec import DeviceSpec, Layout, MemoryBreakdown, ModelSpec, Workload

__all__ = [
    "DEVICES",
    "PRESET_ALIASES",
    "Candidate",
    "DeviceSpec",
    "Layout",
    "MemoryBreakdown",
    "ModelSpec",
    "PlanError",
    "Workload",
    "device",
    "evaluate",
    "from_hf_config",
    "gpt",
    "plan",
    "predict_memory",
    "preset",
]
