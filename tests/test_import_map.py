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
    assert "portapipe.config.rules" in arrows["portapipe.config.load"] and "portapipe.config.setup" in arrows["portapipe.config.load"]
    assert {"portapipe.config.load", "portapipe.config.schema"} <= arrows["portapipe.config"]  # the package's own names
    assert "portapipe.backends.registry" in arrows["portapipe.config.rules"]  # a function-level import counts
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back() -> None:
    assert circles(import_map()) == []


def _above(arrows: dict[str, set[str]], module: str, floor: str) -> list[str]:
    """What ``module`` imports from outside ``floor`` (a package and its modules)."""
    return sorted(t for t in arrows[module] if t != floor and not t.startswith(floor + "."))


def test_validation_imports_nothing_from_plan() -> None:
    """The configuration package (the sections, their loading, the rules and the Setup they read)
    sits below the planner, which reads it."""
    arrows = import_map()
    family = sorted(m for m in arrows if m == "portapipe.config" or m.startswith("portapipe.config."))
    assert len(family) == 11  # the package and its ten modules: none left out of the check
    for base in family:
        assert sorted(t for t in arrows[base] if t == "portapipe.plan" or t.startswith("portapipe.plan.")) == [], base


def _reach(arrows: dict[str, set[str]], module: str) -> set[str]:
    """Every module ``module`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for t in arrows[todo.pop()] - seen:
            seen.add(t)
            todo.append(t)
    return seen


def test_the_fp8_recipe_imports_nothing_of_the_scheduling_core() -> None:
    """The FP8 recipe sits below the executor: it reaches the backends and the tensor helpers, never
    the scheduling core, directly or through another module."""
    arrows = import_map()
    recipe = sorted(m for m in arrows if m == "portapipe.fp8" or m.startswith("portapipe.fp8."))
    assert len(recipe) == 5  # the package and its four modules: none left out of the check
    for m in recipe:
        assert sorted(t for t in _reach(arrows, m) if t.startswith("portapipe.scheduling")) == [], m
    assert "portapipe.tensors.storage" in arrows["portapipe.fp8.dispatch"]  # the rule looks where the helper is


def test_the_reach_follows_chains() -> None:
    assert _reach({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}, "a") == {"b", "c"}


def test_the_package_root_holds_the_entry_points_and_the_composition_only() -> None:
    """The root keeps the entry points (cli, train, plain) and the composition (compose); families of
    modules (the training loop's parts, the metrics and their sinks) live in packages, each with a
    docstring saying what it holds."""
    root = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert root == ["cli", "compose", "plain", "train"]
    for package in sorted(p.parent for p in PACKAGE.glob("*/__init__.py")):
        assert ast.get_docstring(ast.parse((package / "__init__.py").read_text())), package.name


def test_the_backends_import_nothing_above_them() -> None:
    """Every module under portapipe/backends/ imports only backends modules (the conformance kit,
    which starts ranks through the launcher, sits beside the launcher in portapipe/testing/)."""
    arrows = import_map()
    floor = sorted(m for m in arrows if m.startswith("portapipe.backends"))
    assert {m: _above(arrows, m, "portapipe.backends") for m in floor if _above(arrows, m, "portapipe.backends")} == {}
    assert "portapipe.backends.testing" in floor  # the old name, which only says where the kit went
    assert "portapipe.ranks.launch" in arrows["portapipe.testing"]  # the kit, beside the launcher


def test_the_rule_sees_an_arrow_up() -> None:
    assert _above({"portapipe.backends.x": {"portapipe.ranks.launch", "portapipe.backends.base"}}, "portapipe.backends.x", "portapipe.backends") == ["portapipe.ranks.launch"]


def test_fp8_matmuls_are_called_in_the_backends_only() -> None:
    """torch's FP8 matmuls (``_scaled_mm``, ``scaled_mm`` and their grouped forms) are a backend's
    business: the recipe and the models reach them through ``Backend.fp8_mm`` / ``fp8_grouped_mm``."""
    names = {"_scaled_mm", "scaled_mm", "_scaled_mm_v2", "_scaled_grouped_mm", "scaled_grouped_mm", "_scaled_grouped_mm_v2"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(PACKAGE / "backends"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in names or isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []
    assert any("_scaled_mm" in p.read_text() for p in (PACKAGE / "backends").glob("*.py"))  # the rule looks where they are
