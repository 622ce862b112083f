"""The package's layers: imports flow one way, packages import each other in no circle.

Run by ``make lint`` too. Each module belongs to the layer of the longest
prefix below that names it; it may import modules of its own top-level
package and of lower layers, never of higher ones. Imports under
``if TYPE_CHECKING:`` are for the type checker only and do not count.

The line backstop is generous on purpose: a module past ~500 lines is a
prompt to look for a second responsibility in it, not to cut it at a count.
The formatter is in charge of layout: ``# fmt: skip`` is for the few places
where a hand layout carries meaning, each with its reason on the line.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "rpcdist"

#: Lowest first. A name is a module or package prefix under ``rpcdist``.
LAYERS: list[list[str]] = [
    [
        "rpcdist._errors",
        "rpcdist._deadline",
        "rpcdist._options",
        "rpcdist._faults",
        "rpcdist._worker",
        "rpcdist._futures",
        "rpcdist._loop",
        "rpcdist._pool",
        "rpcdist._cores",
        "rpcdist._publish",
        "rpcdist._proto",
        "rpcdist.functions",
        "rpcdist.futures",
    ],
    ["rpcdist._serialization"],
    ["rpcdist.tensor", "rpcdist.nn", "rpcdist.optim", "rpcdist._save", "rpcdist.data"],
    ["rpcdist._transport"],
    ["rpcdist._store"],
    ["rpcdist._device"],
    ["rpcdist._rpc"],
    ["rpcdist._rref"],
    ["rpcdist.collectives"],
    ["rpcdist.autograd", "rpcdist.optim._distributed", "rpcdist.nn._remote"],
    ["rpcdist.parallel"],
    ["rpcdist.torch"],
    ["rpcdist.launch", "rpcdist.testing"],
    ["rpcdist"],  # the face: composes everything
]
#: Packages whose modules still import each other in a circle (an entry
#: whose package has none fails the test, so the list cannot go stale).
#: ``rpcdist.tensor``: a Tensor's methods are its operators, and the
#: operators, the engine and its nodes build Tensors even with no tensor at
#: hand (``Function.call`` on plain arrays, ``RecvFunction.make_outputs``,
#: node pre-hooks, all public): breaking it needs either a registration of
#: the class into lower modules or a behaviour change, both worse.
CIRCLES_BEING_FIXED = {
    "rpcdist.tensor",
}
#: A backstop, not a target (see the module's docstring).
MAX_LINES = 900
#: How many ``# fmt: skip`` markers the package, tests, examples and
#: benchmarks may hold in all.
MAX_FMT_SKIPS = 9


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


def _runtime_imports(
    module: str, path: Path, *, type_checking: bool = False
) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import not under ``TYPE_CHECKING``
    (with ``type_checking``: for every import)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        test = isinstance(node, ast.If) and ast.unparse(node.test)
        if test and "TYPE_CHECKING" in test and not type_checking:
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
def test_no_module_past_the_line_backstop(path):
    if "_proto" in path.parts:
        pytest.skip("generated code")
    lines = path.read_text().count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT.parent)} has {lines} lines"


def test_no_import_circle_between_packages():
    """The packages' import graph (runtime imports) has no cycle."""
    graph: dict[str, set[str]] = {}
    modules = _modules()
    for module, path in modules.items():
        mine = _top(module)
        for _, target in _runtime_imports(module, path):
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if _top(target) != mine and target != "rpcdist":
                graph.setdefault(mine, set()).add(_top(target))
    seen: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == 1:
                return [*path, node, nxt]
            if nxt not in seen and (cycle := visit(nxt, [*path, node])):
                return cycle
        seen[node] = 2
        return None

    for start in sorted(graph):
        if start not in seen and (cycle := visit(start, [])):
            raise AssertionError("packages import each other in a circle: " + " -> ".join(cycle))


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _circles_within_packages() -> dict[str, list[list[str]]]:
    """Each package's import circles among its own modules (strongly
    connected components of more than one module), imports under
    ``TYPE_CHECKING`` and inside functions included."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        mine = _package_of(module, path)
        for _, target in _runtime_imports(module, path, type_checking=True):
            while target not in modules and "." in target:  # from pkg import name
                target = target.rpartition(".")[0]
            if target != module and _package_of(target, modules[target]) == mine:
                graph[module].add(target)
    # Tarjan's algorithm, iterative: a component is found when the search
    # returns to the first of its modules it entered.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: dict[str, list[list[str]]] = {}
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    package = _package_of(node, modules[node])
                    found.setdefault(package, []).append(sorted(component))
    return found


def _being_fixed(package: str) -> bool:
    return any(package == p or package.startswith(p + ".") for p in CIRCLES_BEING_FIXED)


def test_no_import_circle_within_a_package():
    """A package's modules import each other in no circle, counting imports
    under ``TYPE_CHECKING``: shared types sit in a module at the bottom of
    the package, which the parts import, and a package's facade (its agent,
    its public class) imports its parts, never the reverse."""
    circles = _circles_within_packages()
    bad = [
        f"{package}: " + " <-> ".join(c)
        for package, found in sorted(circles.items())
        if not _being_fixed(package)
        for c in found
    ]
    assert not bad, "modules of one package import each other in a circle:\n" + "\n".join(bad)


def test_no_stale_entry_among_the_circles_being_fixed():
    circles = _circles_within_packages()
    stale = sorted(
        p for p in CIRCLES_BEING_FIXED if not any(q == p or q.startswith(p + ".") for q in circles)
    )
    assert not stale, f"no circle left in {stale}: remove them from CIRCLES_BEING_FIXED"


def test_a_circle_within_a_package_is_found(tmp_path, monkeypatch):
    """The search above finds a circle that runs only through ``TYPE_CHECKING``."""
    pkg = tmp_path / "rpcdist" / "_demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_a.py").write_text("from ._b import B\n")
    (pkg / "_b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._c import C\nB = 1\n"
    )
    (pkg / "_c.py").write_text("def f():\n    from . import _a\n")
    (pkg / "_d.py").write_text("from ._a import A\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "rpcdist")
    assert _circles_within_packages() == {
        "rpcdist._demo": [["rpcdist._demo._a", "rpcdist._demo._b", "rpcdist._demo._c"]]
    }


def test_formatter_skips_are_few_and_explained():
    """At most a few ``# fmt: skip``/``off`` markers, each under a comment saying why."""
    top = ROOT.parent
    marker = "# fmt: skip", "# fmt: off"
    found, unexplained = [], []
    for folder in ("rpcdist", "tests", "examples", "benchmarks"):
        for path in (top / folder).rglob("*.py"):
            if "_proto" in path.parts or path == Path(__file__).resolve():
                continue
            lines = path.read_text().splitlines()
            for i, line in enumerate(lines):
                if any(m in line for m in marker):
                    found.append(f"{path.relative_to(top)}:{i + 1}")
                    if i == 0 or not lines[i - 1].lstrip().startswith("#"):
                        unexplained.append(found[-1])
    assert len(found) <= MAX_FMT_SKIPS, f"{len(found)} formatter skips: {found}"
    assert not unexplained, f"formatter skips without a comment above saying why: {unexplained}"
