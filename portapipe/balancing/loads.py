"""Expert load recording and the periodic EPLB rebalance.

:class:`LoadWindow` keeps the per-expert token counts of the last ``window`` steps (summed over
the expert-parallel group through the backend when asked). :class:`Rebalancer` implements
``balancer: {kind: eplb, interval: N, window: K, min_gain: x}``: every N steps it plans a new
placement from the window's loads, compares the mean balancedness (mean GPU load / max GPU load,
averaged over layers) of the current and the new placement on those loads, and adopts the new
one only when it gains, and by at least x. Each decision is logged with both figures.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .eplb import POLICIES, balancedness, rebalance_experts
from .placement import ExpertPlacement

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

    @property
    def gain(self) -> float:
        return self.after - self.before


class Rebalancer:
    """Periodic EPLB: record loads each step; every ``interval`` steps maybe adopt a new plan.

    The placement covers the EP group: ``num_gpus`` = EP ranks, ``num_replicas`` slots in all.
    After an applied event the caller moves the expert tensors with
    :func:`portapipe.balancing.placement.migrate_parameters` from ``event.previous`` to
    ``event.placement`` (collective: every EP rank makes the same decision from the same loads).
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
        policy: str = "refined",
        placement: ExpertPlacement | None = None,
    ) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1 step, got {interval}")
        if min_gain < 0:
            raise ValueError(f"min_gain must be >= 0, got {min_gain}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        # validate the shape once, up front, with rebalance_experts' own messages
        rebalance_experts(torch.ones(1, num_experts), num_replicas, num_groups, num_nodes, num_gpus, policy="global")
        self.args = (num_replicas, num_groups, num_nodes, num_gpus)
        self.interval, self.min_gain, self.policy = interval, min_gain, policy
        self.window = LoadWindow(window, num_layers, num_experts)
        self.placement = placement or ExpertPlacement.identity(num_layers, num_experts, num_gpus, num_replicas)
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
            min_gain=balancer.min_gain,
            policy=balancer.policy,
        )

    def step(self, step: int, counts: torch.Tensor, backend: Any = None, group: Any = None) -> RebalanceEvent | None:
        """Record step ``step``'s (0-based) counts; after every ``interval``-th step, decide."""
        self.window.record(counts, backend, group)
        if (step + 1) % self.interval:
            return None
        return self.decide(step)

    def decide(self, step: int) -> RebalanceEvent:
        """Plan from the window's loads; adopt the plan if it gains at least ``min_gain``."""
        loads = self.window.loads()
        num_gpus = self.args[3]
        plan = rebalance_experts(loads, *self.args, policy=self.policy)
        before = float(balancedness(loads, self.placement.phy2log, num_gpus).mean())
        after = float(balancedness(loads, plan[0], num_gpus, plan[2]).mean())
        previous = self.placement
        applied = after - before > 0 and after - before >= self.min_gain and not torch.equal(plan[0], previous.phy2log)
        if applied:
            self.placement = ExpertPlacement.from_plan(plan, num_gpus)
        event = RebalanceEvent(step, before, after, applied, self.placement, previous)
        self.history.append(event)
        log.info(
            "eplb step %d: balancedness %.4f -> %.4f (gain %+.4f, min_gain %.4f): %s",
            step, before, after, event.gain, self.min_gain, "rebalanced" if applied else "kept the current placement",
        )
        return event
