"""The house's import map, read from the source (ast): every import, at module level or inside a
function, is an arrow from one file to another. No two files (or longer chains) import each
other, and config.py, which validation runs through, imports nothing from plan/."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "portapipe"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_map() -> dict[str, set[str]]:
    """portapipe module -> the portapipe modules it imports (``from pkg.mod import x`` is an
    arrow to ``pkg.mod``; ``from pkg import x`` to ``pkg.x`` where that is a module, else ``pkg``)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    arrows: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:  # the longest portapipe module the name starts with
                    t = t.rpartition(".")[0]
                if t and t != name:
                    arrows[name].add(t)
    return arrows


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(arrows[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(arrows):
        if v not in index:
            visit(v)
    return out


def test_the_map_sees_the_imports_it_should() -> None:
    arrows = import_map()
    assert "portapipe.rules" in arrows["portapipe.config"] and "portapipe.setup" in arrows["portapipe.config"]
    assert "portapipe.backends.registry" in arrows["portapipe.rules"]  # a function-level import counts
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back() -> None:
    assert circles(import_map()) == []


def test_config_imports_nothing_from_plan() -> None:
    arrows = import_map()
    assert sorted(t for t in arrows["portapipe.config"] if t == "portapipe.plan" or t.startswith("portapipe.plan.")) == []
    for base in ("portapipe.rules", "portapipe.setup"):  # what validation runs through, beside config
        assert not any(t.startswith("portapipe.plan.") and t != "portapipe.plan.shape" for t in arrows[base]), arrows[base]
