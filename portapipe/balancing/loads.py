"""Expert load recording and the periodic EPLB rebalance.

:class:`LoadWindow` keeps the per-expert token counts of the last ``window`` steps (summed over
the expert-parallel group through the backend when asked). :class:`Rebalancer` implements
``balancer: {kind: eplb, interval: N, window: K, policy: P, max_moved: m, min_gain: x}``: every N
steps it plans a new placement from the window's loads and adopts it only when

    balancedness gain >= x * moved fraction,  and the gain is > 0,

where balancedness is mean GPU load / max GPU load averaged over layers (on the window's loads),
and the moved fraction is the share of all expert slots whose rows cross between GPUs (bytes
moved / bytes of every slot's parameters and optimizer state). ``min_gain`` is thus the balance
a full migration must win: 0.02 accepts moving 10% of the slots for a gain of 0.002. With policy
``incremental`` (the default) the first placement, planned from the identity layout, uses
``refined``; every later one changes at most ``max_moved`` of each layer's slots and applies the
same trade-off per layer. Each decision is logged with both figures and the cost.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .cost import MigrationCost, migration_cost
from .eplb import POLICIES, balancedness, rebalance_experts
from .placement import ExpertPlacement
from .slots import duplicated

log = logging.getLogger("portapipe.balancing")


class LoadWindow:
    """Sliding window of per-layer, per-expert token counts ``[L, E]``, one entry per step."""

    def __init__(self, window: int, num_layers: int, num_experts: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        self.window, self.num_layers, self.num_experts = window, num_layers, num_experts
        self._steps: deque[torch.Tensor] = deque(maxlen=window)

    def record(self, counts: torch.Tensor, backend: Any = None, group: Any = None) -> torch.Tensor:
        """Add one step's counts; with ``backend``, first sum them over ``group`` (collective).

        Pass the backend when ``counts`` are this rank's own router counts; leave it out when they
        are already global (``StepResult.expert_counts`` is). Returns the recorded counts.
        """
        c = torch.as_tensor(counts).detach()
        if tuple(c.shape) != (self.num_layers, self.num_experts):
            raise ValueError(f"counts must be [layers, experts] = [{self.num_layers}, {self.num_experts}], got {tuple(c.shape)}")
        c = c.to(torch.float64).clone()
        if backend is not None:
            backend.all_reduce(c, op=dist.ReduceOp.SUM, group=group)
        c = c.cpu()
        if bool((c < 0).any()) or bool(torch.isnan(c).any()):
            raise ValueError("token counts must be >= 0 and not NaN")
        self._steps.append(c)
        return c

    def __len__(self) -> int:
        return len(self._steps)

    def loads(self) -> torch.Tensor:
        """Token counts summed over the window, float64 ``[L, E]`` (zeros when empty)."""
        if not self._steps:
            return torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        return torch.stack(list(self._steps)).sum(0)

    def state_dict(self) -> dict[str, Any]:
        """The recorded steps, oldest first (``steps`` [n, L, E]): a resumed run decides its next
        rebalance from the same loads as an uninterrupted one."""
        steps = torch.stack(list(self._steps)) if self._steps else torch.zeros(0, self.num_layers, self.num_experts, dtype=torch.float64)
        return {"steps": steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the recorded steps; a window shorter than the saved one keeps the newest."""
        steps = state["steps"]
        if steps.dim() != 3 or tuple(steps.shape[1:]) != (self.num_layers, self.num_experts):
            raise ValueError(
                f"saved loads have shape {tuple(steps.shape)}; this window records [steps, layers, experts] = "
                f"[n, {self.num_layers}, {self.num_experts}]"
            )
        self._steps.clear()
        for c in steps.to(torch.float64):
            self._steps.append(c.clone())


@dataclass
class RebalanceEvent:
    """One rebalance decision: balancedness of the current and the planned placement on the window."""

    step: int
    before: float
    after: float
    applied: bool
    placement: ExpertPlacement  # the placement in force after the decision
    previous: ExpertPlacement
    policy: str = "refined"  # the policy that planned
    cost: MigrationCost | None = None  # of going from previous to the plan (moved or not)

    @property
    def gain(self) -> float:
        return self.after - self.before

    @property
    def moved_fraction(self) -> float:
        """Share of all expert slots whose rows the plan sends between GPUs."""
        if self.cost is None:
            return 0.0
        return float((self.cost.intra + self.cost.inter).sum()) / self.previous.phy2log.numel()


