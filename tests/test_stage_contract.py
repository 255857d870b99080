"""The stage contract: names and parameter markers, the import rule, and a stage written outside portapipe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


# ------------------------------------------- an overlap-capable stage written by a user
class ToyExpertStage:
    """docs/models.md's case 2 in miniature: a replicated linear, then every row goes to one of
    two experts (first half of the rows to expert 0, second half to expert 1) over the EP group
    and comes back; the first stage embeds tokens, the last ends in a head and the loss."""

    def __init__(self, index: int, group: Any, first: bool, last: bool) -> None:
        import torch.nn as nn

        from portapipe.scheduling.stage import mark_expert

        g = torch.Generator().manual_seed(100 + index)
        d = 8
        self.index, self.group, self.has_loss = index, group, last
        self.embed = nn.Parameter(torch.randn(16, d, generator=g, dtype=torch.float64)) if first else None
        self.lin = nn.Parameter(torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5)
        experts = torch.randn(2, d, d, generator=g, dtype=torch.float64) / d**0.5
        self.expert = nn.Parameter(experts[[group.rank]].clone())  # this EP rank's slot: expert `rank`
        mark_expert(self.expert, [group.rank])
        self.head = nn.Parameter(torch.randn(d, 16, generator=g, dtype=torch.float64)) if last else None

    def named_parameters(self) -> Any:
        for name in ("embed", "lin", "head"):
            if getattr(self, name) is not None:
                yield f"{self.index}.{name}", getattr(self, name)
        yield f"{self.index}.experts.w", self.expert

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(x @ self.lin)
        return h, h.flatten(0, 1)

    def program(self, tape: Any, x: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        x = tape.watch(x)
        if self.embed is not None:
            x = tape.part(lambda t: self.embed[t], x, plain=True)
        h, rows = tape.part(self.route, x, plain=True)  # the rows to send come out of a part too
        half = [rows.shape[0] // 2] * 2
        dispatch = tape.all_to_all(self.group, rows, half, half)
        yield dispatch  # the other micro-batch's program runs while the rows travel
        y = tape.part(lambda rows: torch.tanh(rows @ self.expert[0]), dispatch.wait(), plain=True)
        combine = tape.all_to_all(self.group, y, half, half)
        yield combine
        out = tape.part(lambda a, b: a + b.view_as(a), h, combine.wait(), plain=True)
        if self.head is None:
            return out
        return tape.part(lambda o, t: torch.nn.functional.cross_entropy((o @ self.head).flatten(0, 1), t.flatten()), out, targets, plain=True)


def _toy_batch(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + replica)
    return torch.randint(0, 16, (8, 4), generator=g), torch.randint(0, 16, (8, 4), generator=g)


def _toy_rank(backend: Any) -> tuple[float, dict[str, torch.Tensor], float, bool]:
    from portapipe.optim.buckets import GradBuckets
    from portapipe.scheduling.exchange import ExchangeGroup
    from portapipe.scheduling.executor import PipelineExecutor, make_schedule

    groups = backend.parallel_groups(2, 1, 2)
    schedule = make_schedule("dualpipev", 2, 4)
    group = ExchangeGroup(backend, groups.ep, groups.ep_rank, groups.ep_group)
    blocks = [schedule.stage_block[v] for v in range(schedule.n_stages) if schedule.stage_rank[v] == groups.pp_rank]
    stages = {b: ToyExpertStage(b, group, b == 0, b == 3) for b in blocks}
    executor = PipelineExecutor(
        schedule, stages, backend, groups, boundary=lambda v, shape: ((*shape, 8), torch.float64), exchange_stats=group.stats
    )
    # shared gradients summed over the EP replicas, the experts' over DP (one replica here)
    executor.grad_sync = GradBuckets(stages, groups, backend, master_dtype=torch.float64, reduce_dtype=torch.float64, zero_stage=0,
                                     bucket_mb=1.0, overlap=True, copy_sum=executor.sum_copies, holders=executor.copy_holders)
    x, y = _toy_batch(groups.ep_rank)
    mbs = list(zip(x.chunk(4), y.chunk(4)))
    # the same step with the exchanges' completion not taken: same values, only the waits timed
    executor.time_exchanges = False
    untimed = executor.step(mbs)
    untimed_grads = [p.grad.clone() for _, p in executor.named_parameters()]
    executor.time_exchanges = True
    result = executor.step(mbs)
    grads = {}
    for name, p in executor.named_parameters():
        grads[expert_key(name, groups.ep_rank) if is_expert(p) else name] = p.grad[0] if is_expert(p) else p.grad
    same = untimed.loss == result.loss and all(torch.equal(g, p.grad) for g, (_, p) in zip(untimed_grads, executor.named_parameters()))
    t = untimed.timings
    untimed_ok = t["a2a_total_s"] is None and t["fb_a2a_hidden_frac"] is None and t["a2a_wait_s"] >= t["fb_a2a_wait_s"] >= 0.0
    return result.loss, grads, result.timings["fb_a2a_total_s"], same and untimed_ok


def _toy_reference() -> tuple[float, dict[str, torch.Tensor]]:
    """One process: both EP replicas' micro-batches side by side, the exchange done by indexing."""

    class One:
        rank = 0

    stages = []
    for b in range(4):
        one = One()
        s0, s1 = ToyExpertStage(b, one, b == 0, b == 3), None
        one.rank = 1
        s1 = ToyExpertStage(b, one, b == 0, b == 3)
        s0.expert = torch.nn.Parameter(torch.cat([s0.expert.detach(), s1.expert.detach()]))  # both experts
        stages.append(s0)
    batches = [_toy_batch(r) for r in range(2)]
    rows = []
    for m in range(4):
        hs = [batches[r][0].chunk(4)[m] for r in range(2)]
        hs = [stages[0].embed[t] for t in hs]
        for s in stages:
            hs = [torch.tanh(h @ s.lin) for h in hs]
            n = hs[0].shape[0] * hs[0].shape[1] // 2
            flat = [h.flatten(0, 1) for h in hs]
            ys = [torch.tanh(torch.cat([f[e * n : (e + 1) * n] for f in flat]) @ s.expert[e]) for e in range(2)]
            hs = [h + torch.cat([ys[0][r * n : (r + 1) * n], ys[1][r * n : (r + 1) * n]]).view_as(h) for r, h in enumerate(hs)]
        losses = [torch.nn.functional.cross_entropy((h @ stages[3].head).flatten(0, 1), batches[r][1].chunk(4)[m].flatten()) for r, h in enumerate(hs)]
        (sum(losses) / 8).backward()
        rows.append([float(v.detach()) for v in losses])
    grads = {}
    for s in stages:
        for name, p in s.named_parameters():
            if name.endswith("experts.w"):
                grads |= {expert_key(name, e): p.grad[e] for e in range(2)}
            else:
                grads[name] = p.grad
    return sum(v for r in range(2) for v in (row[r] for row in rows)) / 8, grads


def test_a_user_written_overlap_capable_stage_runs_with_expert_parallelism_and_equals_one_process() -> None:
    """DualPipeV on pp 2 x ep 2 over stages that are not portapipe's model: the F&B pairs overlap
    their all-to-alls, and loss and gradients equal one process (also on a step whose exchanges
    are not timed, which reports their waits and no totals)."""
    from portapipe.ranks.launch import run_ranks

    results = run_ranks(_toy_rank, 4)
    ref_loss, ref = _toy_reference()
    got: dict[str, torch.Tensor] = {}
    for loss, grads, fb_a2a, untimed_same in results:
        assert abs(loss - ref_loss) <= 1e-12 * ref_loss and fb_a2a > 0 and untimed_same
        for k, g in grads.items():  # replicated parameters: the same on both EP ranks
            assert k not in got or torch.equal(got[k], g), k
            got[k] = g
    assert got.keys() == ref.keys()
    worst = max(float((got[k] - ref[k]).norm() / ref[k].norm()) for k in ref)
    assert worst <= 1e-12, worst
