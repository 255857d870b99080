"""The optional Triton counting/mapping kernels give the torch path's results (TRITON_INTERPRET=1, CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from portapipe.balancing import lplb_triton  # noqa: E402  (imports no triton itself)
from portapipe.balancing.lplb import Planner  # noqa: E402
from portapipe.balancing.lplb_map import occurrence_rank  # noqa: E402
from portapipe.balancing.topology import cube  # noqa: E402


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _indices(n_tokens: int, n_experts: int, top_k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pop = torch.arange(1, n_experts + 1, dtype=torch.float32).pow(-0.8)
    idx = torch.multinomial(pop.expand(n_tokens, n_experts), top_k, generator=gen)
    idx[torch.rand(n_tokens, generator=gen) < 0.1, 0] = -1
    return idx


def test_kernels_match_torch(interpret: None) -> None:
    assert lplb_triton.available(torch.device("cpu"))
    flat = _indices(300, 16, 2, 0).flatten()  # 600 entries: several blocks, the last one partial
    binned = torch.bincount(flat + 1, minlength=17)
    assert torch.equal(lplb_triton.count_experts(flat, 16), binned)
    stay = (binned[1:] * torch.linspace(0, 1, 16)).long()
    orig = torch.arange(16) * 2
    copy = torch.arange(16) * 2 + 1
    occ = occurrence_rank(flat, binned)
    e = flat.clamp(min=0)
    want = torch.where(flat < 0, -1, torch.where(occ < stay[e], orig[e], copy[e]))
    assert torch.equal(lplb_triton.map_indices(flat, stay, orig, copy), want)


def test_planner_with_and_without_triton_agree(interpret: None) -> None:
    idx = _indices(200, 32, 4, 1).int()
    plain = Planner(cube(), 48, 32, ep_size=8, use_triton=False)
    fused = Planner(cube(), 48, 32, ep_size=8, use_triton=True)
    workload = torch.bincount(idx[idx >= 0].long(), minlength=32)
    plain.update_placement(workload)
    fused.update_placement(workload)
    out = fused.run(idx)
    assert torch.equal(out, plain.run(idx)) and out.dtype == torch.int32
    assert torch.equal(fused.last_plan.phys_load, plain.last_plan.phys_load)


def test_without_interpreter_cpu_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET=1" in lplb_triton.why_unavailable(torch.device("cpu"))
    idx = _indices(50, 32, 2, 2)
    auto = Planner(cube(), 48, 32, ep_size=8)  # use_triton=None: the torch path here
    assert torch.equal(auto.run(idx), Planner(cube(), 48, 32, ep_size=8, use_triton=False).run(idx))
    forced = Planner(cube(), 48, 32, ep_size=8, use_triton=True)
    with pytest.raises(RuntimeError, match="use_triton=True but Triton cannot run on cpu"):
        forced.run(idx)
