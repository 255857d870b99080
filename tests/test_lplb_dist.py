"""LPLB on 8 gloo ranks: every rank reaches the same plan, and the redirected tokens carry it out."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from portapipe.backends.base import Backend
from portapipe.balancing.lplb import Planner
from portapipe.balancing.lplb_map import occurrence_rank
from portapipe.balancing.topology import cube
from portapipe.ranks.launch import run_ranks

N_LOGICAL, N_PHYSICAL, WORLD = 32, 48, 8  # 4 experts and 2 redundant slots per rank
SEED = 11


def _workload() -> torch.Tensor:
    return torch.randint(1, 500, (N_LOGICAL,), generator=torch.Generator().manual_seed(SEED))


def _rank_indices(rank: int) -> torch.Tensor:
    """Rank-specific skewed routing: 96 tokens, top-2, a few dropped."""
    gen = torch.Generator().manual_seed(SEED + 1 + rank)
    pop = torch.arange(1, N_LOGICAL + 1, dtype=torch.float32).pow(-0.7)
    idx = torch.multinomial(pop.expand(96, N_LOGICAL), 2, generator=gen)
    idx[torch.rand(96, generator=gen) < 0.05, 1] = -1
    return idx


#: the planner's paths: tensor operations, and the default (the compiled one where a C compiler is)
PATHS = {"torch": False, "default": None}


def plan_on_rank(backend: Backend) -> dict[str, dict[str, Any]]:
    return {name: _plan_on_rank(backend, use_native) for name, use_native in PATHS.items()}


def _plan_on_rank(backend: Backend, use_native: bool | None) -> dict[str, Any]:
    group = dist.group.WORLD
    planner = Planner(cube(), N_PHYSICAL, N_LOGICAL, group=group, backend=backend, use_native=use_native)
    planner.update_placement(_workload())
    idx = _rank_indices(dist.get_rank())
    out = planner.run(idx)
    plan = planner.last_plan
    phys = torch.bincount(out[out >= 0], minlength=N_PHYSICAL)
    backend.all_reduce(phys, group=group)  # what the experts really receive over the group
    return {
        "out": out,
        "phy2log": planner.phy2log,
        "keep": plan.keep,
        "moved": plan.moved,
        "counts": plan.counts,
        "phys_load": plan.phys_load,
        "received": phys,
        "accepted": planner.accepted_solves,
    }


@pytest.fixture(scope="module")
def launched() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(plan_on_rank, WORLD, wall_timeout_s=120)


@pytest.mark.multiproc
@pytest.mark.parametrize("path", list(PATHS))
def test_eight_ranks_share_one_plan_and_realise_it_exactly(launched: list[dict[str, dict[str, Any]]], path: str) -> None:
    results = [by_path[path] for by_path in launched]
    first = results[0]
    for key in ("phy2log", "keep", "moved", "counts", "phys_load"):
        for rank, res in enumerate(results[1:], 1):
            assert torch.equal(res[key], first[key]), f"rank {rank} has a different {key}"
    for rank, res in enumerate(results):
        assert torch.equal(res["received"], first["phys_load"]), f"rank {rank}: redirected loads differ from the plan"
        assert res["accepted"] == 1
    # The same plan and mapping from one process that sees every rank's tokens.
    ref = Planner(cube(), N_PHYSICAL, N_LOGICAL, ep_size=WORLD, use_native=PATHS[path])
    ref.update_placement(_workload())
    assert torch.equal(ref.phy2log, first["phy2log"])
    counts = torch.stack([torch.bincount(_rank_indices(r)[_rank_indices(r) >= 0], minlength=N_LOGICAL) for r in range(WORLD)])
    plan = ref.plan(counts)
    assert torch.equal(plan.moved, first["moved"]) and torch.equal(plan.phys_load, first["phys_load"])
    assert int(plan.phys_load.sum()) == int(counts.sum())
    for r, res in enumerate(results):
        flat = _rank_indices(r).flatten()
        occ = occurrence_rank(flat, torch.bincount(flat + 1, minlength=N_LOGICAL + 1))
        e = flat.clamp(min=0)
        stay = counts[r] - plan.moved[r]
        want = torch.where(flat < 0, -1, torch.where(occ < stay[e], ref.log2phy[e, 0], ref.log2phy[e, 1]))
        assert torch.equal(res["out"].flatten(), want), f"rank {r} redirected differently from the reference"
