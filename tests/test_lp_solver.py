"""The batched interior-point LP solver against scipy's HiGHS, and LPLB's acceptance checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from portapipe.balancing.lp_balance import balance_lp, rank_loads, solve_balance
from portapipe.balancing.lp_solver import solve_lp
from portapipe.balancing.topology import cube, hypercube, ring, torus

linprog = pytest.importorskip("scipy.optimize").linprog

TOPOLOGIES = {"cube": cube(), "hypercube": hypercube(), "ring8": ring(8), "torus8x4": torus(8, 4), "torus4x8": torus(4, 8)}


def highs_balance(fixed: np.ndarray, rep: np.ndarray, r2o: np.ndarray) -> float:
    """The LPLB LP of one group written independently (inequality form) and solved by HiGHS."""
    g, d = rep.shape
    n = g * d
    a_ub = np.zeros((g, n + 1))
    b_ub = np.zeros(g)
    for i in range(g):
        for k in range(d):
            a_ub[i, i * d + k] -= rep[i, k]
            j = r2o[i, k]
            a_ub[i, j * d + k] += rep[j, k]
        a_ub[i, n] = -1.0
        b_ub[i] = -(fixed[i] + rep[i].sum())
    c = np.zeros(n + 1)
    c[n] = 1.0
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=[(0, 1)] * n + [(None, None)], method="highs")
    assert res.status == 0
    return float(res.fun)


def random_loads(gen: torch.Generator, count: int, g: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-count-like loads with the awkward cases mixed in: idle ranks, empty classes, tiny groups."""
    fixed = torch.randint(0, 5000, (count, g), generator=gen).double()
    fixed *= torch.rand(count, 1, generator=gen) < 0.85  # some groups have only replicated load
    rep = torch.randint(0, 3000, (count, g, d), generator=gen).double()
    rep *= torch.rand(count, g, d, generator=gen) < 0.9  # some classes carry nothing
    rep *= torch.rand(count, 1, 1, generator=gen) * 2  # replicated share from tiny to dominant
    return fixed, rep


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_optimum_matches_highs(name: str) -> None:
    r2o = TOPOLOGIES[name]
    g, d = r2o.shape
    gen = torch.Generator().manual_seed(1234 + g * 10 + d)
    count = 80  # x 5 topologies = 400 instances
    fixed, rep = random_loads(gen, count, g, d)
    res = solve_balance(fixed, rep, r2o)
    assert bool(res.accepted.all()), f"{int((~res.accepted).sum())} instances fell back"
    ref = np.array([highs_balance(fixed[i].numpy(), rep[i].numpy(), r2o.numpy()) for i in range(count)])
    ours = res.objective.numpy()
    rel = np.abs(ours - ref) / np.maximum(ref, 1e-12)
    assert rel.max() <= 1e-4, f"worst relative gap to HiGHS {rel.max():.2e} at instance {rel.argmax()}"
    # The returned shares really give that objective, and never beat the certified bound.
    loads = rank_loads(fixed, rep, res.keep, r2o).amax(1)
    assert torch.allclose(loads, res.objective, rtol=1e-9)
    assert bool((res.lower_bound <= res.objective * (1 + 1e-6)).all())
    assert bool(((res.keep >= 0) & (res.keep <= 1)).all())


def test_known_answer_two_ranks() -> None:
    # Rank 0: fixed 2, replicated 6 (copy on rank 1); rank 1: fixed 4, replicated 0.
    # Moving q*6 to rank 1 balances 2 + 6(1-q) = 4 + 6q at q = 1/3: both carry 6.
    r2o = torch.tensor([[1], [0]])
    res = solve_balance(torch.tensor([[2.0, 4.0]]), torch.tensor([[[6.0], [0.0]]]), r2o)
    assert res.accepted.item()
    assert res.objective.item() == pytest.approx(6.0, rel=1e-8)
    assert res.keep[0, 0, 0].item() == pytest.approx(2 / 3, rel=1e-7)


