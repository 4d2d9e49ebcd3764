"""Run torch's upstream fully_shard (and composable checkpoint) tests on torch and on plait.

    check.py UPSTREAM_DIR [--only FILE ...] [--impl torch|plait ...] [--timeout S] [--list]

UPSTREAM_DIR is torch's ``test/distributed/_composable`` (v2.13.0). Each test file runs
under pytest twice, in two copies made under ``.work/`` (:mod:`redirect_fsdp`): unchanged
(torch) and with its fsdp / composable imports pointed at plait. Both on CPU with gloo (or
torch's threaded process group for ``FSDPTestMultiThread``), with the CPU shims of
``cpu_shims/sitecustomize.py`` and a per-test timeout (pytest-timeout). The collection,
the runs and their parsing are the pipelining client's (``clients/torch_pipelining/
check.py``, imported). Prints the table, then every test torch passes and plait does not,
with its classification where it is a known, deliberate one (``CLASSIFIED``). Exits
non-zero when such a test is not classified.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIPELINING = HERE.parent / "torch_pipelining"
sys.path.insert(0, str(PIPELINING))
_spec = importlib.util.spec_from_file_location("pipelining_check", PIPELINING / "check.py")
assert _spec is not None and _spec.loader is not None
pipelining_check = importlib.util.module_from_spec(_spec)
sys.modules["pipelining_check"] = pipelining_check  # dataclasses look their module up
_spec.loader.exec_module(pipelining_check)
sys.path.insert(0, str(HERE))

import redirect_fsdp  # noqa: E402

Result = pipelining_check.Result
WORK = Path(os.environ.get("TORCH_FSDP_WORK", HERE / ".work"))
FILES = (
    "fsdp/test_fully_shard_init.py",
    "fsdp/test_fully_shard_frozen.py",
    "fsdp/test_fully_shard_autograd.py",
    "fsdp/test_fully_shard_training.py",
    "test_checkpoint.py",
)
IMPLS = ("torch", "plait")

# Tests torch passes on CPU that plait does not, on purpose: (kind, reason).
TORCH_PRIVATE = "torch-private"
DIFFERENT = "deliberately different"
_INIT = "fsdp/test_fully_shard_init.py::"
_FROZEN = "fsdp/test_fully_shard_frozen.py::TestFullyShardFrozen::"
_CHECKPOINT = "test_checkpoint.py::TestCheckpoint::"
_TRAINING = "fsdp/test_fully_shard_training.py::"
_COMM = "fsdp/test_fully_shard_comm.py::"
CLASSIFIED: dict[str, tuple[str, str]] = {
    _INIT + "TestFullyShardLazyInit::test_fully_shard_is_root": (
        TORCH_PRIVATE,
        "reads FSDPState._lazy_init(), ._is_root and ._state_ctx.all_states",
    ),
    _INIT + "TestFullyShardLazyInit::test_fully_shard_module_and_param_fqns": (
        TORCH_PRIVATE,
        "reads FSDPState._lazy_init() and ._fsdp_param_group._module_fqn / .fsdp_params",
    ),
    _INIT + "TestFullyShardLazyInit::test_fully_shard_double_lazy_init": (
        TORCH_PRIVATE,
        "calls FSDPState._lazy_init() on a non-root state and expects its error",
    ),
    _INIT + "TestFullyShardLazyInit::test_fully_shard_multi_module_root": (
        TORCH_PRIVATE,
        "calls FSDPState._lazy_init() and expects its error",
    ),
    _INIT + "TestFullyShardShardPlacementFn::test_init_1d_uneven_shard_largest_dim": (
        DIFFERENT,
        "expects NotImplementedError for an uneven shard on dim 1; plait shards it "
        "(docs/torch_api.md)",
    ),
    _FROZEN + "test_train_mixed_requires_grad_per_group": (
        DIFFERENT,
        "asserts the reduce-scatter output's numel is the trainable parameters' shard (80); "
        "plait's carries one more element per parameter (82), the count of ranks that "
        "produced its gradient, so a parameter no rank used keeps grad=None "
        "(docs/torch_api.md); with that allowed the test passes",
    ),
    _TRAINING + "TestFullyShardRegisteredParams::"
    "test_modules_to_run_forward_empty_for_single_module": (
        TORCH_PRIVATE,
        "reads _get_fsdp_state()._modules_to_run_forward",
    ),
    _TRAINING + "TestFullyShard1DTrainingCore::test_train_parity_multi_group_unshard_async_op": (
        TORCH_PRIVATE,
        "calls FSDPModule._set_unshard_async_op()",
    ),
    _TRAINING + "TestFullyShard1DTrainingCompose::test_partial_group_reshard_toggle": (
        TORCH_PRIVATE,
        "reads _get_fsdp_state()._fsdp_param_group.is_unsharded",
    ),
    _TRAINING + "TestFullyShardShareCommContext::test_share_comm_context": (
        TORCH_PRIVATE,
        "calls _get_fsdp_state()._lazy_init(), reads ._comm_ctx and counts calls of torch's "
        "private foreach_all_gather / foreach_reduce, which plait never calls",
    ),
    **{
        _COMM + "TestFullyShardPrefetch::" + name: (
            TORCH_PRIVATE,
            "records events by patching torch's private FSDPParamGroup.unshard / reshard / "
            "post_backward and reads its _module_fqn, _training_state and _sharded_state; "
            "plait never calls FSDPParamGroup (test_backward_misprefetch, public API only, "
            "passes)",
        )
        for name in (
            "test_fully_shard_backward_prefetch",
            "test_fully_shard_multi_module_backward_prefetch",
            "test_fully_shard_multi_module_unused_module",
            "test_set_modules_to_backward_prefetch",
            "test_set_modules_to_backward_prefetch_inside_ac",
            "test_set_modules_to_forward_prefetch",
        )
    },
    _COMM + "TestFullyShardCommunication::test_reduce_scatter_max_input_buffers_resolves_to_max": (
        TORCH_PRIVATE,
        "reads _get_fsdp_state() and its param groups' settings",
    ),
    _COMM + "TestFullyShardReduceOpWorldSize1::test_size1_reduceop": (
        TORCH_PRIVATE,
        "reads _get_fsdp_state()._fsdp_param_group.mesh_info after training (the training "
        "parity before it passes on plait)",
    ),
    _COMM + "TestFullyShardReduceOpWorldSize1::test_singleton_copy_division_divide_factor_2_0": (
        DIFFERENT,
        "counts aten.div.Tensor calls in backward; at world size 1 plait divides the "
        "gradient in place (aten.div_.Tensor, no new tensor), to the same values (3 / 2, "
        "checked)",
    ),
    **{
        "test_replicate_training.py::" + name: (
            DIFFERENT,
            "asserts the parameters are Replicate() DTensors (directly or through "
            "check_sharded_parity / to_local); plait's replicate keeps plain parameters "
            "(docs/torch_api.md)",
        )
        for name in (
            "TestReplicateRegisteredParams::test_param_registration_after_forward",
            "TestReplicateRegisteredParams::test_param_registration_after_backward",
            "TestReplicateCastAfterInit::test_to_float64_after_init",
            "TestReplicateGradientAccumulation::test_1f1b_microbatching",
            "TestReplicateCustomForwardMethod::test_register_fsdp_forward_method",
        )
    },
    "test_replicate_training.py::TestReplicateTrainingCompose::"
    "test_train_parity_with_activation_checkpointing": (
        DIFFERENT,
        "tells a compiled run by replicate != torch's replicate_with_fsdp.replicate (true for "
        "plait's), then checks DTensor parameters as above",
    ),
    _CHECKPOINT + "test_clears_state_on_error_in_forward": (
        TORCH_PRIVATE,
        "reads checkpoint.state(m)._ac_generator; plait's state has no such field (its "
        "own test_checkpoint.py::test_clears_state_on_error_in_forward checks the same)",
    ),
}


def env_for(copy: Path, impl: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(
            [str(HERE / "cpu_shims"), str(HERE), str(PIPELINING), str(copy)]
        ),
        TORCH_FSDP_CPU_SHIMS="1",
        TORCH_FSDP_IMPL=impl,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def redirect_table(upstream: Path, files: list[str]) -> list[tuple[str, str]]:
    """``(torch name, what the plait copy gets)`` for every name it imports redirected."""
    os.environ["TORCH_FSDP_IMPL"] = "plait"
    from redirected_fsdp._resolve import resolve

    seen: dict[str, str] = {}
    for file in files:
        path = upstream / file
        if redirect_fsdp.redirects(path):
            for module, name in redirect_fsdp.imported_names(path.read_text()):
                seen.setdefault(f"{module}.{name}", resolve(module, name)[1])
    return sorted(seen.items())


def main() -> int:
    parsed = pipelining_check.command_line("torch's test/distributed/_composable", list(FILES))
    if parsed is None:
        return 0
    args, files, upstream = parsed
    results: dict[str, dict[str, Result]] = {impl: {} for impl in IMPLS}
    for impl in args.impl:
        copy = WORK / impl / "_composable"
        counts = redirect_fsdp.make_copy(upstream, copy, files, on_plait=impl == "plait")
        logs = WORK / impl / "logs"
        shutil.rmtree(logs, ignore_errors=True)
        (copy / "pytest.ini").write_text("[pytest]\n")
        if counts:
            print(f"{impl}: import lines rewritten: {counts}; the names resolve to:")
            for torch_name, plait_name in redirect_table(upstream, files):
                print(f"  {torch_name} -> {plait_name}", flush=True)
        for file in files:
            (logs / file).parent.mkdir(parents=True, exist_ok=True)  # logs/fsdp/...
            got = pipelining_check.run_file(
                impl, copy, file, args.timeout, env=env_for(copy, impl), logs=logs
            )
            results[impl].update(got)
    return report(files, results, both="torch" in args.impl and "plait" in args.impl)


def report(files: list[str], results: dict[str, dict[str, Result]], both: bool) -> int:
    """Print the per-file counts, the table and the closing note; the exit status."""
    short = pipelining_check.short
    ids = list(dict.fromkeys([*results["torch"], *results["plait"]]))
    print("\n| file | tests | torch passes | plait passes | plait passes of torch's |")
    print("| --- | --- | --- | --- | --- |")
    for file in files:
        mine = [i for i in ids if i.startswith(f"{file}::")]
        t = {i for i in mine if results["torch"].get(i, Result("-")).outcome == "passed"}
        p = {i for i in mine if results["plait"].get(i, Result("-")).outcome == "passed"}
        print(f"| {file} | {len(mine)} | {len(t)} | {len(p)} | {len(t & p)} of {len(t)} |")
    print("\n| test | torch | plait | reason (plait's; torch's when only torch fails) |")
    print("| --- | --- | --- | --- |")
    unexplained: list[str] = []
    classified: list[str] = []
    for test_id in ids:
        t, p = results["torch"].get(test_id), results["plait"].get(test_id)
        reason = ""
        if p is not None and p.outcome != "passed":
            reason = p.reason
        elif t is not None and t.outcome != "passed":
            reason = "torch: " + t.reason
        print(f"| {test_id} | {short(t)} | {short(p)} | {reason.replace('|', '/')} |")
        if t is not None and t.outcome == "passed" and (p is None or p.outcome != "passed"):
            (classified if test_id in CLASSIFIED else unexplained).append(test_id)
    if both:
        print(f"\n{len(classified) + len(unexplained)} tests pass on torch and not on plait.")
        print(f"Classified ({len(classified)}):")
        for test_id in classified:
            kind, why = CLASSIFIED[test_id]
            print(f"- {test_id}: {kind}: {why}")
        print(f"Not classified ({len(unexplained)}):")
        for test_id in unexplained:
            got = results["plait"].get(test_id)
            print(f"- {test_id}: {got.reason if got else 'not run'}")
    summary = {impl: {k: asdict(v) for k, v in results[impl].items()} for impl in IMPLS}
    WORK.mkdir(exist_ok=True)
    (WORK / "summary.json").write_text(json.dumps(summary, indent=1))
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
