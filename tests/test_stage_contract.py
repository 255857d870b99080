"""The stage contract's names and parameter markers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portapipe.scheduling.stage import expert_ids, expert_key, is_expert, mark_expert, owned_rows


def test_expert_key_puts_the_expert_before_the_leaf() -> None:
    assert expert_key("layers.3.moe.experts.gate_up", 5) == "layers.3.moe.experts.5.gate_up"
    assert expert_key("w", 2) == "2.w"


def test_markers_round_trip_and_check_the_row_count() -> None:
    p = torch.nn.Parameter(torch.zeros(3, 2))
    assert not is_expert(p) and owned_rows(p) is None
    with pytest.raises(ValueError, match="no expert_ids"):
        expert_ids(p)
    mark_expert(p, [4, 1, 4])
    assert is_expert(p) and expert_ids(p) == [4, 1, 4]
    with pytest.raises(ValueError, match="3 rows cannot hold 2 experts"):
        mark_expert(p, [0, 1])


def test_the_model_labels_its_experts_by_logical_id() -> None:
    from portapipe.backends.cpu import CPUBackend
    from portapipe.config import load_config
    from portapipe.models.expert_parallel import ExpertParallel
    from portapipe.models.moe import build_blocks

    cfg = load_config({"model": {"n_layers": 2, "n_dense": 1, "n_experts": 4}})
    ep = ExpertParallel(CPUBackend(), size=2, rank=1)
    blocks = build_blocks(cfg.model, [0], 1, ep, seed=0)
    experts = blocks[0].moe_layers()[0].moe.experts
    assert expert_ids(experts.gate_up) == [2, 3] == expert_ids(experts.down)
    experts.logical = [3, 2]
    assert expert_ids(experts.gate_up) == [3, 2]


def _ranks_of(n_experts: int, ep: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Each EP rank's named parameters and persistent buffers of a 2-layer model."""
    from portapipe.backends.cpu import CPUBackend
    from portapipe.config import load_config
    from portapipe.models.expert_parallel import ExpertParallel
    from portapipe.models.moe import build_blocks

    cfg = load_config({"model": {"n_layers": 2, "n_dense": 1, "n_experts": n_experts}, "parallel": {"ep": ep}})
    out = []
    for r in range(ep):
        block = build_blocks(cfg.model, [0], 1, ExpertParallel(CPUBackend(), size=ep, rank=r), seed=seed)[0]
        out.append(dict(block.named_parameters()) | dict(block.named_buffers()))
    return out


def test_logical_state_is_layout_independent_and_loads_into_any_layout() -> None:
    from portapipe.scheduling.stage import load_logical_state, logical_state

    whole = logical_state(_ranks_of(4, 1)[0].items())
    assert "layers.1.moe.experts.3.gate_up" in whole and "layers.1.moe.experts.gate_up" not in whole
    merged: dict[str, torch.Tensor] = {}
    for rank in _ranks_of(4, 2):
        merged |= logical_state(rank.items())
    assert merged.keys() == whole.keys()
    assert all(torch.equal(merged[k], whole[k]) for k in whole)
    # into another seed's model on 2 EP ranks, with rank 1's experts replicated and reordered
    target = _ranks_of(4, 2, seed=7)[1]
    target["layers.1.moe.experts.gate_up"].data = target["layers.1.moe.experts.gate_up"].data[[1, 0, 0]]
    mark_expert(target["layers.1.moe.experts.gate_up"], [3, 2, 2])
    load_logical_state(target.items(), whole)
    gu = target["layers.1.moe.experts.gate_up"]
    assert torch.equal(gu[0], whole["layers.1.moe.experts.3.gate_up"])
    assert torch.equal(gu[1], whole["layers.1.moe.experts.2.gate_up"]) and torch.equal(gu[2], gu[1])
    assert torch.equal(target["head.weight"], whole["head.weight"])


def test_loading_a_state_that_does_not_fit_copies_nothing() -> None:
    from portapipe.scheduling.stage import load_logical_state, logical_state

    rank = _ranks_of(4, 2)[0]
    state = logical_state(_ranks_of(4, 2, seed=5)[0].items())
    del state["head.weight"]
    state["embed.weight"] = state["embed.weight"][:3]
    before = rank["layers.1.attn.wq.weight"].clone()
    with pytest.raises(ValueError, match=r"1 missing \(first: head.weight\).*embed.weight: \(3, 64\) != \(256, 64\)"):
        load_logical_state(rank.items(), state)
    assert torch.equal(rank["layers.1.attn.wq.weight"], before)


def _imports(path: Path, package: str) -> set[str]:
    """portapipe modules a source file imports (module level or inside functions), resolved to names."""
    import ast

    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # `from .. import models` names a module
    return {name for name in out if name == "portapipe" or name.startswith("portapipe.")}


def test_scheduling_imports_neither_models_nor_balancing() -> None:
    """The executor runs any stage that follows the contract: nothing under portapipe/scheduling
    reaches portapipe.models or portapipe.balancing, directly or through another portapipe module."""
    root = Path(__file__).resolve().parents[1]
    files = {}
    for path in (root / "portapipe").rglob("*.py"):
        rel = path.relative_to(root).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        files[name] = path

    def package_of(name: str) -> str:
        return name if files[name].name == "__init__.py" else name.rpartition(".")[0]

    start = sorted(n for n in files if n.startswith("portapipe.scheduling"))
    assert "portapipe.scheduling.executor" in start and "portapipe.scheduling.overlap" in start
    reached, todo, via = set(start), list(start), {n: n for n in start}
    while todo:
        name = todo.pop()
        found = _imports(files[name], package_of(name))
        # importing a.b.c runs a/__init__.py and a/b/__init__.py too
        found |= {".".join(imp.split(".")[:i]) for imp in found for i in range(1, imp.count(".") + 1)}
        for imp in found:
            if imp in files and imp not in reached:
                reached.add(imp)
                via[imp] = f"{via[name]} -> {imp}"
                todo.append(imp)
    bad = sorted(via[n] for n in reached if n.startswith(("portapipe.models", "portapipe.balancing")))
    assert not bad, bad


def test_importing_the_scheduling_core_loads_neither_models_nor_balancing() -> None:
    """The same rule as the process sees it: after importing every module of portapipe.scheduling
    (and the plain-module pipeline), no module of portapipe.models or portapipe.balancing is loaded."""
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, sys, portapipe.scheduling as s\n"
        "for m in pkgutil.iter_modules(s.__path__): importlib.import_module('portapipe.scheduling.' + m.name)\n"
        "import portapipe.plain\n"
        "print(sorted(k for k in sys.modules if k.startswith(('portapipe.models', 'portapipe.balancing'))))\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
