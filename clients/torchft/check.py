"""Run torchft fault-tolerant HSDP on torch and on plait, configuration by configuration.

    check.py [--only NAME ...] [--list] [--timeout S]

Each run starts a torchft lighthouse on 127.0.0.1 and two replica groups of two CPU
processes each (gloo; each group its own ``MASTER_PORT``), every process running
``driver.py``; it orchestrates groups that leave and come back, then kills whatever is
left. Scratch, logs and per-rank JSON go to ``clients/torchft/.work/<config>/<impl>/``,
the table to ``.work/summary.json`` too. Exits non-zero when a run fails (torch's or
plait's) or plait differs from torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORK = HERE / ".work"
PYTHON = Path(sys.executable)
LIGHTHOUSE = PYTHON.parent / "torchft_lighthouse"
RANKS = 2  # per replica group
STEPS = 5
TORCHFT_TIMEOUT_S = 10.0  # collectives, RPCs, checkpoint transfer
HEARTBEAT_TIMEOUT_MS = 1000  # a group that stopped heartbeating is gone after this


@dataclass(frozen=True)
class Life:
    """One group's processes, from start to exit."""

    group: int
    first_step: int
    last_step: int
    scramble: bool = False
    hold: tuple[int, ...] = ()  # steps the orchestrator releases (start, a peer's return)


@dataclass(frozen=True)
class Config:
    name: str
    label: str
    lives: tuple[Life, ...]
    heal_step: int | None = None  # the step at which a returning group heals


