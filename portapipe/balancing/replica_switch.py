"""Whether a balancer's replicas take tokens next step: on only while that is predicted to pay.

Replicas cost time every step they are used: EPLB spreads tokens over them and LPLB solves its
per-batch LP, and each replicated expert's gradient is summed over its replicas (whole experts
exchanged between the EP ranks holding them). They win back the wait of the EP ranks at every combine
for the most loaded one. :class:`ReplicaSwitch` weighs the two after every step, from measured
figures only:

- **gain**: the rows the busiest EP rank computes over the step (its MoE layers summed) with
  every token on its expert's first slot less those with the replicas in use (EPLB: each
  expert's tokens split evenly over its replicas; LPLB: the LP's plan of the step's loads), times
  this rank's measured expert seconds per row
  (:class:`~portapipe.models.expert_clock.ExpertClock`; pricing.py says why over the step);
- **cost**: what the replicas cost this rank in the step: the LP's processor time and the wall
  time of the replica gradient sum (the EP ranks arrive at it together: the gradient's dispatch
  just before has already made them wait for each other). While the replicas are off the last
  measured cost is kept.

Means over ranks, so every rank takes the same decision; the first two steps only measure (they
pay one-time costs). While off, every token goes to its expert's first slot (replicas are exact
copies, so no value changes) and, when the optimizer state can move (``zero_stage`` 0), the
gradient sum is skipped: the replicas then fall out of date and are refilled from their first
slots (weights and optimizer state, bit for bit) before they take tokens again. That refill is
paid once per return, so out-of-date replicas come back only when the gain beats the cost by the
last measured refill spread over ``horizon`` steps (the balancer's ``interval``): a gain hovering
about the cost would otherwise switch them on and off, paying a refill each time. A resumed run
starts with the replicas on and measures again.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("portapipe.balancing")


def first_slot_loads(counts: torch.Tensor, log2phy: torch.Tensor, slots_per_rank: int, ep: int) -> torch.Tensor:
    """Rows per EP rank ``[layers, ep]`` with every token on its expert's first slot."""
    first = torch.div(log2phy[:, :, 0], slots_per_rank, rounding_mode="floor")
    return torch.zeros(counts.shape[0], ep, dtype=torch.float64).scatter_add_(1, first, counts.to(torch.float64))


def spread_loads(counts: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, slots_per_rank: int, ep: int) -> torch.Tensor:
    """Rows per EP rank ``[layers, ep]`` with each expert's tokens split evenly over its replicas."""
    out = torch.zeros(counts.shape[0], ep, dtype=torch.float64)
    share = counts.to(torch.float64) / logcnt.clamp(min=1)
    for k in range(log2phy.shape[2]):
        has = k < logcnt  # [layers, experts]: expert has a k-th replica
        rank = torch.div(log2phy[:, :, k].clamp(min=0), slots_per_rank, rounding_mode="floor")
        out.scatter_add_(1, rank, torch.where(has, share, torch.zeros_like(share)))
    return out


class ReplicaSwitch:
    """The on / off decision of one rank's balancer (see the module docstring)."""

    def __init__(self, enabled: bool, kind: str) -> None:
        self.enabled = enabled  # balancer.stay_off
        self.kind = kind
        self.on = True
        self.cost_s = 0.0  # the last measured cost per step (kept while off)
        self.step_cost_s = 0.0  # measured in the current step
        self.refresh_s = 0.0  # the last refill of out-of-date replicas (wall time; 0 until one ran)
        self.off_steps = 0

    def charge(self, seconds: float) -> None:
        """Add time the replicas cost this step (the LP, the gradient sum)."""
        self.step_cost_s += seconds

    def figures(self, gain_s: float) -> dict[str, float]:
        """This rank's gain and cost of the step just run, for :meth:`decide`; starts a new step."""
        if self.step_cost_s > 0:
            self.cost_s = self.step_cost_s
        self.step_cost_s = 0.0
        return {"gain_s": gain_s, "cost_s": self.cost_s, "refresh_s": self.refresh_s}

    def decide(self, step: int, parts: list[dict[str, Any] | None], horizon: int = 1) -> dict[str, Any]:
        """Whether the replicas take tokens in the next step, from every rank's :meth:`figures`
        (``step``: 1-based, the step just run); the metrics of the step just run. While off, coming
        back also costs the last measured refill over ``horizon`` steps (0 until one was timed, and
        always 0 where no refill runs: the gradient sum was not skipped)."""
        figures = [p for p in parts if p is not None]
        gain = sum(f["gain_s"] for f in figures) / max(len(figures), 1)
        cost = sum(f["cost_s"] for f in figures) / max(len(figures), 1)
        if not self.on:
            cost += sum(f.get("refresh_s", 0.0) for f in figures) / max(len(figures), 1) / max(horizon, 1)
        was = self.on
        self.on = not self.enabled or not figures or step < 2 or gain >= cost
        if not was:
            self.off_steps += 1
        if self.on != was:
            what = "the per-batch LP" if self.kind == "lplb" else "routing to replicas"
            log.info("%s step %d: predicted gain %.3f ms %s cost %.3f ms per step: %s %s", self.kind, step, 1e3 * gain,
                     ">=" if self.on else "<", 1e3 * cost, "resuming" if self.on else "skipping", what)
        return {"replicas_used": was, "replicas_off_steps": self.off_steps, "replica_gain_ms": 1e3 * gain, "replica_cost_ms": 1e3 * cost}
