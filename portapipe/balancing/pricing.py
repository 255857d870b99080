"""What a balancer's replicas and migrations are worth in seconds, from measured figures only.

Two prices, both used by :class:`~portapipe.balancing.runtime.ExpertBalancer`:

- :func:`replica_gain_s`: the seconds per step the replicas are predicted to save on this rank
  (the replica switch weighs it against their measured cost, replica_switch.py);
- :func:`auto_min_gain`: ``balancer.min_gain: auto`` for either kind (EPLB's rebalancing, LPLB's
  periodic placement): the balancedness a plan must gain per moved fraction of the slots so that
  its bytes pay for themselves within one interval.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .migration import expert_tensors, row_bytes

log = logging.getLogger("portapipe.balancing")


def expert_seconds_and_rows(modules: Sequence[Any]) -> tuple[float, int]:
    """This rank's routed-expert processor seconds and rows of the last step, over its MoE layers."""
    return sum(m.moe.clock.last[0] for m in modules), sum(m.moe.clock.last[1] for m in modules)


def replica_gain_s(first: torch.Tensor, used: torch.Tensor, modules: Sequence[Any], dp: int) -> float:
    """Seconds per step the replicas save this rank: the busiest EP rank's rows over the step (its
    MoE layers summed) with every token on its first slot (``first`` ``[layers, ep]``) less the
    busiest rank's with the replicas in use (``used``: LPLB's plan, EPLB's even spread), at this
    rank's measured seconds per row.

    Summed over the layers before the maximum, not per layer: the F&B overlap runs another
    micro-batch's parts while a rank waits at a combine, so layers whose busiest ranks differ
    largely cancel over the step (balance_e2e's recorded loads at ep 2: the busiest rank 0.8%
    above the mean over the step, 13% summed layer by layer). The busiest rank's work shrinks by
    this much whatever the schedule hides; the per-layer sum (nothing hidden) predicted 140-190 ms
    per step there while the replicas made the step slower."""
    seconds, rows = expert_seconds_and_rows(modules)
    gain = float(first.sum(0).max() - used.sum(0).max())
    # counts are summed over DP: each replica's ranks compute 1/dp of them
    return gain * seconds / rows / dp if rows else 0.0


def full_migration_bytes(modules: Sequence[Any], params: Sequence[str], slots_per_rank: int, num_slots: int,
                         optimizer: Any) -> int:
    """Bytes of every slot's rows (weights, gradients, optimizer state) of this rank's MoE layers."""
    full = 0
    for layer in modules:
        tensors = {n: getattr(layer.moe.experts, n) for n in params}
        full += row_bytes(expert_tensors(tensors, slots_per_rank, optimizer)) * num_slots
    return full


def auto_min_gain(kind: str, modules: Sequence[Any], full_bytes: float, s_per_byte: float, interval: int) -> float:
    """``min_gain: auto`` (collective over the job, the same value on every rank): the time a
    migration of every slot (``full_bytes``) would take at ``s_per_byte``, over ``interval`` steps
    of expert compute (each rank's last step; means over ranks).

    ``s_per_byte`` is the last migration's measured seconds per byte or, until one was timed, the
    replica gradient sum's processor seconds per byte (expert rows sent between the same EP ranks,
    as a migration sends them), so the first placement is weighed too. 0 when some rank with MoE
    layers measured neither (no replicas were ever summed)."""
    seconds, _ = expert_seconds_and_rows(modules)
    t = torch.tensor([seconds, full_bytes * s_per_byte, float(s_per_byte > 0), float(bool(modules))], dtype=torch.float64)
    dist.all_reduce(t)
    unpriced = t[2] < t[3] or t[0] <= 0
    value = 0.0 if unpriced else float(t[1] / (interval * t[0]))
    world = dist.get_world_size()
    if unpriced:  # say so: a plan is then adopted on any gain
        log.info("%s min_gain auto: 0 for now: %s", kind, "no expert time was measured" if t[0] <= 0 else
                 "no migration or replica gradient sum has been timed yet to price the bytes")
        return value
    log.info("%s min_gain auto: %.4f (a full migration %.1f ms, expert time %.1f ms per step, means over ranks)",
             kind, value, 1e3 * float(t[1]) / world, 1e3 * float(t[0]) / world)
    return value