CONFIGS = (
    Config(
        "healthy",
        "healthy: both groups every step",
        (Life(0, 1, STEPS, hold=(1,)), Life(1, 1, STEPS, hold=(1,))),
    ),
    Config(
        "leave",
        "group 1 leaves after step 1",
        (Life(0, 1, STEPS, hold=(1,)), Life(1, 1, 1, hold=(1,))),
    ),
    Config(
        "heal",
        "group 1 leaves after step 1, returns scrambled at step 3, heals",
        (
            Life(0, 1, STEPS, hold=(1, 3)),
            Life(1, 1, 1, hold=(1,)),
            Life(1, 3, STEPS, scramble=True),
        ),
        heal_step=3,
    ),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Run:
    """One (configuration, implementation): its processes and where they write."""

    impl: str
    config: Config
    out: Path
    deadline: float
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    lighthouse_url: str = ""

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def spawn(self, key: str, command: list[str], env: dict[str, str]) -> None:
        log = (self.out / f"{key}.log").open("wb")
        self.procs[key] = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()

    def start_lighthouse(self) -> None:
        port = free_port()
        command = [
            str(LIGHTHOUSE), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1",
            "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS), "--join_timeout_ms", "10000",
            "--quorum_tick_ms", "50",
        ]  # fmt: skip
        self.spawn("lighthouse", command, dict(os.environ))
        self.lighthouse_url = f"http://127.0.0.1:{port}"
        self.until(lambda: self.lighthouse_status() is not None, "the lighthouse to listen")

    def lighthouse_status(self) -> tuple[int, int, int] | None:
        """(healthy participants waiting for a quorum, participants, heartbeating groups)."""
        try:
            with urllib.request.urlopen(f"{self.lighthouse_url}/status", timeout=2) as page:
                text = page.read().decode()
        except OSError:
            return None
        found = re.search(r"\[(\d+)/(\d+) participants healthy\]\[(\d+) heartbeating\]", text)
        if found is None:
            raise RuntimeError(f"unexpected lighthouse status page: {text[:500]}")
        healthy, participants, heartbeating = (int(g) for g in found.groups())
        return healthy, participants, heartbeating

    def start_life(self, index: int, life: Life) -> None:
        master_port = free_port()
        for rank in range(RANKS):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master_port),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(RANKS),
                GLOO_SOCKET_IFNAME="lo",
                PYTHONUNBUFFERED="1",
                OMP_NUM_THREADS="1",  # 4 processes share 2 cores
            )
            command = [
                str(PYTHON), str(HERE / "driver.py"), self.impl, str(self.out),
                "--group", str(life.group), "--life", str(index),
                "--first-step", str(life.first_step), "--last-step", str(life.last_step),
                "--lighthouse", self.lighthouse_url, "--timeout", str(TORCHFT_TIMEOUT_S),
                "--deadline", str(max(self.remaining(), 1.0)),
            ]  # fmt: skip
            if life.scramble:
                command.append("--scramble")
            if life.hold:
                command += ["--hold", *map(str, life.hold)]
            self.spawn(f"g{life.group}-l{index}-r{rank}", command, env)

    def life_keys(self, index: int, life: Life) -> list[str]:
        return [f"g{life.group}-l{index}-r{rank}" for rank in range(RANKS)]

    def until(self, ready: Callable[[], bool], what: str) -> None:
        """Poll ``ready()``; fail when the run's deadline passes or a process failed."""
        while not ready():
            failed = [k for k, p in self.procs.items() if p.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(f"waiting for {what}: {', '.join(failed)} failed")
            if self.remaining() < 0:
                raise TimeoutError(f"waiting for {what}: deadline passed")
            time.sleep(0.05)

    def hold_reached(self, group: int, step: int) -> None:
        """Wait until every rank of ``group`` holds before ``step``."""
        held = [self.out / "gates" / f"held-g{group}-s{step}-r{r}" for r in range(RANKS)]
        self.until(lambda: all(p.exists() for p in held), f"group {group} to hold at step {step}")

    def go(self, group: int, step: int) -> None:
        (self.out / "gates" / f"go-g{group}-s{step}").touch()

    def lighthouse_shows(self, participants: int | None, heartbeating: int, what: str) -> None:
        """Wait until the lighthouse has ``participants`` groups asking for the next quorum
        (None: any number) and ``heartbeating`` groups alive."""

        def shown() -> bool:
            status = self.lighthouse_status()
            return status is not None and (
                (participants is None or status[0] == participants) and status[2] == heartbeating
            )

        self.until(shown, what)

    def orchestrate(self) -> None:
        (self.out / "gates").mkdir(parents=True)
        self.start_lighthouse()
        lives = list(enumerate(self.config.lives))
        starting = [(i, life) for i, life in lives if life.first_step == 1]
        for i, life in starting:
            self.start_life(i, life)
        for _, life in starting:  # every rank has its manager and holds at step 1
            self.hold_reached(life.group, 1)
        # Every manager heartbeats, so the first quorum waits for all the groups.
        self.lighthouse_shows(None, len(starting), "every group to heartbeat")
        for _, life in starting:
            self.go(life.group, 1)
        for i, life in lives:
            if life.first_step == 1:
                continue
            for j, other in lives[:i]:  # the group's previous processes are gone
                if other.group == life.group:
                    self.wait_exit(self.life_keys(j, other))
            # The groups still running hold before the step of the return...
            peers = [
                o.group for _, o in lives if o.group != life.group and life.first_step in o.hold
            ]
            for peer in peers:
                self.hold_reached(peer, life.first_step)
            self.start_life(i, life)
            # ...until the returning group has asked the lighthouse for a quorum: had a
            # healthy group asked first, its fast quorum would have left the return out.
            self.lighthouse_shows(1, 1 + len(peers), f"group {life.group} to ask for a quorum")
            for peer in peers:
                self.go(peer, life.first_step)
        self.wait_exit([key for key in self.procs if key != "lighthouse"])

    def wait_exit(self, keys: list[str]) -> None:
        procs = [self.procs[key] for key in keys]
        self.until(lambda: all(p.poll() is not None for p in procs), f"{', '.join(keys)} to end")

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # its own session: ours only
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@dataclass
class Outcome:
    ran: bool
    ranks: dict[str, dict[str, Any]]  # "g<G>-l<L>-r<R>" -> the driver's JSON
    errors: list[str]
    seconds: float


def first_error(log: str) -> str | None:
    """The first exception line of a process's log: the cause, not its consequences
    (e.g. torchft's checkpoint server failing, rather than the peer that lost it)."""
    pattern = re.compile(r"^(\[rank\d+\]: )?\w*(Error|Exception)\b")
    lines = [line for line in log.splitlines() if pattern.match(line)]
    return lines[0].strip()[:400] if lines else None


def run_one(impl: str, config: Config, timeout: float) -> Outcome:
    out = WORK / config.name / impl
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    start = time.monotonic()
    run = Run(impl, config, out, deadline=start + timeout)
    errors = []
    try:
        run.orchestrate()
    except (RuntimeError, TimeoutError) as e:
        errors.append(f"orchestrator: {e}")
    finally:
        run.kill_all()
    for key, proc in run.procs.items():
        if key != "lighthouse" and proc.returncode != 0:
            log = (out / f"{key}.log").read_text(errors="replace")
            reason = first_error(log)
            if proc.returncode == -signal.SIGKILL:  # still running when the run stopped
                reason = "killed by the check" + (
                    f" (first error in its log: {reason})" if reason else ""
                )
            errors.append(f"{key}: {reason or f'exit code {proc.returncode}'}")
    ranks = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("g*-l*-r*.json"))}
    expected = sum(RANKS for _ in config.lives)
    ran = not errors and len(ranks) == expected
    return Outcome(ran, ranks, errors, time.monotonic() - start)


