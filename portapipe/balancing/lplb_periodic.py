"""LPLB's periodic placement in a running model: which experts get a copy, re-planned from the
window's loads, and what the per-batch LP makes of given loads on a placement.

Every ``interval`` steps :class:`~portapipe.balancing.runtime.ExpertBalancer` asks
:func:`plan_periodic` for the planners' EPLB reordering of the window's loads; the plan's
balancedness before and after is that of the tokens' routing in force: while the replicas are
on, the LP's (mean / max EP-rank load once the LP has moved tokens between originals and
copies), while they are off (replica_switch.py), every token on its original's. The balancer
adopts the plan when the gain pays for the moved fraction of the slots (``min_gain``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from .cost import migration_cost
from .placement import ExpertPlacement
from .replica_switch import first_slot_loads
from .report import mean_over_max


def lplb_placement(planners: list[Any], ep: int, num_experts: int) -> ExpertPlacement:
    """The placement the planners' layouts make (one planner per MoE layer)."""
    return ExpertPlacement(torch.stack([p.phy2log for p in planners]), ep, num_experts, log2phy=torch.stack([p.log2phy for p in planners]))


def lp_rank_loads(planners: list[Any], loads: torch.Tensor) -> torch.Tensor:
    """Rows per EP rank ``[layers, ep]`` once each layer's LP has redistributed ``loads[layer]``
    (tokens per logical expert)."""
    # plan() counts solves; probing must not
    return torch.stack([copy.copy(p).plan(loads[row].round().to(torch.int64).unsqueeze(0)).rank_load.to(torch.float64).reshape(-1)
                        for row, p in enumerate(planners)])


def balancedness(planners: list[Any], loads: torch.Tensor, with_lp: bool) -> float:
    """Mean over layers of mean / max EP-rank load of ``loads``: after the LP's redistribution
    (``with_lp``) or with every token on its expert's original."""
    if with_lp:
        ranks = lp_rank_loads(planners, loads)
    else:
        p = lplb_placement(planners, planners[0].ep_size, planners[0].n_logical)
        ranks = first_slot_loads(loads, p.log2phy, p.slots_per_rank, p.num_ranks)
    values = mean_over_max(ranks).tolist()
    return sum(values) / len(values)


@dataclass
class PeriodicPlan:
    """A re-planned placement: ``before`` / ``after`` balancedness on the loads, the share of all
    slots whose rows it would move (``fraction``), the slots whose expert changes."""

    before: float
    after: float
    placement: ExpertPlacement
    planners: list[Any]
    fraction: float
    slots_changed: int
    changes: bool


def plan_periodic(planners: list[Any], loads: torch.Tensor, current: ExpertPlacement, nodes: int, with_lp: bool = True) -> PeriodicPlan:
    """The planners' reordering of ``loads`` (``[layers, experts]``) against the placement in force,
    judged with the LP in use (``with_lp``) or off.

    Judged with the LP only while it runs: the LP balances nearly any placement that copies the
    heaviest experts, so a placement judged by it stays put, and with the LP off (it does not
    pay) its tokens keep the originals' imbalance (balance_e2e's recorded loads at ep 2: no
    migration in 13 steps, the LP on in every one and the step slower than without a balancer)."""
    candidates = []
    for row, planner in enumerate(planners):
        cand = copy.copy(planner)  # update_placement rebinds the layout; the old planner stays as it was
        cand.update_placement(loads[row])
        candidates.append(cand)
    new = lplb_placement(candidates, current.num_ranks, current.num_experts)
    cost = migration_cost(current.phy2log, new.phy2log, current.num_ranks, nodes)
    return PeriodicPlan(balancedness(planners, loads, with_lp), balancedness(candidates, loads, with_lp), new, candidates,
                        float((cost.intra + cost.inter).sum()) / new.phy2log.numel(), int(cost.changed.sum()),
                        not torch.equal(new.phy2log, current.phy2log))
