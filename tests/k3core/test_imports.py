"""k3core's import graph: no circles, and no orchestration code.

The walker reads every module under a package with ``ast`` (nothing is imported), collecting every
``import``/``from ... import`` statement wherever it stands: module level, inside a function, under
``if TYPE_CHECKING``. A lazy import is still a dependency, and a circle hidden in a function body is
still a circle; it only fails later, at the first call.

Edges, one per statement target:
- ``import a.b.c`` -> ``a.b.c``;
- ``from a.b import n`` -> ``a.b.n`` when that is a module, else ``a.b`` (the package's
  ``__init__``, where ``n`` is defined);
- relative imports are resolved against the importing module's package first.
The parent packages Python loads on the way are not edges: ``k3core.transfer.disk`` importing
``k3core.transfer.digest`` does not import the names of ``k3core/transfer/__init__.py``. A submodule
that takes a name from its parent's ``__init__`` (``from k3core.transfer import load_payload``)
while that ``__init__`` imports the submodule is a circle.

Three checks: (a) no circle between k3core modules, (b) no circle between k3core's top-level parts
(``k3core.rollout`` <-> ``k3core.transfer``; a module directly under k3core, such as
``k3core.config``, is a part of its own), (c) no import of ``prefect``, ``tasks`` or ``flows``: the
library runs without the orchestration layer above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("prefect", "tasks", "flows")


def module_files(package_dir: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir`` (a package's name maps to
    its ``__init__.py``)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(node: ast.AST, module: str, is_package: bool, modules: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        if node.level - 1 > len(here) - 1:
            raise ValueError(f"{module}: relative import beyond the top-level package (line {node.lineno})")
        base = ".".join(here[: len(here) - (node.level - 1)] + ([node.module] if node.module else []))
    else:
        base = node.module
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        out.append(sub if sub in modules else base)
    return out


def scan(package_dir: Path, package: str) -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """(graph: module -> the modules of ``package`` it imports; every import of a ``FORBIDDEN`` package
    as (module, imported name, line))."""
    files = module_files(package_dir, package)
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in files}
    forbidden = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(node, module, is_package, modules):
                top = target.split(".")[0]
                if top in FORBIDDEN:
                    forbidden.append((module, target, node.lineno))
                elif top == package and target != module:
                    # an unknown name inside the package (a typo, a deleted module) points at the
                    # nearest module that exists, so the edge is never lost
                    while target not in modules and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target != module:
                        graph[module].add(target)
    return graph, forbidden


def part_graph(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The graph between top-level parts of ``package``: ``pkg.a.b.c`` belongs to ``pkg.a``."""
    def part(m: str) -> str:
        return ".".join(m.split(".")[:2])

    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        src = part(m)
        out.setdefault(src, set())
        for t in targets:
            if part(t) != src and part(t) != package:
                out[src].add(part(t))
            out.setdefault(part(t), set())
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one node, as a path that starts and
    ends at the same node (Tarjan's algorithm, iterative; nodes and edges in sorted order, so the
    report is stable)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        components.append(sorted(comp))
    return [_circle_in(graph, comp) for comp in sorted(components)]


def _circle_in(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest circle through the first node of a strongly connected component (breadth-first)."""
    inside = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & inside):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if child not in prev:
                    prev[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{comp} is not strongly connected")


def _report(cycles: list[list[str]]) -> str:
    return "\n".join("  " + " -> ".join(c) for c in cycles)


@pytest.fixture(scope="module")
def k3core_scan():
    return scan(ROOT / "k3core", "k3core")


def test_no_import_circle_between_k3core_modules(k3core_scan):
    graph, _ = k3core_scan
    cycles = find_cycles(graph)
    assert not cycles, f"import circles between k3core modules (lazy imports included):\n{_report(cycles)}"


def test_no_import_circle_between_k3core_parts(k3core_scan):
    graph, _ = k3core_scan
    cycles = find_cycles(part_graph(graph, "k3core"))
    assert not cycles, f"import circles between k3core's top-level parts:\n{_report(cycles)}"


def test_k3core_never_imports_the_orchestration_layer(k3core_scan):
    _, forbidden = k3core_scan
    assert not forbidden, "k3core imports " + ", ".join(f"{t} ({m}, line {n})" for m, t, n in forbidden)


# ------------------------------------------------------------------ the walker itself
def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "pkg"


CLEAN = {
    "pkg/__init__.py": "",
    "pkg/low.py": "import os\n",
    "pkg/a/__init__.py": "from pkg.a.x import f\n",
    "pkg/a/x.py": "from pkg.a import y\nfrom pkg.low import os\n\ndef f():\n    from . import y\n",
    "pkg/a/y.py": "from ..low import os\n",
    "pkg/b/__init__.py": "",
    "pkg/b/z.py": "def g():\n    from pkg.a import f\n    import pkg.a.y\n",
}


def test_walker_resolves_lazy_and_relative_imports(tmp_path):
    graph, forbidden = scan(_write(tmp_path, CLEAN), "pkg")
    assert graph == {"pkg": set(), "pkg.low": set(), "pkg.a": {"pkg.a.x"}, "pkg.a.x": {"pkg.a.y", "pkg.low"},
                     "pkg.a.y": {"pkg.low"}, "pkg.b": set(), "pkg.b.z": {"pkg.a", "pkg.a.y"}}
    assert forbidden == []
    assert find_cycles(graph) == []
    assert part_graph(graph, "pkg") == {"pkg": set(), "pkg.low": set(), "pkg.a": {"pkg.low"}, "pkg.b": {"pkg.a"}}
    assert find_cycles(part_graph(graph, "pkg")) == []


def test_walker_finds_planted_circles(tmp_path):
    planted = dict(CLEAN)
    # a submodule taking a name from its parent's __init__, which imports the submodule
    planted["pkg/a/y.py"] = "def h():\n    from pkg.a import f\n"
    planted["pkg/a/x.py"] = "from . import y\n"
    # two parts that import each other, one of them lazily and relatively
    planted["pkg/low.py"] = "def k():\n    from .b.z import g\n"
    planted["pkg/b/z.py"] = "from pkg import low\n"
    # the orchestration layer, even behind a function
    planted["pkg/d.py"] = "import prefect\n\ndef run():\n    from flows.cli import main\n    import tasks.train\n"
    graph, forbidden = scan(_write(tmp_path, planted), "pkg")
    assert find_cycles(graph) == [["pkg.a", "pkg.a.x", "pkg.a.y", "pkg.a"], ["pkg.b.z", "pkg.low", "pkg.b.z"]]
    assert find_cycles(part_graph(graph, "pkg")) == [["pkg.b", "pkg.low", "pkg.b"]]
    assert forbidden == [("pkg.d", "prefect", 1), ("pkg.d", "flows.cli", 4), ("pkg.d", "tasks.train", 5)]
