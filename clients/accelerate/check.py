"""Run every configuration twice (torch, plait) and print the comparison table.

    check.py [--only NAME ...] [--list] [--timeout S]

Each run is ``torchrun --standalone --nproc_per_node 2 driver.py IMPL CONFIG DIR`` on CPU
(4 processes for ``transformers-tp2-fsdp2``)
(gloo); scratch and logs go to ``clients/accelerate/.work/<config>/<impl>/``. Exits
non-zero when a configuration torch runs fails on plait or differs from torch.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = HERE / ".work"
CONFIGS = (
    "fsdp2",
    "fsdp2-ac",
    "fsdp2-cpu-offload",
    "fsdp2-no-reshard",
    "fsdp2-state-dict",
    "transformers-fsdp2",
    "transformers-tp2-fsdp2",
)
NPROC = 2
# transformers' own TP x FSDP: tp 2 x fsdp 2
NPROC_OF = {"transformers-tp2-fsdp2": 4}
# Where torch's own run fails, plait is compared with torch's nearest configuration that
# runs: torch 2.13's CPU offload pins host memory, which needs an accelerator.
NEAREST = {"fsdp2-cpu-offload": "fsdp2"}


def run_one(impl: str, config: str, timeout: float) -> tuple[bool, list[dict[str, object]], str]:
    """Run one (implementation, configuration); return (ran, per-rank results, log tail)."""
    out = WORK / config / impl
    nproc = NPROC_OF.get(config, NPROC)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", str(HERE / "driver.py"), impl, config, str(out),
    ]  # fmt: skip
    env_log = out / "log.txt"
    try:
        done = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, text=True
        )
        log, ok = done.stdout, done.returncode == 0
    except subprocess.TimeoutExpired as expired:
        log, ok = f"{expired.output or ''}\nTIMEOUT after {timeout}s", False
    env_log.write_text(log)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)
             if (out / f"rank{r}.json").exists()]  # fmt: skip
    return ok and len(ranks) == nproc, ranks, log


def first_error(log: str) -> str:
    """The last exception line of a failed run's log (what to report)."""
    lines = [
        line
        for line in log.splitlines()
        if re.match(r"^\[rank\d+\]: \w+(Error|Exception)\b", line) or "TIMEOUT" in line
    ]
    return lines[-1].strip()[:300] if lines else log.strip().splitlines()[-1:][0][:300]


def losses(rank: dict[str, object]) -> list[float]:
    values = list(rank["losses"])  # type: ignore[call-overload]
    values += list(rank.get("losses_after_load", []))  # type: ignore[call-overload]
    return values


def max_diff(torch_ranks: list[dict[str, object]], plait_ranks: list[dict[str, object]]) -> float:
    """Largest |loss difference| over every rank and step."""
    return max(
        abs(a - b)
        for t, p in zip(torch_ranks, plait_ranks, strict=True)
        for a, b in zip(losses(t), losses(p), strict=True)
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    if args.list:
        print("\n".join(CONFIGS))
        return 0
    rows, failed = [], False
    for config in args.only or CONFIGS:
        t_ok, t_ranks, t_log = run_one("torch", config, args.timeout)
        p_ok, p_ranks, p_log = run_one("plait", config, args.timeout)
        diff = "-"
        if not t_ok and p_ok and config in NEAREST:
            _, t_ranks, _ = run_one("torch", NEAREST[config], args.timeout)
            t_ok_ref = len(t_ranks) == NPROC
            if t_ok_ref:
                diff_value = max_diff(t_ranks, p_ranks)
                diff = f"{diff_value:.3g} (vs torch {NEAREST[config]})"
                failed |= diff_value != 0.0
        if t_ok and p_ok:
            diff_value = max_diff(t_ranks, p_ranks)
            diff = f"{diff_value:.3g}"
            failed |= diff_value != 0.0
        failed |= t_ok and not p_ok
        note = ""
        if not t_ok:
            note += f"torch: {first_error(t_log)} "
        if not p_ok:
            note += f"plait: {first_error(p_log)}"
        if p_ok and "replay_matches" in p_ranks[0]:
            note += f"replay after load_state matches: {p_ranks[0]['replay_matches']}"
        rows.append((config, "yes" if t_ok else "NO", "yes" if p_ok else "NO", diff, note))
        print(f"{config}: torch={t_ok} plait={p_ok} diff={diff} {note}", flush=True)
    print("\n| configuration | torch ran | plait ran | max abs loss diff | note |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