def participants(outcome: Outcome, config: Config) -> str:
    """Participants per step, as each group's rank 0 manager saw them."""
    parts = []
    for group in sorted({life.group for life in config.lives}):
        by_step: dict[int, int] = {}
        for rank in outcome.ranks.values():
            if rank["group"] == group and rank["rank"] == 0:
                for s in rank["steps"]:
                    by_step[s["step"]] = s["participants"]
        row = [str(by_step[s]) if s in by_step else "-" for s in range(1, STEPS + 1)]
        parts.append(f"g{group}: {' '.join(row)}")
    return "; ".join(parts)


def compare(torch_run: Outcome, plait_run: Outcome) -> tuple[float, float, list[str]]:
    """Max |loss diff| and |weight diff| over every rank and step; other mismatches."""
    loss_diff, weight_diff, notes = 0.0, 0.0, []
    for key, t in torch_run.ranks.items():
        p = plait_run.ranks[key]
        for ts, ps in zip(t["steps"], p["steps"], strict=True):
            loss_diff = max(loss_diff, abs(ts["loss"] - ps["loss"]))
            for name, values in ts["weights"].items():
                for a, b in zip(values, ps["weights"][name], strict=True):
                    weight_diff = max(weight_diff, abs(a - b))
            for what in ("participants", "participating", "committed", "manager_step"):
                if ts[what] != ps[what]:
                    notes.append(f"{key} step {ts['step']}: {what} {ts[what]} vs {ps[what]}")
    return loss_diff, weight_diff, notes


def groups_identical(outcome: Outcome, config: Config) -> str:
    """After the heal, do both groups hold the same weights (per rank, every step)?"""
    if config.heal_step is None:
        return "-"
    verdicts = []
    for step in range(config.heal_step, STEPS + 1):
        same = True
        for rank in range(RANKS):
            shards = []
            for r in outcome.ranks.values():
                if r["rank"] == rank:
                    shards += [s["weights"] for s in r["steps"] if s["step"] == step]
            same &= len(shards) == 2 and shards[0] == shards[1]
        verdicts.append(f"{step}: {'yes' if same else 'NO'}")
    return "after step " + ", ".join(verdicts)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--timeout", type=float, default=150.0, help="per run, seconds")
    args = parser.parse_args()
    if args.list:
        print("\n".join(f"{c.name}: {c.label}" for c in CONFIGS))
        return 0
    chosen = [c for c in CONFIGS if args.only is None or c.name in args.only]
    rows, summary, failed, start = [], [], False, time.monotonic()
    for config in chosen:
        t = run_one("torch", config, args.timeout)
        p = run_one("plait", config, args.timeout)
        loss, weight, notes = "-", "-", list[str]()
        if t.ran and p.ran:
            loss_diff, weight_diff, notes = compare(t, p)
            loss, weight = f"{loss_diff:.3g}", f"{weight_diff:.3g}"
            failed |= loss_diff != 0.0 or weight_diff != 0.0 or bool(notes)
        failed |= not (t.ran and p.ran)  # nothing compared is a failure too
        identical = {impl: groups_identical(o, config) for impl, o in (("torch", t), ("plait", p))}
        heal = (
            "-"
            if config.heal_step is None
            else f"torch {identical['torch'] if t.ran else '-'}; "
            f"plait {identical['plait'] if p.ran else '-'}"
        )
        failed |= p.ran and "NO" in identical["plait"]
        notes += [f"torch {e}" for e in t.errors] + [f"plait {e}" for e in p.errors]
        seen = p if p.ran else t
        row = (
            config.label,
            "yes" if t.ran else "NO",
            "yes" if p.ran else "NO",
            participants(seen, config),
            loss,
            weight,
            heal,
            f"{t.seconds:.0f} s / {p.seconds:.0f} s",
        )
        rows.append(row)
        summary.append({"config": config.name, "row": row, "notes": notes})
        print(f"{config.name}: torch ran={t.ran} plait ran={p.ran} loss diff={loss}", flush=True)
        for note in notes:
            print(f"  {note}", flush=True)
    header = (
        "configuration", "torch ran", "plait ran", "participants per step (torch's run is "
        "shown when plait's did not finish)", "max abs loss diff", "max abs weight diff",
        "groups hold identical weights", "time torch / plait",
    )  # fmt: skip
    print("\n| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for entry in summary:
        for note in entry["notes"]:
            print(f"- {entry['config']}: {note}")
    print(f"\n{len(rows)} configurations in {time.monotonic() - start:.0f} s")
    WORK.mkdir(exist_ok=True)
    (WORK / "summary.json").write_text(json.dumps(summary, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
