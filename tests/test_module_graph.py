"""The house rules below the units of tests/test_layering.py, file by file
(docs/architecture.md, Import rules): no two modules of ``src/plait`` import each other
in a circle, and no file is over :data:`MAX_LINES` lines.

Every import counts, as in the layering test (module level, inside a function, under
``if TYPE_CHECKING:``, relative, ``importlib.import_module``): a lazy import that closes a
circle is a cycle moved to run time, not a cycle removed. ``from a import b`` counts as an
import of module ``a.b`` when that module exists, else of ``a`` (its ``__init__``).
Importing ``a.b`` is an edge to ``a.b`` only: that Python also runs ``a/__init__.py`` first
is how packages work, not a dependency the importing file states.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_layering import SRC, imported, module_of_file

#: The longest a file of src/plait may be: one screen or a few (docs/architecture.md).
MAX_LINES = 500


def module_graph(src: Path) -> dict[str, dict[str, str]]:
    """``{module: {imported module: "file:line" of the first such import}}`` over every
    ``.py`` file under ``src`` (dotted names, ``plait`` first)."""
    files = {".".join(module_of_file(path, src)): path for path in sorted(src.rglob("*.py"))}
    graph: dict[str, dict[str, str]] = {}
    for module, path in files.items():
        targets = graph.setdefault(module, {})
        for line, name in imported(ast.parse(path.read_text(), str(path)), path, src):
            parts = name.split(".")
            while parts and ".".join(parts) not in files:
                parts.pop()  # an attribute, not a module: the module that holds it
            target = ".".join(parts)
            if target and target != module:
                targets.setdefault(target, f"{path.relative_to(src.parent)}:{line}")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One circle of imports per strongly connected group of modules (``[]``: none), each
    as ``["a", "b", ..., "a"]``, every arrow annotated with where the import stands."""
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        for target in sorted(graph.get(module, {})):
            if circle := visit(target, [*path, module]):
                return circle
        done.add(module)
        return []

    for module in sorted(graph):
        circle = visit(module, [])
        if circle:
            found.append(
                [
                    f"{a} ({graph[a][b]})" if i < len(circle) - 1 else a
                    for i, (a, b) in enumerate(zip(circle, [*circle[1:], circle[0]], strict=True))
                ]
            )
            done.update(circle)  # report each circle once, then look for others
    return found


def long_files(src: Path, limit: int = MAX_LINES) -> list[str]:
    """``"path: N lines"`` for every file under ``src`` over ``limit`` lines."""
    return [
        f"{path.relative_to(src.parent)}: {n} lines"
        for path in sorted(src.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > limit
    ]


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert cycles(module_graph(SRC)) == [], "put the command or shared part above/below both"


def test_no_file_is_over_the_line_cap() -> None:
    assert long_files(SRC) == [], f"split by concept: at most {MAX_LINES} lines a file"


def test_the_checks_find_lazy_cycles_and_long_files(tmp_path: Path) -> None:
    src = tmp_path / "plait"
    (src / "train").mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "train" / "__init__.py").write_text("")
    (src / "train" / "loop.py").write_text("from plait.train.hf import load\n")
    # The cycle closed inside a function, and through `from package import module`.
    (src / "train" / "hf.py").write_text("def export():\n    from plait.train import loop\n")
    (src / "train" / "data.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (src / "train" / "ok.py").write_text("from plait.train.data import x\n")
    graph = module_graph(src)
    assert graph["plait.train.ok"] == {"plait.train.data": "plait/train/ok.py:1"}
    assert cycles(graph) == [
        [
            "plait.train.hf (plait/train/hf.py:2)",
            "plait.train.loop (plait/train/loop.py:1)",
            "plait.train.hf",
        ]
    ]
    assert long_files(src) == [f"plait/train/data.py: {MAX_LINES + 1} lines"]
    (src / "train" / "hf.py").write_text("def load():\n    pass\n")
    assert cycles(module_graph(src)) == []


def unmapped(src: Path, doc: str) -> list[str]:
    """Files of ``src`` whose name ``doc`` (docs/architecture.md) never mentions, package
    ``__init__.py`` and ``__main__.py`` aside (a file is named by its basename in its room)."""
    names = (p for p in sorted(src.rglob("*.py")) if p.name not in ("__init__.py", "__main__.py"))
    return [str(p.relative_to(src.parent)) for p in names if f"{p.name}" not in doc]


def test_every_file_is_in_a_room_of_the_map() -> None:
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    assert unmapped(SRC, doc) == [], "name the new file in its room of docs/architecture.md"
    assert unmapped(SRC, doc.replace("`counts.py`", "")) == ["plait/experts/counts.py"]
