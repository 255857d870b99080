"""Static expert replication and placement (EPLB), vectorised over layers.

``rebalance_experts(weight[L, E], R, groups, nodes, gpus)`` decides how many replicas each
logical expert gets and which of the ``R`` physical slots (``R / gpus`` per GPU) holds which
expert, for every layer at once. Three policies:

- ``"hierarchical"`` (default, the published semantics): pack expert groups onto nodes, replicate
  inside each node, pack each node's replicas onto its GPUs. Falls back to ``"global"`` when the
  group count is not a multiple of the node count, as the published algorithm does.
- ``"global"``: the same steps with one group and one node.
- ``"refined"``: the global replication plus greedy packing improved by pairwise swaps between the
  most loaded GPU and any other; per layer it keeps whichever of this and ``"hierarchical"`` has
  the lower maximum GPU load (ties keep the hierarchical plan, which keeps groups node-local), so
  it is never worse than the published policy on any layer.

Tie rules (deterministic): items of equal load are taken in index order; a pack tie goes to the
lowest pack index; a replica tie goes to the lowest expert index. Loads are taken as float32 and
every sum and quotient is formed in float32 in a fixed order, so results are reproducible bit for
bit. Only loops over items within a layer remain; layers (and nodes) are batch dimensions.
"""

from __future__ import annotations

import math

import torch

POLICIES = ("hierarchical", "global", "refined")

#: pairwise-swap rounds of the refined policy; each round improves every layer's worst GPU or stops
REFINE_ROUNDS = 48


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

    Group and node rules apply only where the hierarchy is used (``hierarchy`` and
    num_groups % num_nodes == 0); the global policy needs only the slot rules.
    """
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        _check_positive(name, value)
    if num_replicas < num_experts:
        raise ValueError(f"need at least one slot per expert: num_replicas R={num_replicas} < experts E={num_experts}")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas must be a multiple of num_gpus: R % P = {num_replicas} % {num_gpus} = {num_replicas % num_gpus}")
    if hierarchy and uses_hierarchy(num_groups, num_nodes):
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


def replicate_experts(w: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give each row's n experts ``num_slots`` replicas in total, one each plus the extras.

    Each extra slot goes to the expert with the largest load per replica (lowest index on ties).
    Returns ``(slot2expert[B, num_slots], replica_rank[B, num_slots], count[B, n])``; slots
    0..n-1 hold the originals (rank 0), slot n+i the i-th extra replica.
    """
    b, n = w.shape
    count = torch.ones(b, n, dtype=torch.int64)
    one = torch.ones(b, 1, dtype=torch.int64)
    picks, ranks = [torch.arange(n).expand(b, n)], [torch.zeros(b, n, dtype=torch.int64)]
    for _ in range(num_slots - n):
        e = (w / count).argmax(dim=1, keepdim=True)  # argmax returns the first maximum
        picks.append(e)
        ranks.append(count.gather(1, e))
        count.scatter_add_(1, e, one)
    return torch.cat(picks, dim=1), torch.cat(ranks, dim=1), count


