"""What a balancer's after-step reports: each rank's figures of the step, the record of a
periodic decision, and one merged record from every rank's.

:func:`rank_figures` is what one rank measured (its MoE layers' loads per EP rank as routed,
tokens on replicas, LPLB's loads had every token gone to its first slot); the ranks' figures
travel through :class:`~portapipe.balancing.step_figures.FigureGather` and
:func:`merge_figures` turns them into the dict the metrics file carries under ``balancer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .placement import ExpertPlacement
from .replica_switch import first_slot_loads


def mean_over_max(loads: torch.Tensor) -> torch.Tensor:
    """Balancedness of rank loads ``[..., ranks]``: mean / max (1 when nothing was routed)."""
    top = loads.max(-1).values
    return torch.where(top > 0, loads.mean(-1) / top.clamp(min=1e-30), torch.ones_like(top))


@dataclass
class Rebalance:
    """One periodic decision on this pipeline rank's MoE layers.

    ``slots_changed``: slots whose expert the plan changes; ``rows_moved`` / ``bytes_moved``: slot
    rows (weights, gradients, optimizer state) sent between EP ranks when it was applied, of which
    ``rows_inter_node`` / ``bytes_inter_node`` crossed nodes.
    """

    step: int
    before: float
    after: float
    applied: bool
    rows_moved: int = 0
    layers: list[int] = field(default_factory=list)
    policy: str = ""
    slots_changed: int = 0
    rows_inter_node: int = 0
    bytes_moved: int = 0
    bytes_inter_node: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "before": self.before, "after": self.after, "applied": self.applied,
                "policy": self.policy, "slots_changed": self.slots_changed, "rows_moved": self.rows_moved,
                "rows_inter_node": self.rows_inter_node, "bytes_moved": self.bytes_moved,
                "bytes_inter_node": self.bytes_inter_node, "layers": self.layers}


def rank_figures(placement: ExpertPlacement, layers: list[int], pp_rank: int, dp_rank: int, ep: int, slots: torch.Tensor,
                 counts: torch.Tensor | None, originals: bool) -> dict[str, Any]:
    """One rank's raw per-layer loads of the step, for :func:`merge_figures`: ``slots`` (the rows
    this rank routed to each physical slot ``[layers, slots]``, added over its EP group by the
    merge: no collective of their own) as routed under ``placement``; with ``originals`` (lplb)
    and ``counts`` (tokens per logical expert, summed over this rank's EP group) also the loads
    had every token gone to its first slot. ``pp_rank`` and ``dp_rank`` name the EP group."""
    out: dict[str, Any] = {"pp_rank": pp_rank, "dp_rank": dp_rank, "layers": list(layers), "rank_loads": [], "orig_loads": [],
                           "replica_tokens": 0.0}
    if not layers:
        return out
    num_slots = placement.phy2log.shape[1]
    per = num_slots // ep
    first = placement.log2phy[:, :, 0]  # [layers, experts]: the slot an expert's tokens go to first
    primary = torch.zeros(len(layers), num_slots, dtype=torch.bool).scatter_(1, first, True)
    out["rank_loads"] = slots.view(len(layers), ep, per).sum(-1).tolist()
    out["replica_tokens"] = float(slots[~primary].sum())
    if originals and counts is not None:
        out["orig_loads"] = first_slot_loads(counts, placement.log2phy, per, ep).tolist()
    return out


#: rebalance figures added over the pipeline stages
SUMMED = ("slots_changed", "rows_moved", "rows_inter_node", "bytes_moved", "bytes_inter_node")


def merge_figures(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from every rank's figures.

    ``rank_balancedness`` is the step row's figure (:func:`portapipe.metrics.step.ep_step_figures`):
    the mean over MoE layers and EP groups of mean / max of the rows each EP rank of the group
    computed. An EP group (one pipeline rank of one DP replica) waits for its own slowest rank,
    so each group's balancedness counts, not that of the loads summed over DP replicas or
    DualPipe's two copies of a layer. Each rank reports the rows it routed itself, so a group's
    slot loads are added over its members. LPLB's originals (from ``expert_counts``, summed over
    the EP group and DualPipe's copies) are the same on every rank of a DP replica's stage, and
    the decisions on every rank of a stage: taken once.
    """
    loads: dict[tuple[int, int, int], torch.Tensor] = {}  # (layer, pp_rank, dp_rank): rows per EP rank
    orig: dict[tuple[int, int], list[float]] = {}  # (layer, dp_rank)
    tokens = 0.0
    events: dict[tuple[int, ...], dict[str, Any]] = {}
    for part in parts:
        key = tuple(part["layers"])
        if not key:
            continue
        tokens += part["replica_tokens"]
        group = (part["pp_rank"], part.get("dp_rank", 0))
        for layer, row in zip(key, part["rank_loads"]):
            t = torch.tensor(row, dtype=torch.float64)
            at = (layer, *group)
            loads[at] = loads[at] + t if at in loads else t
        orig.update(((layer, group[1]), row) for layer, row in zip(key, part["orig_loads"]))
        if part["event"] is not None:
            events[key] = part["event"]
    out: dict[str, Any] = {
        "rank_balancedness": float(mean_over_max(torch.stack([loads[k] for k in sorted(loads)])).mean()) if loads else None,
        "replica_tokens": tokens,
    }
    if orig:
        out["rank_balancedness_originals"] = float(mean_over_max(torch.tensor([orig[k] for k in sorted(orig)], dtype=torch.float64)).mean())
    if events:
        evs = list(events.values())
        weight = [len(e["layers"]) for e in evs]
        n = sum(weight)
        out["rebalance"] = {
            "step": evs[0]["step"],
            "policy": evs[0]["policy"],
            "before": sum(w * e["before"] for w, e in zip(weight, evs)) / n,
            "after": sum(w * e["after"] for w, e in zip(weight, evs)) / n,
            "applied": any(e["applied"] for e in evs),
            **{key: sum(e[key] for e in evs) for key in SUMMED},
            "per_stage": evs,
        }
    return out
