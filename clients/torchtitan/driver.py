"""One rank of torchtitan's trainer, on torch or on plait.

Usage (under torchrun, one process per rank)::

    driver.py {torch|plait} METRICS_DIR -- <torchtitan.train arguments>

Order matters: the import redirection (plait only) is installed before torchtitan is
imported, then the CPU shims (both implementations), then ``torchtitan.train.main`` runs
exactly as ``python -m torchtitan.train`` would. The driver also records every metrics
line torchtitan logs (step, loss, grad norm, as exact floats) to
``METRICS_DIR/rank<RANK>.jsonl``, and which object each redirected name resolved to in
``METRICS_DIR/redirects.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def _record_metrics(metrics_dir: Path) -> None:
    """Wrap torchtitan's ``MetricsProcessor.log`` to keep its numbers unrounded."""
    from torchtitan.components.metrics import MetricsProcessor

    logged = MetricsProcessor.log
    out = metrics_dir / f"rank{os.environ.get('RANK', '0')}.jsonl"

    def log(
        self: Any,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: Any = None,
    ) -> None:
        with out.open("a") as f:
            f.write(
                json.dumps(
                    {"step": step, "loss": float(global_avg_loss), "grad_norm": float(grad_norm)}
                )
                + "\n"
            )
        logged(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    MetricsProcessor.log = log  # type: ignore[method-assign]


def main() -> None:
    impl, metrics_dir, sep, *titan_args = sys.argv[1:]
    if impl not in ("torch", "plait") or sep != "--":
        raise SystemExit(__doc__)
    metrics = Path(metrics_dir)
    metrics.mkdir(parents=True, exist_ok=True)

    import redirect

    if impl == "plait":
        redirect.install()

    import cpu_shims

    cpu_shims.install()
    _record_metrics(metrics)

    from torchtitan.train import main as titan_main

    sys.argv = ["torchtitan.train", *titan_args]
    try:
        titan_main()
    finally:
        if impl == "plait" and os.environ.get("RANK", "0") == "0":
            (metrics / "redirects.json").write_text(json.dumps(redirect.RESOLVED, indent=1))


if __name__ == "__main__":
    main()
