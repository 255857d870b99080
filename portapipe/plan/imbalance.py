"""Expert load imbalance: max / mean routed rows over the EP ranks, from recorded loads.

Recorded loads are tokens per logical expert per MoE layer (``[layers][experts]``): the
``expert_loads.json`` a training run with ``balancer.kind: eplb`` writes, or the loads a profile
saw. For an EP size and a balancer this says how much more the busiest EP rank computes and
receives than the mean, averaged over layers; the slowest EP rank sets the pace of every
all-to-all, so the time model charges it to all:

- none: EP rank j holds experts ``[j E/ep, (j+1) E/ep)``;
- eplb: :func:`portapipe.balancing.eplb.rebalance_experts` with the config's redundant slots,
  groups, nodes and policy, then :func:`~portapipe.balancing.eplb.gpu_loads`;
- lplb: :class:`portapipe.balancing.lplb.Planner` placed by the loads, then one batch planned
  with the loads as the batch (the per-batch LP's rank loads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class LoadsError(ValueError):
    """A loads file that cannot be used."""


def read_loads(path: str | Path) -> list[list[float]]:
    """Loads ``[layers][experts]`` from any file ``portapipe balance --loads`` reads (a run's
    ``expert_loads.json``, text, ``.pt``); LoadsError naming ``--loads`` and the problem."""
    from ..balancing.loads_file import read_loads as read_loads_file

    if not Path(path).is_file():
        raise LoadsError(f"--loads: {str(path)!r} does not exist (a run with balancer.kind: eplb writes <log.dir>/expert_loads.json)")
    try:
        return read_loads_file(path).tolist()
    except ValueError as exc:
        raise LoadsError(f"--loads: {exc}") from None


def imbalance(loads: list[list[float]], ep: int, balancer: Any = None, n_groups: int = 1) -> float:
    """Mean over layers of (max EP-rank load / mean EP-rank load); 1.0 when ``ep`` is 1 or nothing was routed."""
    if ep <= 1 or not loads:
        return 1.0
    import torch

    w = torch.tensor(loads, dtype=torch.float64)
    layers, experts = w.shape
    if experts % ep:
        raise LoadsError(f"loads have {experts} experts, which do not split over ep = {ep}")
    kind = getattr(balancer, "kind", "none")
    if kind == "eplb":
        from ..balancing.eplb import gpu_loads, rebalance_experts

        slots = experts + balancer.redundant * ep
        groups = balancer.groups or n_groups
        # the placement the recorded loads call for: incremental plans its first one with refined
        policy = "refined" if balancer.policy == "incremental" else balancer.policy
        phy2log, _, logcnt = rebalance_experts(w.float(), slots, groups, balancer.nodes, ep, policy=policy)
        ranks = gpu_loads(w, phy2log, ep, logcnt)
    elif kind == "lplb":
        from ..balancing.lplb import Planner
        from ..balancing.runtime import topology_of

        rows = []
        for layer in w:
            planner = Planner(topology_of(balancer, ep), experts + balancer.redundant * ep, experts, ep_size=ep, use_native=False)
            planner.update_placement(layer)
            rows.append(planner.plan(layer.round().long().unsqueeze(0)).rank_load.to(torch.float64))
        ranks = torch.stack(rows)
    else:
        ranks = w.view(layers, ep, experts // ep).sum(2)
    mean = ranks.mean(1)
    ratio = torch.where(mean > 0, ranks.max(1).values / mean.clamp(min=1e-30), torch.ones_like(mean))
    return float(ratio.mean())
