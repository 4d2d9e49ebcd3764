"""CPU shims for torch's upstream pipelining tests, applied identically to both runs.

This directory is put on ``PYTHONPATH`` of every pytest run (torch's and plait's), so
Python imports this module at the start of every process, the multiprocessing workers that
torch's ``MultiProcContinuousTest`` spawns included. It changes no test file. It wraps the
loading of two torch test-helper modules and, right after each is loaded (before any test
module imports names from it), replaces the accelerator gates that would skip every
multi-process pipelining test on a machine without GPUs:

* ``common_distributed.requires_accelerator_dist_backend(["nccl", "xccl"])``: a decorator
  that keeps the test (the tests pick gloo themselves on CPU:
  ``dist.get_default_backend_for_device("cpu")``);
* ``common_distributed.skip_if_lt_x_gpu(n)``: torch's own decorator with
  ``allow_cpu=True``, its switch for running on CPU-only machines;
* ``common_utils.TEST_MULTIACCELERATOR``: ``True`` (read by
  ``skip_but_pass_in_sandcastle_if(not TEST_MULTIACCELERATOR, ...)``);
* ``common_distributed.MultiProcContinuousTest._get_world_size``: a test class that sets
  no ``world_size`` gets one process per device, which on CPU is 1 (a one-stage
  pipeline); there it gets ``TORCH_PIPELINING_CPU_WORLD_SIZE`` processes (default 2, the
  smallest multi-GPU machine torch's CI runs these tests on);
* ``common_distributed.MultiProcContinuousTest.timeout``: the process group's timeout,
  ``TORCH_PIPELINING_PG_TIMEOUT`` seconds (default 60; torch's is 120): a rank stuck in a
  receive after a peer failed gives up sooner.

Active only while ``TORCH_PIPELINING_CPU_SHIMS=1``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any


def _keep(func: Callable[..., Any]) -> Callable[..., Any]:
    return func


def _patch_common_utils(module: types.ModuleType) -> None:
    module.TEST_MULTIACCELERATOR = True  # type: ignore[attr-defined]


def _patch_common_distributed(module: types.ModuleType) -> None:
    torch_skip_if_lt_x_gpu = module.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = False) -> Callable[..., Any]:
        return torch_skip_if_lt_x_gpu(x, allow_cpu=True)

    def requires_accelerator_dist_backend(
        backends: Sequence[str] | None = None,
    ) -> Callable[..., Any]:
        return _keep

    module.skip_if_lt_x_gpu = skip_if_lt_x_gpu  # type: ignore[attr-defined]
    module.requires_accelerator_dist_backend = requires_accelerator_dist_backend  # type: ignore[attr-defined]
    test_class = module.MultiProcContinuousTest
    torch_get_world_size = test_class._get_world_size.__func__

    def _get_world_size(cls: type, device_type: str) -> int:
        if device_type == "cpu" and cls.world_size == -2:  # type: ignore[attr-defined]
            return int(os.environ.get("TORCH_PIPELINING_CPU_WORLD_SIZE", "2"))
        return int(torch_get_world_size(cls, device_type))

    test_class._get_world_size = classmethod(_get_world_size)
    seconds = float(os.environ.get("TORCH_PIPELINING_PG_TIMEOUT", "60"))
    test_class.timeout = timedelta(seconds=seconds)


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "torch.testing._internal.common_utils": _patch_common_utils,
    "torch.testing._internal.common_distributed": _patch_common_distributed,
}


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    """Finds the patched modules as usual, then patches each right after it executes."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_patch(module: types.ModuleType) -> None:
            exec_module(module)
            PATCHES[fullname](module)

        loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


if os.environ.get("TORCH_PIPELINING_CPU_SHIMS") == "1":
    sys.meta_path.insert(0, _PatchAfterLoad())
