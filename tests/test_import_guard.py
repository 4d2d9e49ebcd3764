"""plait's library code must never import torch's own implementations of what plait is."""

from __future__ import annotations

import ast
from pathlib import Path

FORBIDDEN = (
    "torch.distributed.fsdp",
    "torch.distributed._composable",
    "torch.distributed.pipelining",
    "torch.nn.parallel",
    "torch.utils.checkpoint",
    "torch.distributed.algorithms",
)
SRC = Path(__file__).resolve().parents[1] / "src" / "plait"


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module an import statement can bind, including ``from a.b import c`` as a.b.c."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def forbidden_imports(root: Path) -> list[str]:
    hits = []
    for path in sorted(root.rglob("*.py")):
        for lineno, name in imported_modules(ast.parse(path.read_text(), str(path))):
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN):
                hits.append(f"{path.relative_to(root.parent)}:{lineno} imports {name}")
    return hits


def test_library_imports_no_torch_implementation_of_plait() -> None:
    assert SRC.is_dir()
    assert forbidden_imports(SRC) == []


def test_guard_detects_every_import_form(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("import torch.nn.parallel\n")
    (pkg / "b.py").write_text("from torch.distributed import fsdp\n")
    (pkg / "c.py").write_text("from torch.utils.checkpoint import checkpoint\n")
    (pkg / "d.py").write_text("def f():\n    import torch.distributed.pipelining.schedules\n")
    (pkg / "e.py").write_text("import torch.distributed.tensor\nfrom torch import nn\n")
    (pkg / "f.py").write_text("from torch.utils.checkpoint import CheckpointError as E\n")
    (pkg / "h.py").write_text("import torch.utils.checkpoint\n")
    hits = forbidden_imports(pkg)
    assert len([h for h in hits if "a.py" in h]) == 1
    assert any("b.py" in h and "torch.distributed.fsdp" in h for h in hits)
    assert any("c.py" in h for h in hits)
    assert any("d.py" in h for h in hits)
    assert not any("e.py" in h for h in hits)
    assert any("f.py" in h and "torch.utils.checkpoint.CheckpointError" in h for h in hits)
    assert any("h.py" in h for h in hits)
