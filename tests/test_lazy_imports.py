"""The package root and the packages ``plait plan`` reads import torch only when a name that
needs it is used (PEP 562), so the planner's cost model runs without torch (issue 38)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import plait
import plait.pipeline
import plait.train.llama


def _fresh(code: str) -> str:
    """Run ``code`` in a new interpreter; its stdout (it must exit 0)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_from_plait_import_a_name() -> None:
    from plait import fully_shard
    from plait.fsdp import fully_shard as from_fsdp

    assert fully_shard is from_fsdp


def test_plait_attribute() -> None:
    from plait.checkpoint import CheckpointWrapper
    from plait.replicate import replicate

    assert plait.CheckpointWrapper is CheckpointWrapper and plait.replicate is replicate
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = plait.no_such_name  # type: ignore[attr-defined]


def test_star_import_binds_all_of_all() -> None:
    names: dict[str, object] = {}
    exec("from plait import *", names)
    assert set(plait.__all__) <= set(names)
    assert all(names[n] is getattr(plait, n) for n in plait.__all__)
    assert set(plait.__all__) <= set(dir(plait)) and plait.__version__


def test_the_other_lazy_packages_resolve_every_name() -> None:
    for package in (plait.pipeline, plait.train.llama):
        names: dict[str, object] = {}
        exec(f"from {package.__name__} import *", names)
        assert set(package.__all__) <= set(names) and set(package.__all__) <= set(dir(package))
    from plait.pipeline import PipelineStage
    from plait.pipeline.stage import PipelineStage as from_stage
    from plait.train.llama import Llama, LlamaBlock
    from plait.train.llama.block import LlamaBlock as from_block
    from plait.train.llama.model import Llama as from_model

    assert (PipelineStage, Llama, LlamaBlock) == (from_stage, from_model, from_block)


def test_gpt_config_is_the_models() -> None:
    from plait.train.gpt_config import GPTConfig
    from plait.train.model import GPTConfig as from_model

    assert GPTConfig is from_model


def test_import_plait_alone_does_not_import_torch() -> None:
    out = _fresh(
        """
        import sys
        import plait
        print("torch" in sys.modules)
        plait.fully_shard
        print("torch" in sys.modules)
        """
    )
    assert out.split() == ["False", "True"]


def test_a_submodule_imported_first_does_not_replace_the_name() -> None:
    # Eagerly, the root's `checkpoint` (a function) replaced the submodule of that name; it
    # still does when the submodules are imported before the names.
    out = _fresh(
        """
        import plait.checkpoint.api, plait.contract, plait.replicate
        import plait.pipeline.simulate, plait.pipeline.validate
        import plait
        from plait import checkpoint, contract, replicate
        from plait.pipeline import simulate, validate
        print([type(x).__name__ for x in (checkpoint, replicate, simulate, validate)])
        print(plait.checkpoint is checkpoint, type(contract).__name__)
        """
    )
    kinds, root = out.splitlines()
    assert kinds == "['function', 'function', 'function', 'function']"
    assert root == "True _Contract"


def test_plan_evaluates_a_layout_without_torch() -> None:
    out = _fresh(
        """
        import contextlib, io, sys
        import plait.plan.cli
        flags = ["--preset", "llama3.1-70b", "--gpus", "64", "--tp", "4", "--pp", "4"]
        flags += ["--cp", "2", "--json", "--top", "1"]
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            status = plait.plan.cli.main(flags)
        assert status == 0, status
        print(printed.getvalue())
        print("torch" in sys.modules)
        """
    )
    table, torch_imported = out.rstrip().rsplit("\n", 1)
    (best,) = json.loads(table)
    assert best["fits"] and best["layout"]["tp"] == 4 and best["layout"]["cp"] == 2
    assert torch_imported == "False"


def test_the_plait_command_plans_without_torch() -> None:
    out = _fresh(
        """
        import contextlib, io, sys
        from plait.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["plan", "--preset", "llama3-8b", "--gpus", "8", "--top", "1"]) == 0
        print("torch" in sys.modules)
        """
    )
    assert out.strip() == "False"
