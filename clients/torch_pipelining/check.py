"""Run torch's upstream pipelining tests on torch and on plait; print the comparison table.

    check.py UPSTREAM_DIR [--only FILE ...] [--impl torch|plait ...] [--timeout S] [--list]

UPSTREAM_DIR holds torch's ``test/distributed/pipelining`` files (v2.13.0). Each test file
runs under pytest twice, in two copies made under ``.work/`` (:mod:`redirect`): unchanged
(torch) and with its pipelining imports pointed at plait. Both runs are on CPU with gloo,
with the CPU shims of ``cpu_shims/sitecustomize.py`` and a per-test timeout
(pytest-timeout). torch's multi-process test classes skip their remaining tests after a
failure ("Previous test failed"); those tests are run again, in a fresh pytest, until each
has a result of its own. Exits non-zero when a test that passes on torch does not pass on
plait.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

import redirect

HERE = Path(__file__).resolve().parent
WORK = HERE / ".work"
FILES = ("test_microbatch.py", "test_stage.py", "test_schedule_multiproc.py")
IMPLS = ("torch", "plait")
POISONED = "Previous test failed"
ERROR_LINE = re.compile(
    r"^(?:E\s+)?(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Failed|Exit|Interrupt|Timeout)\w*)"
    r": (?P<msg>.*\S)"
)


@dataclass
class Result:
    outcome: str  # passed, failed, error, skipped, not run
    reason: str = ""
    seconds: float = 0.0


def reason_of(text: str) -> str:
    """The one-line reason of a failure: the innermost exception type and message head.

    A worker's exception reaches pytest inside ``RuntimeError: Exception in worker
    process:`` followed by the worker's traceback; its last exception line is the reason.
    """
    found = ""
    for line in text.splitlines():
        match = ERROR_LINE.match(line.strip())
        if match and "Exception in worker process" not in match["msg"]:
            found = f"{match['type'].rsplit('.', 1)[-1]}: {match['msg']}"
    if not found:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        found = lines[0] if lines else "(no message)"
    return found[:220]


def env_for(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(HERE / "cpu_shims"), str(HERE), str(copy)]),
        TORCH_PIPELINING_CPU_SHIMS="1",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def pytest_command(copy: Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "pytest", "-c", str(copy / "pytest.ini"),
        "--rootdir", str(copy), "-p", "no:cacheprovider", *args,
    ]  # fmt: skip


def run_logged(command: list[str], cwd: Path, env: dict[str, str], log: Path, limit: float) -> int:
    """Run ``command`` in its own session, output to ``log``; kill the session afterwards."""
    with log.open("w") as out:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = -1
            out.write(f"\nKILLED after {limit:.0f}s\n")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # stray workers of the test classes
        process.wait()
    return rc


def collect(copy: Path, file: str, env: dict[str, str], logs: Path) -> tuple[list[str], str]:
    """The test ids of ``file`` in collection order, or ``([], reason)``."""
    log = logs / f"{file}.collect.log"
    run_logged(pytest_command(copy, "--collect-only", "-q", file), copy, env, log, 900)
    text = log.read_text()
    ids = [line.strip() for line in text.splitlines() if line.startswith(f"{file}::")]
    return ids, ("" if ids else "collection: " + reason_of(text))


def parse_junit(path: Path) -> dict[str, Result]:
    results: dict[str, Result] = {}
    if not path.exists():
        return results
    for case in ET.parse(path).getroot().iter("testcase"):
        module, _, cls = case.get("classname", "").rpartition(".")
        test_id = f"{module.replace('.', '/')}.py::{cls}::{case.get('name')}"
        seconds = float(case.get("time", "0") or 0)
        result = Result("passed", "", seconds)
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is None:
                continue
            text = (element.get("message") or "") + "\n" + (element.text or "")
            outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
            reason = (element.get("message") or "").strip() if kind == "skipped" else ""
            result = Result(outcome, reason[:220] or reason_of(text), seconds)
            break
        if result.outcome == "error" and test_id in results:
            continue  # a teardown error after the test's own result
        results[test_id] = result
    return results


def run_file(
    impl: str,
    copy: Path,
    file: str,
    timeout: float,
    env: dict[str, str] | None = None,
    logs: Path | None = None,
) -> dict[str, Result]:
    """Every test of ``file`` with a result of its own (see the module docstring).

    ``env`` and ``logs`` default to this client's (``env_for(copy)``, ``.work/<impl>/logs``);
    the fully_shard client (``clients/torch_fsdp``) passes its own."""
    env = env if env is not None else env_for(copy)
    logs = logs if logs is not None else WORK / impl / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ids, why = collect(copy, file, env, logs)
    if not ids:
        return {f"{file}::(collection)": Result("error", why)}
    results: dict[str, Result] = {}
    pending = list(ids)
    for round_ in range(1, len(ids) + 1):
        junit = logs / f"{file}.round{round_}.xml"
        log = logs / f"{file}.round{round_}.log"
        junit.unlink(missing_ok=True)
        command = pytest_command(
            copy, "-v", "-rA", f"--timeout={timeout:.0f}", "-p", "timeouts_plugin",
            f"--junitxml={junit}", *pending,
        )  # fmt: skip
        started = time.monotonic()
        rc = run_logged(command, copy, env, log, timeout * (len(pending) + 2))
        got = parse_junit(junit)
        print(
            f"  {impl} {file} round {round_}: {len(pending)} tests, rc {rc}, "
            f"{time.monotonic() - started:.0f}s",
            flush=True,
        )
        still = []
        for test_id in pending:
            result = got.get(test_id)
            if result is None or (result.outcome == "skipped" and POISONED in result.reason):
                still.append(test_id)
            else:
                results[test_id] = result
        if len(still) == len(pending):  # no progress: pytest died before any result
            why = "pytest ended without results: " + reason_of(log.read_text())
            results.update({test_id: Result("not run", why) for test_id in still})
            break
        pending = still
        if not pending:
            break
    return {test_id: results[test_id] for test_id in ids if test_id in results}


def redirect_table(upstream: Path) -> list[tuple[str, str]]:
    """``(torch name, plait object)`` for every name the plait copy imports from plait."""
    from redirected_pipelining._resolve import resolve

    seen: dict[str, str] = {}
    for path in sorted(upstream.iterdir()):
        if redirect.redirects(path):
            for module, name in redirect.imported_names(path.read_text()):
                seen.setdefault(f"{module}.{name}", resolve(module, name)[1])
    return sorted(seen.items())


def short(result: Result | None) -> str:
    if result is None:
        return "-"
    return {"passed": "pass", "failed": "FAIL", "error": "ERROR"}.get(
        result.outcome, result.outcome
    )


def command_line(
    upstream_help: str, default_files: list[str]
) -> tuple[argparse.Namespace, list[str], Path] | None:
    """The runner's command line (this client's and ``clients/torch_fsdp``'s): the parsed
    arguments, the test files to run and the upstream directory; None after ``--list``
    printed the files. Exits with a usage error when a file is missing upstream."""
    parser = argparse.ArgumentParser()
    parser.add_argument("upstream", type=Path, help=upstream_help)
    parser.add_argument("--only", nargs="*", default=None, help="test files to run")
    parser.add_argument("--impl", nargs="*", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per test")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    files = args.only or default_files
    if args.list:
        print("\n".join(files))
        return None
    upstream = args.upstream.resolve()
    missing = [f for f in files if not (upstream / f).exists()]
    if missing:
        parser.error(f"{upstream} lacks {', '.join(missing)} (see README.md)")
    return args, files, upstream


def main() -> int:
    parsed = command_line("torch's test/distributed/pipelining", list(FILES))
    if parsed is None:
        return 0
    args, files, upstream = parsed
    results: dict[str, dict[str, Result]] = {impl: {} for impl in IMPLS}
    for impl in args.impl:
        copy = WORK / impl / "pipelining"
        counts = redirect.make_copy(upstream, copy, on_plait=impl == "plait")
        shutil.rmtree(WORK / impl / "logs", ignore_errors=True)
        (copy / "pytest.ini").write_text("[pytest]\n")
        if counts:
            print(f"{impl}: import lines rewritten: {counts}; the names resolve to:")
            for torch_name, plait_name in redirect_table(upstream):
                print(f"  {torch_name} -> {plait_name}", flush=True)
        for file in files:
            results[impl].update(run_file(impl, copy, file, args.timeout))

    ids = list(dict.fromkeys([*results["torch"], *results["plait"]]))
    print("\n| test | torch | plait | reason (plait's; torch's when only torch fails) |")
    print("| --- | --- | --- | --- |")
    regressions: dict[str, list[str]] = {}
    for test_id in ids:
        t, p = results["torch"].get(test_id), results["plait"].get(test_id)
        reason = ""
        if p is not None and p.outcome != "passed":
            reason = p.reason
        elif t is not None and t.outcome != "passed":
            reason = "torch: " + t.reason
        print(f"| {test_id} | {short(t)} | {short(p)} | {reason.replace('|', '/')} |")
        if t is not None and t.outcome == "passed" and (p is None or p.outcome != "passed"):
            regressions.setdefault(p.reason if p else "not run", []).append(test_id)
    if "torch" in args.impl and "plait" in args.impl:
        print(f"\n{sum(map(len, regressions.values()))} tests pass on torch and not on plait:")
        for reason, tests in sorted(regressions.items(), key=lambda kv: -len(kv[1])):
            print(f"- {len(tests)} x {reason}")
            for test_id in tests:
                print(f"    {test_id}")
    summary = {impl: {k: asdict(v) for k, v in results[impl].items()} for impl in IMPLS}
    (WORK / "summary.json").write_text(json.dumps(summary, indent=1))
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
