"""LPLB Planner in one process: slot layout, placement, redirection, plans and errors."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from portapipe.balancing import lplb_native
from portapipe.balancing.eplb import rebalance_experts
from portapipe.balancing.lp_balance import rank_loads
from portapipe.balancing.lplb import Planner
from portapipe.balancing.lplb_map import occurrence_rank
from portapipe.balancing.topology import cube, ring, torus

E, EP = 64, 16  # 4 experts per rank, 2 cube groups


def require_native() -> None:
    """Skip where there is no C compiler at all; anywhere else the native path must build."""
    if not os.environ.get("CC") and not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler (cc, gcc, clang or $CC) on this machine: the native path cannot be built")
    why = lplb_native.why_unavailable(torch.device("cpu"))
    assert why == "", why


#: the planner's two CPU paths: tensor operations, and the compiled one (skipped without a compiler)
PATHS = pytest.mark.parametrize("use_native", [False, True], ids=["torch", "native"])


def zipf_indices(gen: torch.Generator, tokens: int, n_experts: int, top_k: int, skew: float, perm: torch.Tensor) -> torch.Tensor:
    """Top-k routing with Zipf popularity (expert perm[r] has weight 1/(r+1)^skew) and Gumbel noise."""
    logits = torch.empty(n_experts)
    logits[perm] = -skew * torch.log(torch.arange(1, n_experts + 1, dtype=torch.float32))
    gumbel = -torch.log(-torch.log(torch.rand(tokens, n_experts, generator=gen).clamp(1e-9, 1 - 1e-9)))
    return (logits + gumbel).topk(top_k, dim=1).indices


def test_layout_every_replicated_expert_on_two_ranks() -> None:
    p = Planner(cube(), E + 2 * 2 * EP, E, ep_size=EP)  # 4 redundant slots per rank: 2 per class
    L, P = E // EP, (E + 4 * EP) // EP
    phy2log = p.phy2log.view(EP, P)
    assert sorted(p.phy2log.tolist()) == sorted(list(range(E)) + p.phy2log.view(EP, P)[:, L:].flatten().tolist())
    assert int(p.logcnt.sum()) == p.n_physical
    for r in range(EP):
        base, i = (r // 8) * 8, r % 8
        for c in range(2):
            for k in range(2):
                copy = int(phy2log[r, L + c * 2 + k])
                src = base + int(cube()[i, k])
                assert copy == int(phy2log[src, c * 2 + k])
                orig, cp = p.log2phy[copy].tolist()
                assert orig // P == src and cp == r * P + L + c * 2 + k


def test_update_placement_reorders_by_eplb_heaviest_first() -> None:
    gen = torch.Generator().manual_seed(0)
    workload = torch.randint(1, 1000, (E,), generator=gen)
    p = Planner(cube(), E + 2 * EP, E, ep_size=EP)
    phy2log, log2phy, logcnt = p.update_placement(workload)
    nored, _, _ = rebalance_experts(workload.view(1, -1).float(), E, 2, 1, EP)
    L, P = E // EP, E // EP + 2
    for r in range(EP):
        own = phy2log.view(EP, P)[r, :L]
        assert set(own.tolist()) == set(nored.view(EP, L)[r].tolist())  # EPLB decides which rank
        loads = workload[own]
        assert bool((loads[:-1] >= loads[1:]).all())  # heaviest first: the first two are replicated
    assert int((logcnt == 2).sum()) == 2 * EP
    heavy_rep = logcnt[workload.argsort(descending=True)[:EP]]
    assert int((heavy_rep == 2).sum()) >= EP // 2  # the globally heaviest are mostly replicated


@PATHS
def test_run_redirects_only_to_original_or_copy_and_matches_the_plan(use_native: bool) -> None:
    if use_native:
        require_native()
    gen = torch.Generator().manual_seed(1)
    p = Planner(cube(), E + 2 * EP, E, ep_size=EP, use_native=use_native, use_triton=False)
    assert p._paths(torch.device("cpu"))[0] == ("native" if use_native else "torch")  # the path named is the one mapping
    perm = torch.randperm(E, generator=gen)
    history = torch.bincount(zipf_indices(gen, 4096, E, 4, 0.6, perm).flatten(), minlength=E)
    p.update_placement(history)
    idx = zipf_indices(gen, 2048, E, 4, 0.6, perm).int()
    idx[5, 2] = -1
    idx[77] = -1
    out = p.run(idx)
    assert out.shape == idx.shape and out.dtype == idx.dtype
    assert bool((out[idx == -1] == -1).all()) and bool((out[idx >= 0] >= 0).all())
    valid = idx >= 0
    assert torch.equal(p.phy2log[out[valid].long()], idx[valid].long())  # same logical expert
    plan = p.last_plan
    assert torch.equal(torch.bincount(out[valid].long(), minlength=p.n_physical), plan.phys_load)
    # Tokens are split in the LP ratio: the copy gets round(q * count) of each replicated expert.
    counts = torch.bincount(idx[valid].long(), minlength=E)
    for e in (p.log2phy[:, 1] >= 0).nonzero().flatten().tolist():
        r = int(p.log2phy[e, 0]) // p.local_physical
        k = int(p.log2phy[e, 0]) % p.local_physical % 2
        q = 1 - float(plan.keep.reshape(-1, 2)[r, k])
        assert abs(int(plan.phys_load[p.log2phy[e, 1]]) - q * int(counts[e])) <= 0.5 + 1e-6
    # The integer loads are the LP optimum up to rounding, and deterministic.
    assert bool(plan.accepted.all()) and p.accepted_solves == 2 and p.fallback_solves == 0
    assert float(plan.rank_load.max()) <= float(plan.lp_objective.max()) + 2 * p.per_class * 2 * p.group_size
    assert torch.equal(p.run(idx), out)


@PATHS
def test_first_tokens_stay_on_the_original(use_native: bool) -> None:
    if use_native:
        require_native()
    p = Planner(ring(2), 4, 2, ep_size=2, use_native=use_native, use_triton=False)  # 1 expert per rank, each copied on the other rank
    idx = torch.tensor([[0], [0], [-1], [0], [0], [0], [0]])
    out = p.run(idx)
    # Expert 0 (rank 0) carries 6 tokens, expert 1 (rank 1) none: the last 3 move to rank 1's copy.
    assert p.last_plan.rank_load.tolist() == [3, 3]
    assert out.flatten().tolist() == [0, 0, -1, 0, 3, 3, 3]


def test_occurrence_rank() -> None:
    flat = torch.tensor([3, -1, 3, 0, 3, -1, 0])
    binned = torch.bincount(flat + 1, minlength=5)
    assert occurrence_rank(flat, binned).tolist() == [0, 0, 1, 0, 2, 1, 1]


def test_multi_source_plan_rounds_cumulatively() -> None:
    gen = torch.Generator().manual_seed(2)
    p = Planner(torus(2, 4), 32 + 16, 32, ep_size=8)
    counts = torch.randint(0, 50, (8, 32), generator=gen)
    plan = p.plan(counts)
    total = counts.sum(0)
    moved = plan.moved.sum(0)
    assert bool((plan.moved >= 0).all()) and bool((plan.moved <= counts).all())
    assert torch.equal(plan.phys_load[p.log2phy[:, 0]] + torch.where(p.log2phy[:, 1] >= 0, moved, 0), total)
    assert int(plan.phys_load.sum()) == int(total.sum())
    fixed = plan.rank_load.double()
    assert float(fixed.max()) == pytest.approx(float(plan.lp_objective.max()), abs=8)


def test_balance_close_to_lp_optimum_and_better_than_even_split() -> None:
    gen = torch.Generator().manual_seed(3)
    n_exp, ep = 128, 16
    p = Planner(cube(), n_exp + 2 * ep, n_exp, ep_size=ep)
    perm = torch.randperm(n_exp, generator=gen)
    p.update_placement(torch.bincount(zipf_indices(gen, 8192, n_exp, 8, 0.5, perm).flatten(), minlength=n_exp))
    idx = zipf_indices(gen, 8192, n_exp, 8, 0.5, perm)
    p.run(idx)
    plan = p.last_plan
    mean = plan.rank_load.double().mean()
    ratio = float(plan.rank_load.max() / mean)
    optimum = float(plan.lp_objective.max() / mean)
    assert ratio <= optimum * 1.01
    fixed, rep = p.group_loads(plan.counts.sum(0))
    assert float(fixed.sum() + rep.sum()) == float(plan.counts.sum())
    even = rank_loads(fixed, rep, torch.full_like(rep, 0.5), cube())
    assert ratio < float(even.max() / mean)


@PATHS
def test_fallbacks_are_counted(use_native: bool) -> None:
    if use_native:
        require_native()
    p = Planner(cube(), 16 + 16, 16, ep_size=8, max_iter=1, use_native=use_native)
    p.run(torch.randint(0, 16, (64, 2), generator=torch.Generator().manual_seed(0)))
    assert p.fallback_solves == 1 and p.accepted_solves == 0
    assert bool((p.last_plan.keep == 0.5).all())


@PATHS
@pytest.mark.parametrize(
    "indices, error, match",
    [
        (torch.tensor([[0, 64]]), ValueError, r"indices\[0, 1\] = 64 is out of range: .* \[0, 64\) or -1"),
        (torch.tensor([[-2, 3]]), ValueError, r"indices\[0, 0\] = -2 is out of range"),
        (torch.tensor([[3, -2]], dtype=torch.int32), ValueError, r"indices\[0, 1\] = -2 is out of range"),
        (torch.tensor([[0.0, 1.0]]), TypeError, "int32 or int64 .* got torch.float32"),
        (torch.tensor([[0, 1]], dtype=torch.int16), TypeError, "got torch.int16"),
        ([[0, 1]], TypeError, "must be a torch.Tensor"),
    ],
)
def test_bad_indices(use_native: bool, indices: object, error: type, match: str) -> None:
    if use_native:
        require_native()
    p = Planner(cube(), E + 2 * EP, E, ep_size=EP, use_native=use_native)
    with pytest.raises(error, match=match):
        p.run(indices)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        p.count(indices)  # type: ignore[arg-type]


def test_bad_construction() -> None:
    with pytest.raises(ValueError, match="needs ep_size"):
        Planner(cube(), 96, 64)
    with pytest.raises(ValueError, match="group size 8 must divide the EP size 12"):
        Planner(cube(), 96, 72, ep_size=12)
    with pytest.raises(ValueError, match=r"positive multiple of 2, e.g. n_physical = 96"):
        Planner(cube(), 80, 64, ep_size=16)
    with pytest.raises(ValueError, match="multiples of the EP size 16"):
        Planner(cube(), 97, 64, ep_size=16)
    with pytest.raises(ValueError, match="replicate 6 experts but holds only 4"):
        Planner(cube(), 64 + 6 * 16, 64, ep_size=16)
    with pytest.raises(TypeError, match="integer dtype"):
        Planner(cube().float(), 96, 64, ep_size=16)
    with pytest.raises(ValueError, match="needs the portapipe backend"):
        Planner(cube(), 96, 64, group=object())
    p = Planner(cube(), 96, 64, ep_size=16)
    with pytest.raises(ValueError, match="tensor of 64 per-expert loads"):
        p.update_placement(torch.ones(63))


def test_set_layout_adopts_a_saved_layout_and_rejects_bad_ones() -> None:
    src = Planner(cube(), 64 + 2 * 8, 64, ep_size=8)
    w = torch.arange(64, dtype=torch.float64).flip(0) ** 2
    phy2log, log2phy, logcnt = src.update_placement(w)
    dst = Planner(cube(), 64 + 2 * 8, 64, ep_size=8)
    got = dst.set_layout(phy2log.view(8, -1)[:, :8])
    assert torch.equal(got[0], phy2log) and torch.equal(got[1], log2phy) and torch.equal(got[2], logcnt)
    idx = torch.randint(0, 64, (256, 2), generator=torch.Generator().manual_seed(5))
    assert torch.equal(dst.run(idx), src.run(idx))
    with pytest.raises(ValueError, match=r"shape \[8, 8\]"):
        dst.set_layout(torch.arange(64).view(4, 16))
    with pytest.raises(ValueError, match="exactly once"):
        dst.set_layout(torch.zeros(8, 8, dtype=torch.int64))
