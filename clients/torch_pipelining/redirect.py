"""Make the plait copy of torch's upstream pipelining tests: import lines rewritten only.

The only difference between the torch run and the plait run. The upstream directory is
copied twice under ``.work/``; in the plait copy, the test files (``test_*.py``) and the
schedule zoo ``schedule_registry.py`` (custom schedules written against the schedule API,
which the tests drive like any test code) get every import line of the form

    from torch.distributed.pipelining import ...
    from torch.distributed.pipelining.schedules import ...
    from torch.distributed.pipelining.stage import ...
    from torch.distributed.pipelining.microbatch import ...

(indented ones inside test functions too) rewritten to import the same names from
:mod:`redirected_pipelining` (this directory, put on ``PYTHONPATH``), whose modules hand
out plait's objects of the same names (:mod:`redirected_pipelining._resolve`). Nothing else
changes: no name is renamed, no argument adapted, and imports from torch's private modules
(``torch.distributed.pipelining._utils``) stay torch's. ``model_registry.py`` is copied
unchanged: its models keep calling torch's own ``pipe_split`` and declaring torch's own
``SplitPoint``, which plait's tracer must accept.

A textual rewrite rather than an import hook because torch's multi-process tests spawn
their workers with ``multiprocessing``'s spawn method, and each worker imports the test
module afresh: a rewritten file needs nothing installed in the workers.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

TORCH_MODULES = (
    "torch.distributed.pipelining",
    "torch.distributed.pipelining.schedules",
    "torch.distributed.pipelining.stage",
    "torch.distributed.pipelining.microbatch",
)
SHIM_PACKAGE = "redirected_pipelining"
IMPORT_LINE = re.compile(
    r"^(?P<indent>[ \t]*)from torch\.distributed\.pipelining"
    r"(?P<sub>\.schedules|\.stage|\.microbatch)?(?P<rest> import\b)",
    re.MULTILINE,
)


def redirects(path: Path) -> bool:
    """Whether the plait copy of ``path`` gets its imports redirected."""
    return path.suffix == ".py" and (
        path.name.startswith("test_") or path.name == "schedule_registry.py"
    )


def rewrite(source: str) -> tuple[str, int]:
    """``source`` with its pipelining import lines pointed at the shim; and their count."""
    return IMPORT_LINE.subn(
        lambda m: f"{m['indent']}from {SHIM_PACKAGE}{m['sub'] or ''}{m['rest']}", source
    )


def imported_names(source: str) -> list[tuple[str, str]]:
    """``(torch module, name)`` for every redirected name ``source`` imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in TORCH_MODULES:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def make_copy(upstream: Path, dest: Path, on_plait: bool) -> dict[str, int]:
    """Copy ``upstream`` to ``dest``; on plait, rewrite. Returns lines rewritten per file."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(upstream, dest, ignore=shutil.ignore_patterns("__pycache__"))
    counts: dict[str, int] = {}
    if on_plait:
        for path in sorted(dest.iterdir()):
            if redirects(path):
                text, counts[path.name] = rewrite(path.read_text())
                path.write_text(text)
    return counts
