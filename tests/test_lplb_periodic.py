"""LPLB's periodic placement is judged by the routing in force: with the per-batch LP while the
replicas are on, with every token on its expert's original while they are off."""

from __future__ import annotations

import pytest
import torch

from portapipe.balancing.lplb import Planner
from portapipe.balancing.lplb_periodic import lplb_placement, plan_periodic
from portapipe.balancing.topology import ring


def _planners() -> list[Planner]:
    # 4 experts on 2 ranks, 1 redundant slot each: rank 0 holds 0, 1 and a copy of 2; rank 1 holds 2, 3 and a copy of 0
    return [Planner(ring(2), n_physical=6, n_logical=4, ep_size=2)]


def test_a_placement_the_lp_balances_moves_only_when_the_lp_is_off() -> None:
    planners = _planners()
    current = lplb_placement(planners, 2, 4)
    assert current.phy2log[0].tolist() == [0, 1, 2, 2, 3, 0]
    loads = torch.tensor([[30.0, 30.0, 1.0, 1.0]])  # both heavy experts on rank 0
    # the LP moves 29 of expert 0's tokens to its copy on rank 1: 31 rows each, nothing to gain
    on = plan_periodic(planners, loads, current, nodes=1, with_lp=True)
    assert on.before == pytest.approx(1.0) and on.after == pytest.approx(1.0)
    # on their originals rank 0 computes 60 rows, rank 1 2; the re-plan puts the heavy experts apart
    off = plan_periodic(planners, loads, current, nodes=1, with_lp=False)
    assert off.before == pytest.approx(31 / 60) and off.after == pytest.approx(1.0)
    assert off.changes and off.fraction > 0
    assert sorted(off.placement.phy2log[0, :2].tolist()) in ([0, 2], [0, 3], [1, 2], [1, 3])
    # the planners in force are left as they were
    assert torch.equal(lplb_placement(planners, 2, 4).phy2log, current.phy2log)
