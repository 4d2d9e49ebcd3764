"""Make the plait copy of torch's fully_shard / composable tests: import lines rewritten only.

The only difference between the torch run and the plait run. The upstream directory
(``test/distributed/_composable``) is copied twice under ``.work/``; in the plait copy,
every test file (``test_*.py``, ``fsdp/`` included) gets every import line of the form

    from torch.distributed.fsdp[.<module>] import ...
    from torch.distributed._composable[.<module>] import ...
    from torch.utils.checkpoint import ...   (the error composable checkpoint raises)

(indented ones inside test functions too) rewritten to import the same names from
``redirected_fsdp.torch.distributed...`` (:mod:`redirected_fsdp`, put on ``PYTHONPATH``),
which hands out plait's objects of the same names, or torch's own for torch-private
modules plait has no counterpart of (:mod:`redirected_fsdp._resolve`). Nothing else
changes. torch's test helper ``common_fsdp`` is not copied: in the plait run the CPU shims
point its own imports of the same names at the same objects.

Textual, like the pipelining client's (``clients/torch_pipelining/redirect.py``), because
torch's multi-process tests spawn their workers, which import the test module afresh.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

SHIM_PACKAGE = "redirected_fsdp"
# torch.utils.checkpoint for the error composable checkpoint raises (CheckpointError): its
# other names (the functional checkpoint) stay torch's, see redirected_fsdp._resolve.
_MODULES = r"torch\.(?:distributed\.(?:fsdp|_composable)(?:\.\w+)*|utils\.checkpoint)"
REDIRECTED = re.compile(_MODULES)
IMPORT_LINE = re.compile(
    rf"^(?P<indent>[ \t]*)from (?P<module>{_MODULES})(?P<rest> import\b)", re.MULTILINE
)


def redirects(path: Path) -> bool:
    """Whether the plait copy of ``path`` gets its imports redirected."""
    return path.suffix == ".py" and path.name.startswith("test_")


def rewrite(source: str) -> tuple[str, int]:
    """``source`` with its fsdp / composable import lines pointed at the shim; their count."""
    return IMPORT_LINE.subn(
        lambda m: f"{m['indent']}from {SHIM_PACKAGE}.{m['module']}{m['rest']}", source
    )


def imported_names(source: str) -> list[tuple[str, str]]:
    """``(torch module, name)`` for every redirected name ``source`` imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and REDIRECTED.fullmatch(node.module):
            found += [(node.module, alias.name) for alias in node.names]
    return found


def make_copy(upstream: Path, dest: Path, files: list[str], on_plait: bool) -> dict[str, int]:
    """Copy ``files`` (paths relative to ``upstream``) to ``dest``; on plait, rewrite them.

    Returns the import lines rewritten per file."""
    shutil.rmtree(dest, ignore_errors=True)
    counts: dict[str, int] = {}
    for file in files:
        target = dest / file
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(upstream / file, target)
        if on_plait and redirects(target):
            text, counts[file] = rewrite(target.read_text())
            target.write_text(text)
    return counts
