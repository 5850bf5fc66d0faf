"""The layout stays honest: no import circle among the modules of sidecar/ and bench/, no file there
or in tests/ over 400 lines, and the serving package never imports the bench."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "sidecar"
BENCH = ROOT.parent / "bench"
PACKAGES = (ROOT, BENCH)
TESTS = ROOT.parent / "tests"
MAX_LINES = 400

# Exceptions, each one to remove: the lists may only shrink (a stale entry fails).
KNOWN_CIRCLES: set[tuple[str, ...]] = set()
KNOWN_LONG: set[str] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> list[str]:
    """Every absolute import in a file (top-level and inside functions); `from pkg import sub` names pkg.sub."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def import_graph(roots: tuple[Path, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of `roots` it imports."""
    modules = {module_name(p): p for root in roots for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for name in imported_names(path):
            # The longest known module the name denotes (`from mod import name` names mod).
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != mod:
                graph[mod].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted tuple."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def long_files(roots: tuple[Path, ...] = (*PACKAGES, TESTS)) -> set[str]:
    return {str(p.relative_to(root.parent)) for root in roots for p in root.rglob("*.py")
            if len(p.read_text(encoding="utf-8").splitlines()) > MAX_LINES}


def test_detector_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == {("a", "b", "c")}
    assert cycles({"a": {"b"}, "b": set()}) == set()


def test_no_import_circles() -> None:
    found = cycles(import_graph())
    assert found - KNOWN_CIRCLES == set(), f"import circle(s): {sorted(found - KNOWN_CIRCLES)}"
    assert KNOWN_CIRCLES - found == set(), f"gone, remove from KNOWN_CIRCLES: {sorted(KNOWN_CIRCLES - found)}"


def test_no_file_over_400_lines() -> None:
    found = long_files()
    assert found - KNOWN_LONG == set(), f"over {MAX_LINES} lines: {sorted(found - KNOWN_LONG)}"
    assert KNOWN_LONG - found == set(), f"no longer over, remove from KNOWN_LONG: {sorted(KNOWN_LONG - found)}"


def test_the_serving_package_never_imports_the_bench() -> None:
    """bench/ is a development tool next to the package, not installed with it."""
    found = {f"{p.relative_to(ROOT.parent)}: {name}" for p in ROOT.rglob("*.py") for name in imported_names(p)
             if name == BENCH.name or name.startswith(BENCH.name + ".")}
    assert not found, f"sidecar/ imports the bench: {sorted(found)}"
