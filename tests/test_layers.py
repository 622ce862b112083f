"""The package's layers: imports flow one way, and no module grows too large.

Run by ``make lint`` too. Each module belongs to the layer of the longest
prefix below that names it; it may import modules of its own top-level
package and of lower layers, never of higher ones. Imports under
``if TYPE_CHECKING:`` are for the type checker only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "rpcdist"

#: Lowest first. A name is a module or package prefix under ``rpcdist``.
LAYERS: list[list[str]] = [
    [
        "rpcdist._errors",
        "rpcdist._deadline",
        "rpcdist._options",
        "rpcdist._worker",
        "rpcdist._futures",
        "rpcdist._loop",
        "rpcdist._pool",
        "rpcdist._publish",
        "rpcdist._proto",
        "rpcdist.functions",
        "rpcdist.futures",
    ],
    ["rpcdist._serialization"],
    ["rpcdist.tensor", "rpcdist.nn", "rpcdist.optim", "rpcdist._save", "rpcdist.data"],
    ["rpcdist._transport"],
    ["rpcdist._store"],
    ["rpcdist._rpc"],
    ["rpcdist._rref"],
    ["rpcdist.collectives"],
    ["rpcdist.autograd", "rpcdist.optim._distributed", "rpcdist.nn._remote"],
    ["rpcdist.parallel"],
    ["rpcdist.torch"],
    ["rpcdist.launch", "rpcdist.testing"],
    ["rpcdist"],  # the face: composes everything
]
MAX_LINES = 600


def _layer(module: str) -> tuple[int, str]:
    best: tuple[int, str] | None = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (
                best is None or len(name) > len(best[1])
            ):
                best = (i, name)
    assert best is not None, f"{module} is in no layer"
    return best


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _runtime_imports(module: str, path: Path) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import not under ``TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None or (node.level and not node.module):
                found.extend((node.lineno, f"{target}.{a.name}") for a in node.names)
            else:
                found.append((node.lineno, target))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [(line, name) for line, name in found if name.startswith("rpcdist")]


def _top(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_imports_flow_downward_only():
    modules = _modules()
    bad = []
    for module, path in sorted(modules.items()):
        mine, _ = _layer(module)
        for line, target in _runtime_imports(module, path):
            while target not in modules and "." in target:  # from pkg import name
                target = target.rpartition(".")[0]
            theirs, _ = _layer(target)
            if theirs > mine and _top(target) != _top(module):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}")
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)


def test_every_module_is_in_a_layer():
    for module in _modules():
        _layer(module)


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_600_lines(path):
    if "_proto" in path.parts:
        pytest.skip("generated code")
    lines = path.read_text().count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT.parent)} has {lines} lines"