def test_generic_lp_against_highs() -> None:
    # Random bounded feasible standard-form LPs: x0 feasible by construction, box rows keep them bounded.
    gen = torch.Generator().manual_seed(7)
    batch, m, n = 12, 5, 9
    A = torch.randn(batch, m, n, generator=gen, dtype=torch.float64)
    x0 = torch.rand(batch, n, generator=gen, dtype=torch.float64)
    box = torch.eye(n, dtype=torch.float64).expand(batch, n, n)
    A_full = torch.cat([torch.cat([A, torch.zeros(batch, m, n, dtype=torch.float64)], 2), torch.cat([box, box], 2)], 1)
    b = torch.cat([(A @ x0.unsqueeze(-1)).squeeze(-1), torch.ones(batch, n, dtype=torch.float64)], 1)
    c = torch.cat([torch.randn(batch, n, generator=gen, dtype=torch.float64), torch.zeros(batch, n, dtype=torch.float64)], 1)
    res = solve_lp(c, A_full, b)
    assert bool(res.converged.all())
    for i in range(batch):
        ref = linprog(c[i].numpy(), A_eq=A_full[i].numpy(), b_eq=b[i].numpy(), bounds=[(0, None)] * (2 * n), method="highs")
        assert res.objective[i].item() == pytest.approx(ref.fun, rel=1e-6, abs=1e-8)
    assert torch.allclose(A_full @ res.x.unsqueeze(-1), b.unsqueeze(-1), atol=1e-7)


def test_failed_solves_fall_back_to_even_split() -> None:
    fixed = torch.tensor([[10.0, 0, 0, 0, 0, 0, 0, 0]])
    rep = torch.zeros(1, 8, 2, dtype=torch.float64)
    rep[0, 0] = torch.tensor([40.0, 40.0])
    capped = solve_balance(fixed, rep, cube(), max_iter=1)  # one iteration cannot converge
    assert not capped.accepted.item()
    assert bool((capped.keep == 0.5).all())
    even = rank_loads(fixed, rep, torch.full_like(rep, 0.5), cube()).amax(1)
    assert capped.objective.item() == pytest.approx(even.item())
    solved = solve_balance(fixed, rep, cube())
    assert solved.accepted.item() and solved.objective.item() < even.item()


def test_all_zero_and_single_loaded_groups() -> None:
    fixed = torch.zeros(2, 8, dtype=torch.float64)
    rep = torch.zeros(2, 8, 2, dtype=torch.float64)
    rep[1, 3, 1] = 100.0  # everything on one replicated class: half can move to its copy
    res = solve_balance(fixed, rep, cube())
    assert bool(res.accepted.all())
    assert res.objective[0].item() == 0.0
    assert res.objective[1].item() == pytest.approx(50.0, rel=1e-7)


def test_runs_in_float32_inputs_and_reports_in_their_dtype() -> None:
    gen = torch.Generator().manual_seed(3)
    fixed, rep = random_loads(gen, 4, 8, 2)
    res = solve_balance(fixed.float(), rep.float(), cube())
    assert res.keep.dtype == torch.float32 and bool(res.accepted.all())


def test_bad_lp_shapes() -> None:
    c, A, b = balance_lp(torch.ones(1, 8, dtype=torch.float64), torch.ones(1, 8, 2, dtype=torch.float64), cube())
    with pytest.raises(ValueError, match=r"b must have shape \[1, 24\]"):
        solve_lp(c, A, b[:, :3])
    with pytest.raises(TypeError, match="floating dtype"):
        solve_lp(c.long(), A.long(), b.long())
    with pytest.raises(ValueError, match="batch, rows, columns"):
        solve_lp(c, A[0], b)


def test_compact_solver_scripted_and_plain_agree_and_move_cost_keeps_optimum() -> None:
    from portapipe.balancing.lp_balance import BalanceLP
    from portapipe.balancing.lp_solver import _box_ipm, solve_box_lp

    gen = torch.Generator().manual_seed(5)
    fixed, rep = random_loads(gen, 6, 8, 2)
    lp = BalanceLP(cube(), 6)
    h = fixed + rep.sum(2)
    scale = h.amax(1, keepdim=True)
    M = lp.moves * (rep.reshape(6, 16) / scale).unsqueeze(1)
    scripted = solve_box_lp(M, h / scale)
    plain = _box_ipm(M, h / scale, None, 1e-8, 50, 0.9999)  # the Python path used when scripting is unavailable
    assert scripted[3] == plain[3]
    for a, b in zip(scripted[:3], plain[:3]):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)
    # A small cost per moved token leaves the max load at its optimum (to the tie-break's size).
    base = lp.solve(fixed, rep)
    cheap = BalanceLP(cube(), 6, move_cost=1e-6).solve(fixed, rep)
    assert bool(cheap.accepted.all())
    assert torch.allclose(cheap.objective, base.objective, rtol=1e-4)