def _hierarchical(
    w: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(phy2log, replica rank, logcnt) of the hierarchical policy for float32 loads ``w[L, E]``."""
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


def _refine_swaps(item: torch.Tensor, slot: torch.Tensor, rounds: int | None = None) -> torch.Tensor:
    """Lower each row's maximum GPU load by swapping items between the worst GPU and another.

    ``item[B, P, S]`` are the loads of the S slots of each of P GPUs, ``slot`` the same-shaped
    slot ids (whatever a slot stands for); returns ``slot`` rearranged. Each round swaps, in every
    row whose worst GPU can improve, the pair of items that brings the two GPUs' larger load
    lowest. A swap never raises the row's maximum, so rounds can only help; rows that cannot
    improve drop out of later rounds.
    """
    b, p, s = item.shape
    flat_item, flat_slot = item.reshape(b, p * s).clone(), slot.reshape(b, p * s).clone()
    active = torch.arange(b)
    for _ in range(REFINE_ROUNDS if rounds is None else rounds):
        it = flat_item[active].view(-1, p, s)
        load = it.sum(-1)  # [A, P]
        top, g = load.max(dim=1)
        mine = it[torch.arange(len(active)), g]  # [A, S]
        # swapping mine[i] for it[h, j] moves d = mine[i] - it[h, j] off g; the pair's larger load
        # becomes max(top - d, load[h] + d) = (top + load[h]) / 2 + |d - (top - load[h]) / 2|.
        # Useless swaps (d <= 0, d >= the gap, or h == g) cost >= top and are never taken.
        half = (top[:, None] - load) / 2
        cost = (mine[:, :, None, None] - (it + half[:, :, None])[:, None]).abs_()
        cost += ((top[:, None] + load) / 2)[:, None, :, None]  # [A, S, P, S]
        best, pick = cost.flatten(1).min(dim=1)
        ok = best < top * (1 - 1e-6)  # strict gain beyond float32 noise
        if not bool(ok.any()):
            break
        active, pick = active[ok], pick[ok]
        a = g[ok] * s + pick // (p * s)  # flat position of the item leaving the worst GPU
        c = pick % (p * s)  # flat position of its partner
        rows, pos, src = active.repeat(2), torch.cat([a, c]), torch.cat([c, a])
        flat_item[rows, pos] = flat_item[rows, src]
        flat_slot[rows, pos] = flat_slot[rows, src]
    return flat_slot.view(b, p, s)
    return slot


def _refined(
    w: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per layer, the published plan or the swap-refined global plan, whichever has the lower max GPU load."""
    layers = w.shape[0]
    spg = num_slots // num_gpus
    flat = _hierarchical(w, num_slots, 1, 1, num_gpus)  # the global policy
    base = _hierarchical(w, num_slots, num_groups, num_nodes, num_gpus) if uses_hierarchy(num_groups, num_nodes) else flat
    phy2log, rank, cnt = flat
    item = (w / cnt).gather(1, phy2log).view(layers, num_gpus, spg)
    order = _refine_swaps(item, torch.arange(num_slots).expand(layers, num_slots).reshape(layers, num_gpus, spg)).flatten(1)
    alt = (phy2log.gather(1, order), rank.gather(1, order), cnt)
    # compared in float64 on the plans themselves: the alternative must be strictly better
    better = gpu_loads(w, alt[0], num_gpus, alt[2]).max(1).values < gpu_loads(w, base[0], num_gpus, base[2]).max(1).values
    take = better.unsqueeze(1)
    return tuple(torch.where(take, y, x) for x, y in zip(base, alt))  # type: ignore[return-value]


# ---------------------------------------------------------------------------- public API
def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    policy: str = "hierarchical",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replicate and place experts for every layer.

    Args:
        weight: [L, E] load of each logical expert (token counts), any real dtype, >= 0.
        num_replicas: physical slots R (a multiple of ``num_gpus``, >= E).
        num_groups: expert groups of the model's group-limited routing.
        num_nodes: nodes the GPUs span (locality unit of the hierarchical policy).
        num_gpus: GPUs P; slot p lives on GPU p // (R / P).
        policy: "hierarchical" (published; global when num_groups % num_nodes != 0), "global",
            or "refined" (never a larger maximum GPU load than "hierarchical", layer by layer).

    Returns:
        phy2log [L, R] int64: logical expert in each slot.
        log2phy [L, E, R - E + 1] int64: slots of each expert's replicas, original first, -1 padded.
        logcnt [L, E] int64: replicas per expert (>= 1; rows sum to R).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    w = check_weight(weight)
    layers, experts = w.shape
    check_shape(experts, num_replicas, num_groups, num_nodes, num_gpus, hierarchy=policy != "global")
    if policy == "refined":
        phy2log, rank, logcnt = _refined(w, num_replicas, num_groups, num_nodes, num_gpus)
    elif policy == "hierarchical" and uses_hierarchy(num_groups, num_nodes):
        phy2log, rank, logcnt = _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, rank, logcnt = _hierarchical(w, num_replicas, 1, 1, num_gpus)
    width = num_replicas - experts + 1
    log2phy = torch.full((layers, experts * width), -1, dtype=torch.int64)
    log2phy.scatter_(1, phy2log * width + rank, torch.arange(num_replicas).expand(layers, num_replicas))
    return phy2log, log2phy.view(layers, experts, width), logcnt


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
