"""CPU shims for torch's upstream fully_shard tests; the same in both runs but one line.

This directory is put on ``PYTHONPATH`` of every pytest run, so Python imports this module
at the start of every process, the workers torch's ``FSDPTest`` spawns included. It
changes no test file. First it loads the pipelining client's shims
(``clients/torch_pipelining/cpu_shims/sitecustomize.py``: ``skip_if_lt_x_gpu(n)`` with
``allow_cpu=True``, ``requires_accelerator_dist_backend`` keeping the test,
``TEST_MULTIACCELERATOR``), then patches torch's ``common_fsdp`` right after it loads:

* ``torch.cpu.device_count()`` answers ``TORCH_FSDP_CPU_WORLD_SIZE`` (default 2), and
  ``common_fsdp.DEVICE_COUNT`` with it: the test classes size their process groups as
  ``min(n, torch.get_device_module(device_type).device_count())``, which on CPU is 1;
* ``FSDPTest._run`` (each spawned worker's body) is this module's own CPU version: torch's
  refuses to run when ``torch.accelerator.device_count()`` (0 on CPU) is below the world
  size. It joins a gloo process group through the test's file store, waits at a barrier,
  seeds, runs the test, waits again and leaves the group, as torch's does;
* ``FSDPTestContinuous._init_pg`` (its workers' group, reused across a class's tests)
  joins the gloo group without torch's accelerator count check, and the class's default
  world size is that count too;
* ``torch.accelerator.current_accelerator()`` answers ``cpu`` instead of ``None`` when
  called from a test module's top level (one stored test file computes ``device_type =
  torch.accelerator.current_accelerator().type`` on import and overwrites it on the next
  line); everyone else still sees ``None``.

* ``replicate(module, device_ids=[rank], ...)`` of a module on the CPU drops
  ``device_ids`` (``None``, DDP's value for a CPU module): a stored test file builds its
  reference model that way (written for GPUs), which DDP refuses for a CPU module; newer
  test files pass ``_get_device_ids(rank)``, ``None`` on CPU, themselves. Applied to the
  ``replicate`` the test module imports, torch's (``torch.distributed._composable``) in the
  torch run and plait's (through :mod:`redirected_fsdp`) in the plait run.

In the plait run only (``TORCH_FSDP_IMPL=plait``), torch's ``torch.distributed.fsdp``
module's own ``fully_shard`` attribute is plait's too, right after that module loads:
``common_fsdp.compiled_fsdp_test`` re-binds the test module's global ``fully_shard`` to
``torch.distributed.fsdp.fully_shard`` for its eager run, and a test body compares the two
to tell a compiled run; without this the decorated tests would run torch's ``fully_shard``.
And ``common_fsdp``'s own imports of the
redirected names (``fully_shard``, ``checkpoint``, ``RegisterPostBackwardFunction``) are
pointed at the objects the rewritten test files get (:mod:`redirected_fsdp._resolve`):
its helpers (``MLPStack.parallelize``, ``patch_register_post_backward_hook_backward``) act
on what the test uses, as the pipelining client's ``schedule_registry.py`` does.

Active only while ``TORCH_FSDP_CPU_SHIMS=1``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

PIPELINING_SHIMS = (
    Path(__file__).resolve().parents[2] / "torch_pipelining" / "cpu_shims" / "sitecustomize.py"
)
COMMON_FSDP = "torch.testing._internal.common_fsdp"
COMPOSABLE = "torch.distributed._composable"  # where the tests import replicate from
FSDP = "torch.distributed.fsdp"
REDIRECTED_IN_COMMON_FSDP = {
    "fully_shard": "torch.distributed.fsdp",
    "checkpoint": "torch.distributed._composable",
    "RegisterPostBackwardFunction": "torch.distributed.fsdp._fully_shard._fsdp_param_group",
}


def _world_size() -> int:
    return int(os.environ.get("TORCH_FSDP_CPU_WORLD_SIZE", "2"))


def _load_pipelining_shims() -> None:
    os.environ["TORCH_PIPELINING_CPU_SHIMS"] = "1"
    spec = importlib.util.spec_from_file_location("torch_pipelining_cpu_shims", PIPELINING_SHIMS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _run(cls: Any, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
    """One spawned worker of an ``FSDPTest`` on CPU (gloo); see the module docstring.

    Named ``_run`` like the method it replaces: the spawn start method pickles the
    bound ``cls._run`` by that name."""
    import torch
    import torch.distributed as dist

    common_fsdp = sys.modules[COMMON_FSDP]
    self = cls(test_name)
    self.rank = rank
    self.file_name = file_name
    seconds = float(os.environ.get("TORCH_PIPELINING_PG_TIMEOUT", "60"))
    dist.init_process_group(
        init_method=self.init_method,
        backend="gloo",
        world_size=int(self.world_size),
        rank=rank,
        timeout=timedelta(seconds=seconds),
    )
    dist.barrier()
    torch._dynamo.reset()
    common_fsdp.set_rng_seed()
    self.run_test(test_name, pipe)
    torch._dynamo.reset()
    dist.barrier()
    dist.destroy_process_group()


def _init_pg(cls: Any, rank: int, world_size: int, rdvz_file: str) -> None:
    """``FSDPTestContinuous._init_pg`` on CPU: torch's exits (as a skip) when
    ``torch.accelerator.device_count()`` (0 on CPU) is below the world size; this one joins
    the gloo group as the base class does (``MultiProcContinuousTest._init_pg``)."""
    from torch.testing._internal.common_distributed import MultiProcContinuousTest

    MultiProcContinuousTest._init_pg.__func__(cls, rank, world_size, rdvz_file)


def _patch_common_fsdp(module: types.ModuleType) -> None:
    import torch

    count = _world_size()
    torch.cpu.device_count = lambda: count  # type: ignore[assignment]
    module.DEVICE_COUNT = count  # type: ignore[attr-defined]
    module.FSDPTest._run = classmethod(_run)  # type: ignore[attr-defined]
    continuous = getattr(module, "FSDPTestContinuous", None)
    if continuous is not None:  # worker processes reused across a class's tests
        continuous._init_pg = classmethod(_init_pg)
        continuous.world_size = count  # its default, DEVICE_COUNT, was 1 at class creation
    if os.environ.get("TORCH_FSDP_IMPL") == "plait":
        from redirected_fsdp._resolve import resolve

        for name, torch_module in REDIRECTED_IN_COMMON_FSDP.items():
            setattr(module, name, resolve(torch_module, name)[0])


def _cpu_device_ids(replicate: Any) -> Any:
    """``replicate`` that passes ``device_ids=None`` for a module on the CPU."""

    @functools.wraps(replicate)  # keeps replicate.state, which contract attaches
    def replicate_on_cpu(module: Any, *args: Any, **kwargs: Any) -> Any:
        on_cpu = all(p.device.type == "cpu" for p in module.parameters())
        if kwargs.get("device_ids") and on_cpu:
            kwargs["device_ids"] = None
        return replicate(module, *args, **kwargs)

    return replicate_on_cpu


def _patch_composable(module: types.ModuleType) -> None:
    module.replicate = _cpu_device_ids(module.replicate)  # type: ignore[attr-defined]


def _patch_current_accelerator() -> None:
    import torch

    torch_current_accelerator = torch.accelerator.current_accelerator

    def current_accelerator(*args: Any, **kwargs: Any) -> Any:
        found = torch_current_accelerator(*args, **kwargs)
        caller = sys._getframe(1)
        at_test_top = caller.f_code.co_name == "<module>" and str(
            caller.f_globals.get("__name__", "")
        ).startswith("test_")
        return torch.device("cpu") if found is None and at_test_top else found

    torch.accelerator.current_accelerator = current_accelerator


def _patch_common_fsdp_and_accelerator(module: types.ModuleType, exec_module: Any) -> None:
    _patch_current_accelerator()
    exec_module(module)
    _patch_common_fsdp(module)


def _patch_composable_after(module: types.ModuleType, exec_module: Any) -> None:
    exec_module(module)
    _patch_composable(module)


def _plait_fully_shard_after(module: types.ModuleType, exec_module: Any) -> None:
    exec_module(module)
    if os.environ.get("TORCH_FSDP_IMPL") == "plait":
        from redirected_fsdp._resolve import resolve

        module.fully_shard = resolve(FSDP, "fully_shard")[0]  # type: ignore[attr-defined]


# The module names patched, each with what runs its loading: torch's composable package in
# the torch run, its redirected counterpart in the plait run.
PATCHES = {
    COMMON_FSDP: _patch_common_fsdp_and_accelerator,
    COMPOSABLE: _patch_composable_after,
    "redirected_fsdp." + COMPOSABLE: _patch_composable_after,
    FSDP: _plait_fully_shard_after,
}


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    """Finds the modules of ``PATCHES`` as usual, then patches each as it executes."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = None
        for finder in sys.meta_path:  # the finder that would have found it without us
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: types.ModuleType) -> None:
            patch(module, exec_module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


if os.environ.get("TORCH_FSDP_CPU_SHIMS") == "1":
    _load_pipelining_shims()
    sys.meta_path.insert(0, _PatchAfterLoad())
