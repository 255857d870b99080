"""Expert replication and placement (EPLB) for every layer at once: the public API.

``rebalance_experts(weight[L, E], R, groups, nodes, gpus)`` decides how many replicas each
logical expert gets and which of the ``R`` physical slots (``R / gpus`` per GPU) holds which
expert, for every layer at once. Four policies:

- ``"hierarchical"`` (default, the published semantics): pack expert groups onto nodes, replicate
  inside each node, pack each node's replicas onto its GPUs. Falls back to ``"global"`` when the
  group count is not a multiple of the node count, as the published algorithm does
  (:func:`policy_run` names what ran).
- ``"global"``: the same steps with one group and one node.
- ``"refined"`` (:mod:`.refined`): global replication, a packing that never puts two replicas
  of an expert on one GPU, pairwise swaps; per layer the better of this and the published plan.
- ``"incremental"`` (:mod:`.incremental`): from the placement in force (``current``), change as
  few slots as the balance gained is worth, within ``max_moved``; never less balanced than
  ``current`` on any layer.

``refined`` and ``incremental`` keep the slot rule of :mod:`.slots` (no GPU holds two replicas of
one expert); the published two stay identical to the published algorithm, which does not.
"""

from __future__ import annotations

import math
import numbers

import torch

from .incremental import INTER_NODE_COST, check_current, incremental_plan
from .published import check_shape, check_weight, gpu_loads, hierarchical_plan, replicate_experts, uses_hierarchy
from .refined import refined_plan
from .slots import check_fits, replicas_in_slot_order

POLICIES = ("hierarchical", "global", "refined", "incremental")

__all__ = ["POLICIES", "balancedness", "gpu_loads", "lower_bound", "max_load_ratio", "policy_run", "rebalance_experts"]


def policy_run(policy: str, num_groups: int, num_nodes: int) -> str:
    """The policy that actually runs: ``hierarchical`` becomes ``global`` when groups % nodes != 0."""
    if policy == "hierarchical" and not uses_hierarchy(num_groups, num_nodes):
        return "global"
    return policy


def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    policy: str = "hierarchical",
    current: torch.Tensor | None = None,
    max_moved: float = 0.1,
    min_gain: float = 0.0,
    inter_node_cost: float = INTER_NODE_COST,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replicate and place experts for every layer.

    Args:
        weight: [L, E] load of each logical expert (token counts), any real dtype, >= 0.
        num_replicas: physical slots R (a multiple of ``num_gpus``, >= E).
        num_groups: expert groups of the model's group-limited routing (must divide E).
        num_nodes: nodes the GPUs span (must divide ``num_gpus``).
        num_gpus: GPUs P; slot p lives on GPU p // (R / P).
        policy: "hierarchical" (published; global when num_groups % num_nodes != 0), "global",
            "refined" or "incremental" (see the module doc).
        current: incremental only: the placement in force, phy2log [L, R].
        max_moved: incremental only: at most this fraction of each layer's slots change (0..1).
        min_gain: incremental only: a layer changes only as far as each changed slot gains at
            least ``min_gain / R`` balancedness (mean / max GPU load) on average.
        inter_node_cost: incremental only: how much more a changed slot whose expert must come
            from another node counts than one filled within its node, when moves are ranked
            (>= 1; 1 ignores the nodes).

    Returns:
        phy2log [L, R] int64: logical expert in each slot.
        log2phy [L, E, R - E + 1] int64: slots of each expert's replicas, original first, -1 padded
            (refined and incremental: in slot order).
        logcnt [L, E] int64: replicas per expert (>= 1; rows sum to R).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    w = check_weight(weight)
    layers, experts = w.shape
    check_shape(experts, num_replicas, num_groups, num_nodes, num_gpus, hierarchy=policy != "global")
    if policy != "incremental" and current is not None:
        raise ValueError(f"current is the placement an incremental rebalance starts from; policy {policy} plans from scratch")
    if policy in ("refined", "incremental"):
        check_fits(experts, num_replicas, num_gpus)
    if policy == "incremental":
        if current is None:
            raise ValueError("policy incremental needs current=phy2log, the placement in force")
        if not _real(max_moved) or not 0.0 <= max_moved <= 1.0:
            raise ValueError(f"max_moved is a fraction of the slots, in [0, 1]; got {max_moved!r}")
        if not _real(min_gain) or not min_gain >= 0.0:
            raise ValueError(f"min_gain must be a number >= 0, got {min_gain!r}")
        if not _real(inter_node_cost) or not inter_node_cost >= 1.0 or math.isinf(inter_node_cost):
            raise ValueError(f"inter_node_cost must be a finite number >= 1, got {inter_node_cost!r}")
        cur = check_current(current, layers, experts, num_replicas, num_gpus)
        phy2log, logcnt = incremental_plan(w, cur, num_gpus, max_moved, min_gain, num_nodes, float(inter_node_cost))
        return phy2log, replicas_in_slot_order(phy2log, experts, num_replicas - experts + 1)[0], logcnt
    if policy == "refined":
        phy2log, logcnt = refined_plan(w, num_replicas, num_groups, num_nodes, num_gpus)
        return phy2log, replicas_in_slot_order(phy2log, experts, num_replicas - experts + 1)[0], logcnt
    groups, nodes = (num_groups, num_nodes) if policy_run(policy, num_groups, num_nodes) == "hierarchical" else (1, 1)
    phy2log, rank, logcnt = hierarchical_plan(w, num_replicas, groups, nodes, num_gpus)
    width = num_replicas - experts + 1
    log2phy = torch.full((layers, experts * width), -1, dtype=torch.int64)
    log2phy.scatter_(1, phy2log * width + rank, torch.arange(num_replicas).expand(layers, num_replicas))
    return phy2log, log2phy.view(layers, experts, width), logcnt


def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def balancedness(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int, logcnt: torch.Tensor | None = None) -> torch.Tensor:
    """Mean GPU load / max GPU load per layer (1.0 = perfect); float64 [L]. An idle layer scores 1."""
    load = gpu_loads(check_weight(weight), phy2log, num_gpus, logcnt)
    top = load.max(1).values
    return torch.where(top > 0, load.mean(1) / top.clamp(min=torch.finfo(torch.float64).tiny), torch.ones_like(top))


def lower_bound(weight: torch.Tensor, num_replicas: int, num_gpus: int) -> torch.Tensor:
    """No plan's max GPU load is below max(total / P, best achievable max load per replica); [L]."""
    w = check_weight(weight)
    check_shape(w.shape[1], num_replicas, 1, 1, num_gpus)
    _, _, cnt = replicate_experts(w, num_replicas)  # the greedy minimises the largest w / count
    w64 = w.to(torch.float64)
    return torch.maximum(w64.sum(1) / num_gpus, (w64 / cnt).max(1).values)


def max_load_ratio(weight: torch.Tensor, phy2log: torch.Tensor, num_replicas: int, num_gpus: int) -> torch.Tensor:
    """Max GPU load / lower bound per layer (1.0 = optimal); float64 [L]. An idle layer scores 1."""
    w = check_weight(weight)
    top = gpu_loads(w, phy2log, num_gpus).max(1).values
    lb = lower_bound(w, num_replicas, num_gpus)
    return torch.where(lb > 0, top / lb.clamp(min=torch.finfo(torch.float64).tiny), torch.ones_like(lb))
