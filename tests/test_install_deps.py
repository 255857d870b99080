"""Every third-party import of the package is declared in pyproject.toml.

Imports made when a module is imported need a `dependencies` entry; imports inside functions
may instead come from a user-facing extra, and then the module names that extra in its error
(``pip install 'portapipe[EXTRA]'``). ci/installed_package.py proves the same on a real install
of the wheel with its declared dependencies only.
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "portapipe"
#: Import names whose distribution is not installed here to be looked up (the npu and mpi extras).
NOT_INSTALLED = {"torch_npu": "torch-npu", "mpi4py": "mpi4py"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.match(r"[A-Za-z0-9_.-]+", req).group(0))


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """(distributions in `dependencies`, user-facing extra -> its distributions); the test extra is not one."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {name: {_requirement_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items() if name != "test"}
    return {_requirement_name(r) for r in project["dependencies"]}, extras


def third_party_imports(source: str) -> list[tuple[str, int, bool]]:
    """(top-level module, line, imported inside a function) for each import of a module outside
    the standard library and the package."""
    tree = ast.parse(source)
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "portapipe" and top != "__future__":
                    out.append((top, child.lineno, in_function))
            visit(child, inside)

    visit(tree, False)
    return out


@cache
def _installed() -> dict[str, list[str]]:
    return packages_distributions()  # a scan of every installed distribution: once


def distribution_of(module: str) -> str:
    found = _installed().get(module)
    return _norm(found[0]) if found else NOT_INSTALLED.get(module, _norm(module))


def test_the_ast_scan_sees_lazy_and_eager_imports() -> None:
    src = "import os\nimport yaml\nfrom torch.nn import Linear\ndef f():\n    import matplotlib.pyplot\nfrom . import x\n"
    assert third_party_imports(src) == [("yaml", 2, False), ("torch", 3, False), ("matplotlib", 5, True)]
    assert distribution_of("yaml") == "pyyaml"


def test_every_run_time_import_is_declared() -> None:
    deps, extras = declared()
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "benchmarks":  # scripts shipped for `portapipe bench`, not imported by the package
            continue
        source = path.read_text()
        where = path.relative_to(ROOT)
        for module, line, lazy in third_party_imports(source):
            dist = distribution_of(module)
            if dist in deps:
                continue
            owners = sorted(e for e, names in extras.items() if dist in names)
            if not owners:
                problems.append(f"{where}:{line}: {module} ({dist}) is in no dependency or extra")
            elif not lazy and path.name.startswith("test_") and owners == ["testing"]:
                continue  # a test module of the kit: only pytest imports it, from the testing extra
            elif not lazy:
                problems.append(f"{where}:{line}: {module} is imported with the module, but only extra {owners} declares it")
            elif not any(f"portapipe[{e}]" in source for e in owners):
                problems.append(f"{where}:{line}: {module} comes from extra {owners}; no error here names it (pip install 'portapipe[...]')")
    assert not problems, "\n".join(problems)


def test_the_extras_the_readme_offers_exist() -> None:
    _, extras = declared()
    assert {"mpi", "npu", "hf", "data", "tensorboard", "triton", "viz"} <= set(extras)
