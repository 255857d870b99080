"""The compiled CPU path of LPLB gives the torch path's results, and falls back to it loudly."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import tests.test_lp_solver as lp_tests  # the HiGHS reference and the random instances (module import: no re-collection)
from portapipe.balancing import lplb_native
from portapipe.balancing.lp_balance import BalanceLP, rank_loads, solve_balance
from portapipe.balancing.lplb import Planner
from portapipe.balancing.lplb_map import map_sorted, occurrence_rank
from portapipe.balancing.topology import cube, torus
from tests.test_lplb import require_native, zipf_indices

E, EP = 64, 16


@pytest.fixture(scope="module")
def native() -> None:
    require_native()


def _indices(n: int, n_experts: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pop = torch.arange(1, n_experts + 1, dtype=torch.float32).pow(-0.8)
    idx = torch.multinomial(pop.expand(n, n_experts), 4, generator=gen)
    idx[torch.rand(n, generator=gen) < 0.1, 0] = -1
    return idx.to(dtype)


@pytest.mark.parametrize("name", list(lp_tests.TOPOLOGIES))
def test_native_solver_matches_highs_and_the_torch_solver(native: None, name: str) -> None:
    r2o = lp_tests.TOPOLOGIES[name]
    g, d = r2o.shape
    gen = torch.Generator().manual_seed(4321 + g * 10 + d)
    count = 60
    fixed, rep = lp_tests.random_loads(gen, count, g, d)
    res = solve_balance(fixed, rep, r2o, use_native=True)
    assert bool(res.accepted.all()), f"{int((~res.accepted).sum())} instances fell back"
    ref = np.array([lp_tests.highs_balance(fixed[i].numpy(), rep[i].numpy(), r2o.numpy()) for i in range(count)])
    rel = np.abs(res.objective.numpy() - ref) / np.maximum(ref, 1e-12)
    assert rel.max() <= 1e-4, f"worst relative gap to HiGHS {rel.max():.2e} at instance {rel.argmax()}"
    assert torch.allclose(rank_loads(fixed, rep, res.keep, r2o).amax(1), res.objective, rtol=1e-9)
    assert bool((res.lower_bound <= res.objective * (1 + 1e-6)).all())
    assert bool(((res.keep >= 0) & (res.keep <= 1)).all())
    # Same method as the torch solver, so the same optimum and bound to round-off.
    ours = solve_balance(fixed, rep, r2o, use_native=False)
    assert torch.equal(ours.accepted, res.accepted)
    assert torch.allclose(res.objective, ours.objective, rtol=1e-8)
    assert torch.allclose(res.lower_bound, ours.lower_bound, rtol=1e-8)
    assert abs(res.iterations - ours.iterations) <= 1


def test_torch_solver_keeps_its_checks_when_native_is_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    # The solver tests pick the native path where it builds; run the torch path through them too.
    monkeypatch.setenv("PORTAPIPE_NATIVE", "0")
    assert lplb_native.why_unavailable() == "disabled by PORTAPIPE_NATIVE=0"
    for name in lp_tests.TOPOLOGIES:
        lp_tests.test_optimum_matches_highs(name)
    lp_tests.test_known_answer_two_ranks()
    lp_tests.test_failed_solves_fall_back_to_even_split()
    lp_tests.test_all_zero_and_single_loaded_groups()


def test_native_solver_edge_cases(native: None) -> None:
    # The checks of the torch solver, forced onto the native one.
    r2o = torch.tensor([[1], [0]])
    res = solve_balance(torch.tensor([[2.0, 4.0]]), torch.tensor([[[6.0], [0.0]]]), r2o, use_native=True)
    assert res.accepted.item() and res.objective.item() == pytest.approx(6.0, rel=1e-8)
    assert res.keep[0, 0, 0].item() == pytest.approx(2 / 3, rel=1e-7)
    fixed = torch.tensor([[10.0, 0, 0, 0, 0, 0, 0, 0]])
    rep = torch.zeros(1, 8, 2, dtype=torch.float64)
    rep[0, 0] = torch.tensor([40.0, 40.0])
    capped = solve_balance(fixed, rep, cube(), max_iter=1, use_native=True)
    assert not capped.accepted.item() and capped.iterations == 1 and bool((capped.keep == 0.5).all())
    even = rank_loads(fixed, rep, torch.full_like(rep, 0.5), cube()).amax(1)
    assert capped.objective.item() == pytest.approx(even.item())
    zero = solve_balance(torch.zeros(2, 8), torch.zeros(2, 8, 2), cube(), use_native=True)
    assert bool(zero.accepted.all()) and zero.objective.tolist() == [0.0, 0.0]
    gen = torch.Generator().manual_seed(5)
    fixed, rep = lp_tests.random_loads(gen, 6, 8, 2)
    base = BalanceLP(cube(), 6).solve(fixed.float(), rep.float(), use_native=True)
    assert base.keep.dtype == torch.float32 and bool(base.accepted.all())
    cheap = BalanceLP(cube(), 6, move_cost=1e-6)
    native_cost, torch_cost = cheap.solve(fixed, rep, use_native=True), cheap.solve(fixed, rep, use_native=False)
    assert bool(native_cost.accepted.all())
    assert torch.allclose(native_cost.objective, base.objective.double(), rtol=1e-4)
    assert torch.allclose(native_cost.lower_bound, torch_cost.lower_bound, rtol=1e-7)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_count_and_map_match_torch(native: None, dtype: torch.dtype) -> None:
    flat = _indices(700, 24, 0, dtype).flatten()
    binned, bad = lplb_native.count_experts(flat, 24)
    want = torch.bincount(flat.long() + 1, minlength=25)
    assert bad == -1 and torch.equal(binned, want)
    stay = (want[1:] * torch.linspace(0, 1, 24)).long()
    orig, copy = torch.arange(24) * 2, torch.arange(24) * 2 + 1
    occ = occurrence_rank(flat.long(), want)
    e = flat.long().clamp(min=0)
    expect = torch.where(flat < 0, -1, torch.where(occ < stay[e], orig[e], copy[e]))
    out = lplb_native.map_indices(flat, stay, orig, copy)
    assert out.dtype == dtype and torch.equal(out.long(), expect)
    flat[123] = 24
    assert lplb_native.count_experts(flat, 24)[1] == 123
    # the blocked count: a bad entry late in a block of four, and one in the tail past the blocks
    flat[123], flat[126] = 0, -2
    assert lplb_native.count_experts(flat, 24)[1] == 126
    tail = flat[:127 + 2]  # 129 entries: one past the last block of four
    tail[126], tail[128] = 3, 30
    assert lplb_native.count_experts(tail, 24)[1] == 128
    assert torch.equal(lplb_native.count_experts(tail[:128], 24)[0], torch.bincount(tail[:128].long() + 1, minlength=25))
    empty = torch.empty(0, dtype=dtype)
    assert lplb_native.count_experts(empty, 24)[0].tolist() == [0] * 25
    # count_row: one row of a counts matrix, in place, the other rows untouched
    counts = torch.full((3, 24), 7, dtype=torch.int64)
    rows = flat[:120].view(12, 10)
    assert lplb_native.count_row(rows, counts, 1) == -1
    assert torch.equal(counts[1], torch.bincount(rows.reshape(-1).long() + 1, minlength=25)[1:])
    assert bool((counts[[0, 2]] == 7).all())
    assert lplb_native.count_row(flat, counts, 2) == 128  # flat[128] = 30 from above
    for bad_counts, row in ((counts, 3), (counts.t().contiguous().t(), 0), (counts.int(), 0)):
        with pytest.raises(ValueError, match="count_row"):
            lplb_native.count_row(rows, bad_counts, row)
    assert lplb_native.map_indices(empty, stay, orig, copy).numel() == 0


def _planners(r2o: torch.Tensor, n_logical: int, ep: int, n_physical: int, workload: torch.Tensor) -> tuple[Planner, Planner]:
    pair = (
        Planner(r2o, n_physical, n_logical, ep_size=ep, use_native=True, use_triton=False),
        Planner(r2o, n_physical, n_logical, ep_size=ep, use_native=False, use_triton=False),
    )
    for p in pair:
        p.update_placement(workload)
    return pair


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_planner_native_matches_torch(native: None, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(E, generator=gen)
    fused, plain = _planners(cube(), E, EP, E + 2 * EP, torch.bincount(zipf_indices(gen, 4096, E, 4, 0.6, perm).flatten(), minlength=E))
    idx = zipf_indices(gen, 2048, E, 4, 0.6, perm).to(dtype)
    idx[5, 2] = -1
    idx[77] = -1
    idx = idx.t()  # not contiguous: the native path takes a contiguous copy
    out = fused.run(idx)
    assert out.shape == idx.shape and out.dtype == dtype
    plan, ref = fused.last_plan, plain.last_plan
    valid = idx >= 0
    assert bool((out[~valid] == -1).all())
    assert torch.equal(fused.phy2log[out[valid].long()], idx[valid].long())
    assert torch.equal(torch.bincount(out[valid].long(), minlength=fused.n_physical), plan.phys_load)
    assert torch.equal(plan.rank_load, plan.phys_load.view(EP, -1).sum(1))
    plain_out = plain.run(idx)
    ref = plain.last_plan
    assert torch.allclose(plan.lp_objective, ref.lp_objective, rtol=1e-8)
    assert torch.equal(plan.accepted, ref.accepted) and fused.accepted_solves == 2 and fused.fallback_solves == 0
    # Shares equal in fixed point give the same integers, slots and mapping as the torch path.
    fixed_point = [torch.round((1 - p.keep) * 2**20) for p in (plan, ref)]
    assert float((fixed_point[0] - fixed_point[1]).abs().max()) <= 1
    if torch.equal(*fixed_point):
        assert torch.equal(plan.moved, ref.moved) and torch.equal(plan.phys_load, ref.phys_load)
        assert torch.equal(out, plain_out)
    # Given the same moved counts, the native mapping is the torch mapping entry by entry.
    flat = idx.reshape(-1)
    binned = torch.bincount(flat.long() + 1, minlength=E + 1)
    _, _, _, orig_phys, copy_phys, _ = fused._maps(flat.device)
    native_map = lplb_native.map_indices(flat, binned[1:] - plan.moved[0], orig_phys, copy_phys)
    assert torch.equal(native_map.long(), map_sorted(flat, binned, plan.moved[0], plain._maps(flat.device)[5], plain.n_logical))


def test_multi_source_plan_matches_torch(native: None) -> None:
    gen = torch.Generator().manual_seed(2)
    fused, plain = _planners(torus(2, 4), 32, 8, 48, torch.randint(1, 100, (32,), generator=gen))
    counts = torch.randint(0, 50, (8, 32), generator=gen).int()  # any integer dtype
    plan, ref = fused.plan(counts), plain.plan(counts)
    assert plan.moved.dtype == torch.int64 and bool((plan.moved >= 0).all()) and bool((plan.moved <= counts).all())
    total = counts.sum(0)
    moved = plan.moved.sum(0)
    log2phy = fused.log2phy
    assert torch.equal(plan.phys_load[log2phy[:, 0]] + torch.where(log2phy[:, 1] >= 0, moved, 0), total)
    assert torch.allclose(plan.lp_objective, ref.lp_objective, rtol=1e-8)
    assert torch.equal(plan.moved, ref.moved) and torch.equal(plan.phys_load, ref.phys_load)
    assert torch.equal(plan.rank_load, ref.rank_load)


def _fallback_case(reason: str) -> None:
    """With the native path unavailable for ``reason`` (a pattern): auto falls back to torch, True raises naming it."""
    why = lplb_native.why_unavailable(torch.device("cpu"))
    assert re.search(reason, why), why
    idx = _indices(300, 32, 3, torch.int64)
    auto = Planner(cube(), 48, 32, ep_size=8)
    plain = Planner(cube(), 48, 32, ep_size=8, use_native=False)
    assert torch.equal(auto.run(idx), plain.run(idx))
    with pytest.raises(RuntimeError, match="use_native=True but the native LPLB path cannot run: .*" + reason):
        Planner(cube(), 48, 32, ep_size=8, use_native=True).run(idx)
    with pytest.raises(RuntimeError, match=reason):
        solve_balance(torch.ones(1, 8), torch.ones(1, 8, 2), cube(), use_native=True)
    assert lplb_native.wanted(None, torch.device("cpu")) is False


def test_disable_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PORTAPIPE_NATIVE", "0")
    _fallback_case("disabled by PORTAPIPE_NATIVE=0")


def test_missing_compiler_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PORTAPIPE_CACHE_DIR", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    _fallback_case("could not run the C compiler")
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang to find
    _fallback_case("no C compiler found")


def test_failing_compiler_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = tmp_path / "broken-cc"
    script.write_text("#!/bin/sh\necho 'lplb.c:1: error: this compiler always fails' >&2\nexit 3\n")
    script.chmod(0o755)
    monkeypatch.setenv("PORTAPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(script))
    _fallback_case(r"compiling lplb.c .* failed \(exit 3\): lplb.c:1: error: this compiler always fails")
    assert not list((tmp_path / "cache" / "native").iterdir())  # no partial library left behind


def test_builds_into_the_cache_directory(native: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PORTAPIPE_CACHE_DIR", str(tmp_path))
    assert lplb_native.why_unavailable(torch.device("cpu")) == ""
    built = list((tmp_path / "native").iterdir())
    assert len(built) == 1 and built[0].name.startswith("lplb-") and built[0].suffix == ".so"
    res = solve_balance(torch.tensor([[2.0, 4.0]]), torch.tensor([[[6.0], [0.0]]]), torch.tensor([[1], [0]]), use_native=True)
    assert res.objective.item() == pytest.approx(6.0, rel=1e-8)


def test_not_for_other_devices() -> None:
    assert "runs on CPU tensors, these are on meta" in lplb_native.why_unavailable(torch.device("meta"))
    with pytest.raises(RuntimeError, match="use_native=True but .* these are on meta"):
        lplb_native.wanted(True, torch.device("meta"))


def test_kernels_reject_out_of_range_data(native: None) -> None:
    # The C code indexes with these values: out-of-range ones are refused, never written through.
    kw = dict(move_cost=0.0, tol=1e-8, max_iter=50, accept_rtol=1e-6, step_frac=0.9999)
    with pytest.raises(ValueError, match=r"holder must name ranks in \[0, 8\)"):
        lplb_native.balance(torch.tensor([1] * 15 + [8]), torch.ones(1, 8), torch.ones(1, 16), **kw)
    for bad in ([0, 4], [0, 1, -2, 3, 0, 1, 2, 3, 0], [0, 1, 2, 3, 0, 1, 2, 3, -5]):  # in a block of four, in the tail
        with pytest.raises(ValueError, match=r"indices must be in \[-1, 4\)"):
            lplb_native.map_indices(torch.tensor(bad), torch.ones(4, dtype=torch.int64), torch.arange(4), torch.arange(4))
    p = Planner(cube(), 32, 16, ep_size=8, use_native=True)
    layout = (p._rank_of, p._lp_slot, p._orig_phys, p._copy_phys)
    counts = torch.ones(1, 16, dtype=torch.int64)
    plan_kw = dict(n_groups=1, ep_size=8, n_physical=32, tol=1e-8, max_iter=50, accept_rtol=1e-6, step_frac=0.9999, frac_bits=20)
    holder = p._lp(torch.device("cpu")).holder
    assert lplb_native.plan(counts, layout, holder, **plan_kw)[2].sum() == 16
    bad_copy = p._copy_phys.clone()
    bad_copy[0] = 32
    with pytest.raises(ValueError, match="lplb_plan: holder must name ranks"):
        lplb_native.plan(counts, (*layout[:3], bad_copy), holder, **plan_kw)
    with pytest.raises(ValueError, match=r"lplb_plan: indices must be in \[-1, 16\)"):
        lplb_native.plan(counts, layout, holder, **plan_kw, indices=torch.tensor([0, 16]))
    with pytest.raises(ValueError, match="do not fit together"):
        lplb_native.plan(counts, layout, holder, **{**plan_kw, "ep_size": 7})
