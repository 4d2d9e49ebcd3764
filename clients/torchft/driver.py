"""One rank of one life of one replica group, on torch or on plait.

    driver.py {torch|plait} OUT_DIR --group G --life L --first-step S --last-step E
              [--scramble] [--hold STEP ...] --lighthouse URL [--timeout S] [--deadline S]

Started by ``check.py`` with ``MASTER_ADDR=127.0.0.1``, the group's own ``MASTER_PORT``,
``RANK`` and ``WORLD_SIZE=2``. It joins the group's gloo process group, loads
``program.py`` (through ``redirect.py`` on plait) and trains. Before each ``--hold`` step
it writes ``OUT_DIR/gates/held-g<G>-s<STEP>-r<RANK>`` and waits for
``OUT_DIR/gates/go-g<G>-s<STEP>`` (how the orchestrator starts groups together and makes a
returning group join at a given step). Writes ``OUT_DIR/g<G>-l<L>-r<RANK>.json``: every
step's loss, participants, commit and parameter shards. ``--deadline`` seconds after
start the process dumps its stacks and exits, whatever it is doing: it never hangs.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import redirect  # noqa: E402


def wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} from the orchestrator after {timeout_s} s")
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("impl", choices=("torch", "plait"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--life", type=int, required=True)
    parser.add_argument("--first-step", type=int, required=True)
    parser.add_argument("--last-step", type=int, required=True)
    parser.add_argument("--scramble", action="store_true")
    parser.add_argument("--hold", type=int, nargs="*", default=[])
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--deadline", type=float, default=120.0)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.deadline, exit=True)

    program = redirect.load(HERE / "program.py", "program", on_plait=args.impl == "plait")
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout * 3))
    rank = dist.get_rank()
    gates = args.out / "gates"

    def before_step(step: int) -> None:
        if step in args.hold:
            (gates / f"held-g{args.group}-s{step}-r{rank}").touch()
            wait_for(gates / f"go-g{args.group}-s{step}", args.deadline)

    plan = program.Plan(
        group=args.group,
        first_step=args.first_step,
        last_step=args.last_step,
        scramble=args.scramble,
        lighthouse=args.lighthouse,
        timeout_s=args.timeout,
    )
    trained = program.train(plan, before_step)
    result = {
        "impl": args.impl,
        "group": args.group,
        "life": args.life,
        "rank": rank,
        "pid": os.getpid(),
        "model_class": trained.model_class,
        "param_type": trained.param_type,
        "redirects": redirect.RESOLVED,
        "steps": [dataclasses.asdict(r) for r in trained.steps],
    }
    (args.out / f"g{args.group}-l{args.life}-r{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
