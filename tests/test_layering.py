"""plait's imports run one way (docs/architecture.md): core <- APIs <- train <- plan <- cli.

The source is read, not run, so every import counts wherever it stands: at module level,
inside a function, under ``if TYPE_CHECKING:``, relative, or through
``importlib.import_module("plait....")``. A unit is a top-level module or package of
``src/plait``; each has a layer (:data:`LAYERS`), and a unit imports only units of its own
layer or below. Within a layer (core modules among themselves, APIs among themselves) the
imports must not go round in a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "plait"
ROOT = "plait"  # the unit of src/plait/__init__.py, the package's public face

CORE, APIS, TRAIN, PLAN, COMMAND = range(5)
#: Every unit's layer. A new module or package of src/plait takes its place here (and in
#: docs/architecture.md's map).
LAYERS = {
    # core: what every API builds on; imports torch only
    "contract": CORE,
    "hooks": CORE,
    "logs": CORE,
    "mesh": CORE,
    "spmd": CORE,
    "layout": CORE,
    "lazy": CORE,
    # the composable APIs; the package root re-exports them
    "checkpoint": APIS,
    "fsdp": APIS,
    "replicate": APIS,
    "experts": APIS,
    "context": APIS,
    "pipeline": APIS,
    ROOT: APIS,
    # plait train, then plait plan (which predicts what train runs), then the command
    "train": TRAIN,
    "plan": PLAN,
    "cli": COMMAND,
    "__main__": COMMAND,
}
LAYER_NAMES = ["core", "an API", "train", "plan", "the command"]


def unit_of_file(path: Path, src: Path) -> str:
    """The unit ``path`` (a file under ``src``) belongs to."""
    top = path.relative_to(src).parts[0]
    return ROOT if top == "__init__.py" else top.removesuffix(".py")


def module_of_file(path: Path, src: Path) -> list[str]:
    """``path``'s dotted module name as parts, ``plait`` first."""
    parts = [src.name, *path.relative_to(src).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def unit_of_module(module: str, src: Path) -> str | None:
    """The unit of dotted ``module``, None outside plait."""
    parts = module.split(".")
    if parts[0] != src.name:
        return None
    if len(parts) == 1:
        return ROOT
    return parts[1] if (src / parts[1]).is_dir() or (src / f"{parts[1]}.py").is_file() else ROOT


def imported(tree: ast.AST, path: Path, src: Path) -> list[tuple[int, str]]:
    """Every plait module ``tree`` (the source of ``path``) imports, with its line: ``from
    a import b`` counts as ``a.b`` (``b`` may be a module), relative imports are resolved."""
    package = module_of_file(path, src)
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return [(line, name) for line, name in found if name.split(".")[0] == src.name]


def import_edges(src: Path) -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, ``file:line``) for every import between two units."""
    edges = []
    for path in sorted(src.rglob("*.py")):
        unit = unit_of_file(path, src)
        for line, module in imported(ast.parse(path.read_text(), str(path)), path, src):
            target = unit_of_module(module, src)
            if target is not None and target != unit:
                edges.append((unit, target, f"{path.relative_to(src.parent)}:{line}"))
    return edges


def upward_imports(src: Path) -> list[str]:
    """The imports of a unit from a layer above its own."""
    return [
        f"{where}: {unit} ({LAYER_NAMES[LAYERS[unit]]}) imports {target} "
        f"({LAYER_NAMES[LAYERS[target]]})"
        for unit, target, where in import_edges(src)
        if LAYERS.get(target, CORE) > LAYERS.get(unit, COMMAND)
    ]


def cycle(src: Path) -> list[str]:
    """A circle of units importing each other (``[]``: none)."""
    graph: dict[str, set[str]] = {}
    for unit, target, _ in import_edges(src):
        graph.setdefault(unit, set()).add(target)
    done: set[str] = set()

    def visit(unit: str, path: list[str]) -> list[str]:
        if unit in path:
            return [*path[path.index(unit) :], unit]
        if unit in done:
            return []
        for target in sorted(graph.get(unit, ())):
            if found := visit(target, [*path, unit]):
                return found
        done.add(unit)
        return []

    for unit in sorted(graph):
        if found := visit(unit, []):
            return found
    return []


def test_every_unit_has_a_layer() -> None:
    units = {unit_of_file(path, SRC) for path in SRC.rglob("*.py")}
    assert units - set(LAYERS) == set(), "place the new unit in LAYERS (and docs/architecture.md)"


def test_imports_point_down_the_layers() -> None:
    assert upward_imports(SRC) == []


def test_no_units_import_each_other_in_a_circle() -> None:
    assert cycle(SRC) == []


def test_train_and_plan_stay_apart_from_what_is_above_them() -> None:
    edges = {(unit, target) for unit, target, _ in import_edges(SRC)}
    assert not {("train", "plan"), ("train", "cli"), ("plan", "cli")} & edges
    core = [u for u, layer in LAYERS.items() if layer == CORE]
    assert not {(u, t) for u, t in edges if u in core and LAYERS[t] > CORE}


def test_the_check_finds_every_import_form(tmp_path: Path) -> None:
    src = tmp_path / "plait"
    for package in ("train", "plan", "fsdp"):
        (src / package).mkdir(parents=True)
        (src / package / "__init__.py").write_text("")
    (src / "__init__.py").write_text("from plait.fsdp import fully_shard\n")
    (src / "layout.py").write_text("")
    hidden = {
        "a.py": "def f():\n    from plait.plan import x\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import plait.plan.y\n",
        "c.py": "from ..plan import z\n",
        "d.py": "import importlib\nimportlib.import_module('plait.plan.w')\n",
        "e.py": "from plait import plan\n",
    }
    for name, text in hidden.items():
        (src / "train" / name).write_text(text)
    (src / "layout.py").write_text("from plait import fully_shard\n")  # via the root: an API
    found = upward_imports(src)
    assert len(found) == len(hidden) + 1, found
    for name in hidden:
        assert any(f"plait/train/{name}" in line and "imports plan" in line for line in found)
    assert any("plait/layout.py:1: layout (core) imports plait (an API)" in f for f in found)
    (src / "fsdp" / "loop.py").write_text("def f():\n    from plait.layout import PP\n")
    (src / "layout.py").write_text("from plait.fsdp import loop\n")
    assert cycle(src) in (["fsdp", "layout", "fsdp"], ["layout", "fsdp", "layout"])
