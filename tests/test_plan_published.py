"""``benchmarks.plan_published`` and its data, ``benchmarks.published_runs``: issue 28's
table of published runs.

What is tested is the table's machinery and the data's consistency, not the cost model's
accuracy (the README reports that): every row evaluates at its layout; every row names its
source; the validation set is as wide as the issue asks (15 or more modelled rows, three
code bases, H100 and A100, with and without pipelines); the conversions to plait's MFU
agree with the MFU the sources print where they count the same FLOPs; the transcribed
shapes give the parameter counts the sources state; the README holds the current table.
Single process, seconds.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from benchmarks.plan_published import (
    README_END,
    README_START,
    Row,
    format_report,
    planner_device,
    planner_layout,
    published_table,
    series_trends,
    stats,
    update_readme,
)
from benchmarks.published_fresh import FRESH
from benchmarks.published_holdout import HOLDOUT
from benchmarks.published_runs import (
    CALIBRATION,
    MEGATRON,
    RUNS,
    TORCHTITAN,
    VALIDATION,
    PublishedRun,
    plait_mfu,
    published_flops_per_token,
    tokens_per_s,
)
from plait.plan import evaluate
from plait.plan.devices import compute_peak, device
from plait.plan.models import flops_per_token, param_counts

ROOT = Path(__file__).resolve().parent.parent
GIB = 2.0**30


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    return published_table()


def test_every_row_evaluates_at_its_layout(rows: list[Row]) -> None:
    assert [r.run for r in rows] == list(RUNS)
    for r in rows:
        run = r.run
        assert run.layout.world == run.gpus
        assert run.work.global_batch % run.layout.dp == 0, run.name
        got = evaluate(
            run.model, planner_layout(run), run.work, planner_device(run), software=run.software
        )
        assert r.mfu == got.timing.mfu, run.name
        assert r.fits == got.fits, run.name
        assert 0 < r.mfu < 1 and 0 < r.published_mfu < 1, run.name
        assert math.isfinite(r.ratio), run.name
        assert planner_device(run).memory == run.memory_gib * GIB


def test_a_stated_network_is_shared_by_the_nodes_gpus() -> None:
    h100 = next(r for r in HOLDOUT if r.name.startswith("fms-fsdp H100"))
    assert h100.node_network_gbps == 800  # "H100 96 GPUs with 800 Gbps": per node
    assert planner_device(h100).inter_node_bw == 800e9 / 8 / 8  # 12.5 GB/s per GPU
    unstated = next(r for r in RUNS if not r.node_network_gbps)
    assert planner_device(unstated).inter_node_bw == device(unstated.device).inter_node_bw


def test_every_row_names_its_source() -> None:
    for run in RUNS:
        assert run.source.strip(), run.name
        # a repository path or a paper: something a reader can open
        assert "/" in run.source or "arXiv" in run.source, run.name
        assert run.role in ("calibration", "validation"), run.name
    assert len({run.name for run in RUNS}) == len(RUNS)


def test_validation_set_is_as_wide_as_the_issue_asks(rows: list[Row]) -> None:
    counted = [r.run for r in rows if r.counted]
    assert len(counted) >= 15
    assert len({r.code_base for r in counted}) >= 3
    assert {r.device for r in counted} >= {"h100", "a100"}
    assert any(r.pipelined for r in counted) and any(not r.pipelined for r in counted)
    series = {r.series for r in counted if r.series}
    assert len(series) >= 3
    # calibration: a few rows, spanning devices and code bases, none of them validated
    assert 3 <= len(CALIBRATION) <= 5
    assert {r.device for r in CALIBRATION} == {"h100", "h100-hbm2e", "a100"}
    assert len({r.code_base for r in CALIBRATION}) >= 2
    assert not set(CALIBRATION) & set(VALIDATION)
    assert all(not r.excluded for r in CALIBRATION)


def test_statistics_count_the_modelled_validation_rows(rows: list[Row]) -> None:
    s = stats(rows)
    counted = [r for r in rows if r.counted]
    assert s.rows == len(counted)
    errors = sorted(abs(r.ratio - 1) for r in counted)
    assert s.worst == errors[-1]
    assert errors[0] <= s.median <= errors[-1]
    names = {t.name for t in s.series}
    assert "Megatron-LM A100 2021" in names and "Megatron-Core H100 2024" in names
    for t in s.series:
        assert t.smallest != t.largest


def test_series_trend_signs() -> None:
    a, b = RUNS_BY_NAME["Megatron-LM A100 1.7B"], RUNS_BY_NAME["Megatron-LM A100 1T"]
    published = plait_mfu(b) - plait_mfu(a)
    up = [Row(a, 0.30, 1.0, 1.0, True), Row(b, 0.40, 1.0, 1.0, True)]
    down = [Row(a, 0.40, 1.0, 1.0, True), Row(b, 0.30, 1.0, 1.0, True)]
    (t,) = series_trends(up)
    assert (t.smallest, t.largest) == ("1.7B", "1T")
    assert t.published == pytest.approx(published) and t.predicted == pytest.approx(0.10)
    assert t.agrees == (published > 0)
    assert series_trends(down)[0].agrees == (published < 0)


RUNS_BY_NAME = {run.name: run for run in RUNS}


def test_mfu_conversion_matches_the_sources_own_mfu() -> None:
    """Where a source counts model FLOPs as plait does (Megatron-Core, llm-foundry), the
    converted MFU is the one it prints, within rounding and the small terms plait leaves
    out (learned positions, norms); Megatron 2021 counts the recomputation as well."""
    for run in RUNS:
        if not run.stated_mfu:
            continue
        if run.flops == "megatron-2021":
            # hardware FLOPs: the recomputed forward adds about a third to the blocks
            ratio = plait_mfu(run) / run.stated_mfu
            assert 0.72 < ratio < 0.78, run.name
            peak = compute_peak(device(run.device), "bf16")
            assert run.value * 1e12 / peak == pytest.approx(run.stated_mfu, abs=0.006)
        else:
            assert plait_mfu(run) == pytest.approx(run.stated_mfu, rel=0.02, abs=0.006), run.name


#: llm-foundry's rows of every set (they carry its NumParams and MFU columns).
FOUNDRY_ROWS = [run for run in (*RUNS, *HOLDOUT, *FRESH) if run.flops == "mosaic"]


def test_mosaic_flop_count_reproduces_its_mfu() -> None:
    """llm-foundry's MFU is ``(6 NumParams + 12 L d T) x tokens/s`` over its peak: the
    transcribed NumParams and tokens/s give the printed MFU."""
    assert len(FOUNDRY_ROWS) >= 28
    for run in FOUNDRY_ROWS:
        peak = compute_peak(device(run.device), "bf16")
        mfu = published_flops_per_token(run) * tokens_per_s(run) / peak
        assert mfu == pytest.approx(run.stated_mfu, rel=0.005), run.name


def _total_params(run: PublishedRun) -> int:
    return param_counts(run.model).total(run.model.layers)


def test_shapes_give_the_published_parameter_counts() -> None:
    held_out = [run for run in FOUNDRY_ROWS if run not in RUNS]
    assert len(held_out) >= 28  # llm-foundry's held-out and large-scale rows
    for run in FOUNDRY_ROWS:  # the table's NumParams column, exactly: MPT, learned positions
        assert _total_params(run) == run.params, run.name
    for run in RUNS:
        if run.code_base == MEGATRON:  # "1.7B", "1T": the size the source names
            size = float(run.size[:-1]) * (1e12 if run.size.endswith("T") else 1e9)
            assert _total_params(run) == pytest.approx(size, rel=0.05), run.name


def test_megatron_core_count_is_plaits() -> None:
    for run in RUNS:
        if run.flops == "megatron-core":
            plait = flops_per_token(run.model, run.work.seq_len)
            assert published_flops_per_token(run) == pytest.approx(plait, rel=0.005)


def _reference() -> Path | None:
    """The shared reference file, beside or inside the checkout (None where absent)."""
    for base in (ROOT, ROOT.parent):
        path = base / "shared" / "reference" / "published_runs.md"
        if path.is_file():
            return path
    return None


def test_torchtitan_rows_carry_the_reference_figures() -> None:
    path = _reference()
    if path is None:
        pytest.skip("shared/reference/published_runs.md is not in this checkout")
    lines = {}
    for line in path.read_text().splitlines():
        if m := re.match(r"\|\s*(\d+)\s*\|", line):
            lines[int(m.group(1))] = line
    titan = [r for r in RUNS if r.code_base == TORCHTITAN]
    assert titan
    for run in titan:
        table = int(run.name.split()[1].removeprefix("T"))
        cells = [c.strip() for c in lines[table].split("|")]
        assert f"{run.value:,.0f} (" in lines[table], run.name
        assert cells[2] == run.size, run.name
        assert int(cells[3]) == run.gpus, run.name
        local = run.work.global_batch // run.layout.dp
        assert cells[5].split(" / ")[0] == str(local), run.name
        assert cells[6] == run.layout.ac, run.name


def test_readme_holds_the_current_table(rows: list[Row]) -> None:
    text = (ROOT / "README.md").read_text()
    start, end = text.index(README_START), text.index(README_END)
    assert text[start + len(README_START) : end].strip() == format_report(rows), (
        "README.md's published-runs table is stale: run "
        "`.venv/bin/python -m benchmarks.plan_published --update-readme`"
    )


def test_update_readme_replaces_only_the_block(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text(f"# a\n\n{README_START}\nold\n{README_END}\n\n## b\n")
    assert update_readme(path, "| new |")
    assert path.read_text() == f"# a\n\n{README_START}\n| new |\n{README_END}\n\n## b\n"
    assert not update_readme(path, "| new |")
    (tmp_path / "bare.md").write_text("# nothing\n")
    with pytest.raises(ValueError, match="plan-published"):
        update_readme(tmp_path / "bare.md", "x")


def test_foundry_checkpoint_early_stop_follows_the_runs_torch(rows: list[Row]) -> None:
    # h100new.md lists torch 2.1 (nightly 2023-08-27) for the H100 and A100 80 GB rows;
    # the A100 40 GB table predates torch 2.1: its checkpoint reruns the whole block.
    foundry = [r for r in rows if r.run.code_base == "llm-foundry" and r.run.layout.ac == "full"]
    assert len(foundry) == 7
    for r in foundry:
        old = "A100 40GB" in r.run.name
        assert r.run.software.ac_early_stop is (False if old else None)
    (h100,) = [t for t in series_trends(rows) if t.name.startswith("llm-foundry H100")]
    assert h100.published > 0 and h100.agrees
