"""How long ``plait plan`` takes to search 10,240 H100s for Llama 3 405B, from a cold start.

Command line (from the repository root)::

    .venv/bin/python -m benchmarks.plan_speed --repeats 5

Each repeat is a fresh process (no cache), timing ``plan()`` alone in CPU seconds (not the
imports), so other load on the machine counts little; the report gives the median and the
range. Measured about 1.0-1.5 s on a 2-core machine and 3-5 s on a slower, loaded one: a
figure to watch, not a test (timings are not asserted in the test suite).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_COLD = """
import time
from plait.plan import Workload, device, plan, preset
start = time.process_time()
plan(preset("llama3-405b"), Workload(8192, 10240), device("h100"), 10240)
print(time.process_time() - start)
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    seconds = []
    for _ in range(args.repeats):
        out = subprocess.run(
            [sys.executable, "-c", _COLD], capture_output=True, text=True, check=True
        )
        seconds.append(float(out.stdout.strip()))
    print(
        f"cold 10,240-GPU search (llama3-405b, 8192 x 10240 tokens, h100): median "
        f"{statistics.median(seconds):.2f} s of CPU, range {min(seconds):.2f}-"
        f"{max(seconds):.2f} s over {args.repeats} fresh processes"
    )


if __name__ == "__main__":
    main()
