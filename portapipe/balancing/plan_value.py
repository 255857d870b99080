"""What a changed slot costs and what a rebalance plan is worth, for the incremental policy's searches.

- :class:`SlotPrice`: the price of a slot's new expert relative to the placement in force
  (``current``): nothing when the slot gets its current expert back, 1 when the expert's rows
  come from the slot's own node (a GPU of it holds that expert in ``current``),
  ``inter_node_cost`` when they must cross nodes. Moves are ranked by it among those of equal
  effect, so a rebalance fetches experts within a node where it can.
- :func:`plan_values`: a plan's worth, ``balancedness gain - min_gain * moved / R``
  (balancedness: mean / max GPU load, float64; ``moved``: changed slots whose expert's rows come
  from another GPU, i.e. the bytes moved over the bytes of all slots).
"""

from __future__ import annotations

import copy

import torch

from .published import gpu_loads


class SlotPrice:
    """Prices of changing slots of ``current`` [L, R] (see the module doc); GPUs are numbered node-major."""

    def __init__(self, current: torch.Tensor, experts: int, num_gpus: int, num_nodes: int, inter_node_cost: float) -> None:
        layers, r = current.shape
        gpu = torch.arange(r) // (r // num_gpus)
        self.node = gpu // (num_gpus // num_nodes)  # [R] node of each slot
        self.experts, self.inter = experts, inter_node_cost
        self.cur = current
        self.on_node = torch.zeros(layers, num_nodes * experts, dtype=torch.bool).scatter_(1, self.node * experts + current, True)

    def rows(self, rows: torch.Tensor) -> "SlotPrice":
        """The same prices for the layers ``rows`` (any index tensor, repeats allowed)."""
        sub = copy.copy(self)
        sub.cur, sub.on_node = self.cur[rows], self.on_node[rows]
        return sub

    def of(self, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Price of slot ``slots`` [A, ...] holding expert ``values`` (same shape), float."""
        a = slots.shape[0]
        flat_s, flat_v = slots.reshape(a, -1), values.reshape(a, -1)
        near = self.on_node.gather(1, self.node[flat_s] * self.experts + flat_v)
        moved = flat_v != self.cur.gather(1, flat_s)
        price = torch.where(near, 1.0, self.inter) * moved
        return price.view(slots.shape)

    def delta(self, phy: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Change of the price when slots ``slots`` go from their expert in ``phy`` to ``values``."""
        return self.of(slots, values) - self.of(slots, phy.gather(1, slots.reshape(slots.shape[0], -1)).view(slots.shape))


def plan_values(w: torch.Tensor, plans: torch.Tensor, current: torch.Tensor, num_gpus: int, min_gain: float) -> torch.Tensor:
    """Worth [A] of each plan ``plans`` [A, R] for loads ``w`` [A, E] against ``current`` [A, R]
    (see the module doc; ``min_gain`` may be inf: then any moved slot makes a plan worthless)."""
    a, r = plans.shape
    experts = w.shape[1]
    both = gpu_loads(torch.cat([w, w]), torch.cat([current, plans]), num_gpus).max(1).values
    mean = w.to(torch.float64).sum(1) / num_gpus
    bal = torch.where(both > 0, mean.repeat(2) / both.clamp(min=torch.finfo(torch.float64).tiny), torch.ones_like(both))
    gpu = torch.arange(r) // (r // num_gpus)
    held = torch.zeros(a, num_gpus * experts, dtype=torch.bool).scatter_(1, gpu * experts + current, True)
    here = held.gather(1, gpu * experts + plans)
    moved = ((plans != current) & ~here).sum(1).to(torch.float64)
    return (bal[a:] - bal[:a]) - torch.where(moved > 0, min_gain * moved / r, 0.0)
