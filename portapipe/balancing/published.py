"""The published EPLB algorithm's building blocks, vectorised over layers.

Validation, balanced packing, greedy replication and the hierarchical policy (``global`` is the
same with one group and one node). Tie rules (deterministic): items of equal load are taken in
index order; a pack tie goes to the lowest pack index; a replica tie goes to the lowest expert
index. Loads are taken as float32 and every sum and quotient is formed in float32 in a fixed
order, so results are reproducible bit for bit. Only loops over items within a layer remain;
layers (and nodes) are batch dimensions.
"""

from __future__ import annotations

import math

import torch


# ---------------------------------------------------------------------------- validation
def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_weight(weight: torch.Tensor | object) -> torch.Tensor:
    """``weight`` as a float32 [layers, experts] tensor; ValueError for NaN, inf or negative loads."""
    w = torch.as_tensor(weight)
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [layers, experts], got shape {tuple(w.shape)}")
    if w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"weight must have at least one layer and one expert, got shape {tuple(w.shape)}")
    w = w.detach().to(device="cpu", dtype=torch.float32)
    for bad, what in ((torch.isnan(w), "NaN"), (torch.isinf(w), "infinite"), (w < 0, "negative")):
        if bool(bad.any()):
            layer, expert = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"expert loads must be finite and >= 0: {int(bad.sum())} {what} value(s), first at "
                f"layer {layer} expert {expert} ({float(w[layer, expert])})"
            )
    return w


def uses_hierarchy(num_groups: int, num_nodes: int) -> bool:
    """The published rule: hierarchical when groups divide evenly over nodes, else global."""
    return num_groups % num_nodes == 0


def check_shape(num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, hierarchy: bool = True) -> None:
    """ValueError naming the rule and the numbers when a plan of this shape cannot exist.

    One rule whatever the node count: groups must divide the experts and nodes the GPUs
    (``hierarchy=False``, the global policy, which has one group and one node, skips both).
    Whether the hierarchy is then used is :func:`uses_hierarchy`'s published rule.
    """
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        _check_positive(name, value)
    if num_replicas < num_experts:
        raise ValueError(f"need at least one slot per expert: num_replicas R={num_replicas} < experts E={num_experts}")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas must be a multiple of num_gpus: R % P = {num_replicas} % {num_gpus} = {num_replicas % num_gpus}")
    if hierarchy:
        if num_experts % num_groups:
            raise ValueError(f"experts must split into equal groups: E % num_groups = {num_experts} % {num_groups} = {num_experts % num_groups}")
        if num_gpus % num_nodes:
            raise ValueError(f"GPUs must split evenly over nodes: P % num_nodes = {num_gpus} % {num_nodes} = {num_gpus % num_nodes}")


# ---------------------------------------------------------------------------- building blocks
def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of a batch of permutations."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm))
    return inv


