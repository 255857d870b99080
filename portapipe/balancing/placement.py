"""Apply an EPLB plan: route tokens to physical expert slots.

An :class:`ExpertPlacement` holds ``phy2log[L, R]`` (logical expert in each of R physical slots
of every MoE layer) over ``num_ranks`` expert-parallel ranks; slot ``s`` lives on rank
``s // (R / num_ranks)`` at local index ``s % (R / num_ranks)``.

Moving expert tensors from one placement to another: :mod:`.migration`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .eplb import rebalance_experts
from .slots import replicas_in_slot_order


@dataclass(frozen=True, eq=False, init=False)
class ExpertPlacement:
    """Where every logical expert of every MoE layer lives: ``phy2log[L, R]`` over ``num_ranks`` ranks.

    ``log2phy`` (replicas of each expert, the one routed to first at index 0) is taken from the
    plan when given, else derived in slot order.
    """

    phy2log: torch.Tensor
    num_ranks: int
    num_experts: int
    log2phy: torch.Tensor = field(repr=False)
    logcnt: torch.Tensor = field(repr=False)

    def __init__(self, phy2log: torch.Tensor, num_ranks: int, num_experts: int | None = None, log2phy: torch.Tensor | None = None) -> None:
        p2l = torch.as_tensor(phy2log, dtype=torch.int64).cpu()
        if p2l.dim() == 1:
            p2l = p2l.unsqueeze(0)
        if p2l.dim() != 2:
            raise ValueError(f"phy2log must be [layers, slots], got shape {tuple(p2l.shape)}")
        if num_ranks < 1 or p2l.shape[1] % num_ranks:
            raise ValueError(f"slots must split evenly over ranks: {p2l.shape[1]} slots over {num_ranks} ranks")
        experts = int(p2l.max()) + 1 if num_experts is None else num_experts
        if p2l.min() < 0 or p2l.max() >= experts:
            raise ValueError(f"phy2log entries must lie in [0, {experts}); got [{int(p2l.min())}, {int(p2l.max())}]")
        order, cnt = replicas_in_slot_order(p2l, experts)
        if (cnt == 0).any():
            layer, expert = (int(i) for i in (cnt == 0).nonzero()[0])
            raise ValueError(f"every expert needs a slot: expert {expert} of layer {layer} has none")
        if log2phy is not None:
            order = torch.as_tensor(log2phy, dtype=torch.int64).cpu().reshape(p2l.shape[0], experts, -1)
        object.__setattr__(self, "phy2log", p2l)
        object.__setattr__(self, "num_ranks", num_ranks)
        object.__setattr__(self, "num_experts", experts)
        object.__setattr__(self, "log2phy", order)
        object.__setattr__(self, "logcnt", cnt)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_plan(cls, plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_ranks: int) -> ExpertPlacement:
        """From ``rebalance_experts``'s ``(phy2log, log2phy, logcnt)``."""
        phy2log, log2phy, logcnt = plan
        return cls(phy2log, num_ranks, num_experts=logcnt.shape[-1], log2phy=log2phy)

    @classmethod
    def identity(cls, layers: int, num_experts: int, num_ranks: int, num_slots: int | None = None) -> ExpertPlacement:
        """Slot s holds expert s % E: the placement before any rebalance."""
        slots = num_experts if num_slots is None else num_slots
        return cls(torch.arange(slots).remainder(num_experts).expand(layers, slots), num_ranks, num_experts)

    @classmethod
    def even(cls, layers: int, num_experts: int, num_ranks: int, num_slots: int) -> ExpertPlacement:
        """The starting placement with redundant slots: even on even loads with replicas in use.

        Rank r holds its own ``num_experts / num_ranks`` experts, then in its j-th extra slot a
        copy of expert j of rank ``(r + 1 + j) % num_ranks``: every rank has as many of its
        experts copied elsewhere as it holds copies, so with each expert's tokens split over its
        replicas every rank carries the same rows on a balanced router (the identity layout
        copies the first experts onto the last ranks, which then carry 1.5x the rows of the
        first ones at one replica per rank, so the first plan "gains" on any router). Falls back
        to :meth:`identity` when the extra slots per rank outnumber the other ranks or the
        rank's own experts, or experts do not split evenly over ranks.
        """
        extra = (num_slots - num_experts) // num_ranks
        own = num_experts // num_ranks
        if num_experts % num_ranks or (num_slots - num_experts) % num_ranks or extra >= num_ranks or extra > own:
            return cls.identity(layers, num_experts, num_ranks, num_slots)
        row = [e for r in range(num_ranks)
               for e in [*range(r * own, (r + 1) * own), *(((r + 1 + j) % num_ranks) * own + j for j in range(extra))]]
        return cls(torch.tensor(row).expand(layers, num_slots), num_ranks, num_experts)

    @classmethod
    def from_loads(
        cls, weight: torch.Tensor, num_ranks: int, num_replicas: int, num_groups: int = 1, num_nodes: int = 1, policy: str = "refined"
    ) -> ExpertPlacement:
        """Balance ``weight[L, E]`` with :func:`rebalance_experts`, one GPU per rank."""
        return cls.from_plan(rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks, policy=policy), num_ranks)

    # ------------------------------------------------------------------ geometry
    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    def rank_of(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.div(slots, self.slots_per_rank, rounding_mode="floor")

    def local_index(self, slots: torch.Tensor) -> torch.Tensor:
        return slots.remainder(self.slots_per_rank)

    def experts_on(self, rank: int, layer: int = 0) -> torch.Tensor:
        """Logical expert held in each of ``rank``'s local slots."""
        s = self.slots_per_rank
        return self.phy2log[layer, rank * s:(rank + 1) * s]

    def with_first_slots_balanced(self, loads: torch.Tensor | None = None) -> ExpertPlacement:
        """The same slots, each replicated expert's first slot (the one routed to when replicas are
        off, and the one counted in the gradient norm and checkpoints) chosen so that the ranks'
        first-slot loads ``loads[L, E]`` (default: equal) are as even as a greedy pass makes them:
        heaviest expert first, onto the rank with the least so far."""
        order = self.log2phy.clone()
        weights = torch.ones(self.num_layers, self.num_experts, dtype=torch.float64) if loads is None else loads.to(torch.float64)
        per = self.slots_per_rank
        for layer in range(self.num_layers):
            rank_load = [0.0] * self.num_ranks
            for e in torch.argsort(weights[layer], descending=True, stable=True).tolist():
                slots = order[layer, e, : int(self.logcnt[layer, e])].tolist()
                best = min(slots, key=lambda s: (rank_load[s // per], s))
                order[layer, e, : len(slots)] = torch.tensor([best] + [s for s in slots if s != best])
                rank_load[best // per] += float(weights[layer, e])
        return ExpertPlacement(self.phy2log, self.num_ranks, self.num_experts, log2phy=order)

    # ------------------------------------------------------------------ routing
    def route(self, layer: int, experts: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Physical slot for each routed (token, expert) entry; -1 (a dropped token) stays -1.

        The j-th entry (in flattened order) naming expert e goes to replica (j + offset) mod
        count(e): replicas of an expert get equal shares to within one, deterministically. Pass
        the EP rank as ``offset`` so the odd entries of different ranks land on different replicas.
        """
        flat = experts.reshape(-1).to(torch.int64).cpu()
        dropped = flat < 0
        if bool((flat >= self.num_experts).any()):
            raise ValueError(f"expert ids must be < {self.num_experts}; got {int(flat.max())}")
        e = flat.masked_fill(dropped, self.num_experts)  # dropped entries share one extra bucket
        sorted_e, order = e.sort(stable=True)
        per = torch.bincount(e, minlength=self.num_experts + 1)
        start = per.cumsum(0) - per
        nth = torch.empty_like(e).scatter_(0, order, torch.arange(len(e)) - start[sorted_e])
        cnt = self.logcnt[layer]
        safe = e.clamp(max=self.num_experts - 1)
        replica = (nth + offset).remainder(cnt[safe])
        slot = self.log2phy[layer][safe, replica]
        return slot.masked_fill(dropped, -1).view(experts.shape).to(experts.device)

    def tokens_per_rank(self, slots: torch.Tensor) -> torch.Tensor:
        """How many routed entries go to each rank (the dispatch all-to-all's input splits)."""
        s = slots.reshape(-1)
        return torch.bincount(self.rank_of(s[s >= 0]).cpu(), minlength=self.num_ranks)