class Rebalancer:
    """Periodic EPLB: record loads each step; every ``interval`` steps maybe adopt a new plan.

    The placement covers the EP group: ``num_gpus`` = EP ranks, ``num_replicas`` slots in all,
    ``num_nodes`` nodes of consecutive ranks. After an applied event the caller moves the expert
    tensors with :func:`portapipe.balancing.migration.migrate_parameters` from ``event.previous``
    to ``event.placement`` (collective: every EP rank makes the same decision from the same loads).
    ``planned``: the placement in force came from loads (not the identity layout); with policy
    ``incremental`` only such a placement is changed incrementally.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        num_replicas: int,
        num_gpus: int,
        num_groups: int = 1,
        num_nodes: int = 1,
        interval: int = 50,
        window: int = 10,
        min_gain: float = 0.0,
        policy: str = "incremental",
        placement: ExpertPlacement | None = None,
        max_moved: float = 0.1,
    ) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1 step, got {interval}")
        if min_gain < 0:
            raise ValueError(f"min_gain must be >= 0, got {min_gain}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if not 0 < max_moved <= 1:
            raise ValueError(f"max_moved is a fraction of the slots in (0, 1], got {max_moved}")
        # validate the shape once, up front, with rebalance_experts' own messages
        first = "refined" if policy == "incremental" else policy
        rebalance_experts(torch.ones(1, num_experts), num_replicas, num_groups, num_nodes, num_gpus, policy=first)
        self.args = (num_replicas, num_groups, num_nodes, num_gpus)
        self.interval, self.min_gain, self.policy, self.max_moved = interval, min_gain, policy, max_moved
        self.window = LoadWindow(window, num_layers, num_experts)
        self.placement = placement or ExpertPlacement.identity(num_layers, num_experts, num_gpus, num_replicas)
        self.planned = placement is not None
        self.history: list[RebalanceEvent] = []

    @classmethod
    def from_config(cls, balancer: Any, num_layers: int, num_experts: int, ep: int, model_groups: int = 1) -> Rebalancer:
        """From the config's ``balancer`` section: R = experts + redundant * ep slots over ep ranks."""
        return cls(
            num_layers,
            num_experts,
            num_experts + balancer.redundant * ep,
            ep,
            num_groups=balancer.groups or model_groups,
            num_nodes=balancer.nodes,
            interval=balancer.interval,
            window=balancer.window,
            min_gain=0.0 if balancer.min_gain == "auto" else balancer.min_gain,  # auto: set before each decision
            policy=balancer.policy,
            max_moved=balancer.max_moved,
        )

    def step(self, step: int, counts: torch.Tensor, backend: Any = None, group: Any = None) -> RebalanceEvent | None:
        """Record step ``step``'s (0-based) counts; after every ``interval``-th step, decide."""
        self.window.record(counts, backend, group)
        if (step + 1) % self.interval:
            return None
        return self.decide(step)

    def plan(self, loads: torch.Tensor) -> tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(policy used, plan) for ``loads``: incremental from a planned placement, else from scratch.

        Layers whose placement holds an expert twice on a rank (restored from a run with a published
        policy) get a first placement by ``refined``: incremental cannot start from them. The policy
        is then ``incremental+refined`` (or ``refined`` when no layer keeps the rule).
        """
        if self.policy != "incremental":
            return self.policy, rebalance_experts(loads, *self.args, policy=self.policy)
        if not self.planned:
            return "refined", rebalance_experts(loads, *self.args, policy="refined")
        current = self.placement.phy2log
        fresh = duplicated(current, self.args[3])
        keep = ~fresh
        if bool(fresh.all()):
            return "refined", rebalance_experts(loads, *self.args, policy="refined")
        inc = rebalance_experts(loads[keep], *self.args, policy="incremental", current=current[keep],
                                max_moved=self.max_moved, min_gain=self.min_gain)
        if not bool(fresh.any()):
            return "incremental", inc
        log.info("eplb: layers %s hold an expert twice on a rank; refined plans them afresh", fresh.nonzero().flatten().tolist())
        plan = rebalance_experts(loads, *self.args, policy="refined")
        for whole, part in zip(plan, inc):
            whole[keep] = part
        return "incremental+refined", plan

    def decide(self, step: int) -> RebalanceEvent:
        """Plan from the window's loads; adopt the plan if it gains at least ``min_gain`` per moved fraction."""
        loads = self.window.loads()
        num_nodes, num_gpus = self.args[2], self.args[3]
        policy, plan = self.plan(loads)
        before = float(balancedness(loads, self.placement.phy2log, num_gpus).mean())
        after = float(balancedness(loads, plan[0], num_gpus, plan[2]).mean())
        previous = self.placement
        cost = migration_cost(previous.phy2log, plan[0], num_gpus, num_nodes)
        event = RebalanceEvent(step, before, after, False, previous, previous, policy, cost)
        gain = after - before
        event.applied = gain > 0 and gain >= self.min_gain * event.moved_fraction and not torch.equal(plan[0], previous.phy2log)
        if event.applied:
            self.placement = event.placement = ExpertPlacement.from_plan(plan, num_gpus)
            self.planned = True
        self.history.append(event)
        log.info(
            "eplb step %d (%s): balancedness %.4f -> %.4f (gain %+.4f) moving %.1f%% of the slots (min_gain %.4f): %s",
            step, policy, before, after, gain, 100 * event.moved_fraction, self.min_gain,
            "rebalanced" if event.applied else "kept the current placement",
        )
        return event