def balanced_packing(w: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each row's n items into ``num_packs`` packs of exactly n / num_packs items.

    Items go in descending load order to the non-full pack with the smallest total (lowest index
    on ties). Returns ``(pack[B, n], rank_in_pack[B, n])``; rank = items the pack held before.
    """
    b, n = w.shape
    cap = n // num_packs
    if cap == 1:
        return torch.arange(n).expand(b, n).clone(), torch.zeros(b, n, dtype=torch.int64)
    order = w.sort(dim=1, descending=True, stable=True).indices
    cols = w.gather(1, order).unsqueeze(-1).unbind(1)  # each [B, 1], in packing order
    key = torch.zeros(b, num_packs, dtype=w.dtype)  # pack totals; +inf once a pack is full
    cnt = torch.zeros(b, num_packs, dtype=torch.int64)
    one = torch.ones(b, 1, dtype=torch.int64)
    chosen = []
    for col in cols:
        p = key.argmin(dim=1, keepdim=True)  # argmin returns the first minimum: lowest index wins ties
        key.scatter_add_(1, p, col)
        cnt.scatter_add_(1, p, one)
        key.masked_fill_(cnt == cap, math.inf)
        chosen.append(p)
    packs = torch.cat(chosen, dim=1)  # [B, n] pack of the j-th heaviest item
    # rank in pack = earlier items (in packing order) in the same pack; every pack holds exactly
    # cap items, so after a stable sort by pack the item at position q has rank q % cap
    by_pack = packs.sort(dim=1, stable=True).indices
    ranks = torch.empty_like(packs).scatter_(1, by_pack, (torch.arange(n) % cap).expand(b, n))
    pack_of = torch.empty_like(packs).scatter_(1, order, packs)
    rank_of = torch.empty_like(ranks).scatter_(1, order, ranks)
    return pack_of, rank_of


def replicate_experts(w: torch.Tensor, num_slots: int, cap: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give each row's n experts ``num_slots`` replicas in total, one each plus the extras.

    Each extra slot goes to the expert with the largest load per replica (lowest index on ties)
    among those with fewer than ``cap`` replicas (no cap: the published rule). Returns
    ``(slot2expert[B, num_slots], replica_rank[B, num_slots], count[B, n])``; slots 0..n-1 hold
    the originals (rank 0), slot n+i the i-th extra replica. The greedy minimises the largest
    load per replica, within the cap too.
    """
    b, n = w.shape
    if cap is not None and cap * n < num_slots:
        raise ValueError(f"{num_slots} slots cannot be filled by {n} experts of at most {cap} replicas each")
    if cap is not None:  # the capped greedy differs from the published one only once an expert passes the cap
        uncapped = replicate_experts(w, num_slots)
        if int(uncapped[2].max()) <= cap:
            return uncapped
    count = torch.ones(b, n, dtype=torch.int64)
    one = torch.ones(b, 1, dtype=torch.int64)
    picks, ranks = [torch.arange(n).expand(b, n)], [torch.zeros(b, n, dtype=torch.int64)]
    for _ in range(num_slots - n):
        per = w / count
        if cap is not None:  # -1 ranks below every load (>= 0): capped experts get nothing more
            per = per.masked_fill(count >= cap, -1.0)
        e = per.argmax(dim=1, keepdim=True)  # argmax returns the first maximum
        picks.append(e)
        ranks.append(count.gather(1, e))
        count.scatter_add_(1, e, one)
    return torch.cat(picks, dim=1), torch.cat(ranks, dim=1), count


def hierarchical_plan(
    w: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(phy2log, replica rank, logcnt) of the hierarchical policy for float32 loads ``w[L, E]``
    (``num_groups = num_nodes = 1``: the global policy)."""
    layers, experts = w.shape
    group_size = experts // num_groups
    groups_per_node = num_groups // num_nodes
    per_node = experts // num_nodes
    slots_per_node = num_slots // num_nodes
    slots_per_gpu = num_slots // num_gpus

    # (1) groups onto nodes; renumber experts node-major ("mlog": node, group rank, position)
    group_load = w.view(layers, num_groups, group_size).sum(-1)
    gpack, grank = balanced_packing(group_load, num_nodes)
    log2mlog = (((gpack * groups_per_node + grank) * group_size).unsqueeze(-1) + torch.arange(group_size)).flatten(1)
    mlog2log = _inverse(log2mlog)

    # (2) replicate inside each node: rows are (layer, node)
    node_load = w.gather(1, mlog2log).view(layers * num_nodes, per_node)
    phy2mlog, phyrank, mlogcnt = replicate_experts(node_load, slots_per_node)

    # (3) each node's replicas onto its GPUs, by load per replica
    replica_load = (node_load / mlogcnt).gather(1, phy2mlog)
    pack, rank = balanced_packing(replica_load, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * slots_per_gpu + rank)

    # (4) compose back to logical expert ids, slot = node-major physical position
    pphy2mlog = phy2mlog.gather(1, pphy2phy).view(layers, num_nodes, slots_per_node)
    pphy2mlog = (pphy2mlog + (torch.arange(num_nodes) * per_node).view(1, -1, 1)).flatten(1)
    phy2log = mlog2log.gather(1, pphy2mlog)
    replica_rank = phyrank.gather(1, pphy2phy).view(layers, num_slots)
    logcnt = mlogcnt.view(layers, experts).gather(1, log2mlog)
    return phy2log, replica_rank, logcnt


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int, logcnt: torch.Tensor | None = None) -> torch.Tensor:
    """Per-GPU load [L, P] of a plan, each expert's load spread evenly over its replicas (float64)."""
    w = torch.as_tensor(weight).to(torch.float64)
    if logcnt is None:
        logcnt = torch.zeros_like(w, dtype=torch.int64).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    per_replica = w / logcnt.clamp(min=1)
    return per_replica.gather(1, phy2log).view(w.shape[0], num_gpus, -1).sum(-1)
