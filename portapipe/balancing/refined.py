"""The ``refined`` EPLB policy: near the lower bound, one replica of an expert per GPU.

Global replication (at most one replica of an expert per GPU), the published greedy packing,
swaps that separate any two replicas of one expert the packing put on one GPU (:func:`repair`),
then pairwise swaps between the most loaded GPU and any other until no swap lowers it. Per
layer it keeps whichever of this plan and the published ``hierarchical`` plan has the lower
maximum GPU load (ties keep the hierarchical plan, which keeps groups node-local). Where the
published plan puts two replicas of one expert on a GPU (:mod:`portapipe.balancing.slots`
forbids it), it competes as :func:`repair` leaves it.
"""

from __future__ import annotations

import math

import torch

from .published import balanced_packing, gpu_loads, hierarchical_plan, replicate_experts, uses_hierarchy
from .slots import duplicated

#: pairwise-swap rounds of the refined policy; each round improves every layer's worst GPU or stops
REFINE_ROUNDS = 32


def refine_swaps(item: torch.Tensor, expert: torch.Tensor, num_experts: int, rounds: int = REFINE_ROUNDS) -> torch.Tensor:
    """Lower each row's maximum GPU load by swapping items between the worst GPU and another.

    ``item[B, P, S]`` are the loads of the S slots of each of P GPUs, ``expert`` their experts;
    returns the experts rearranged [B, P, S]. Each round swaps, in every row whose worst GPU can
    improve, the pair that brings the two GPUs' larger load lowest, among pairs that leave no GPU
    with two replicas of one expert. A swap never raises the row's maximum; rows that cannot
    improve drop out of later rounds.
    """
    b, p, s = item.shape
    flat_item, flat_exp = item.reshape(b, p * s).clone(), expert.reshape(b, p * s).clone()
    gpu = torch.arange(p).repeat_interleave(s)
    # holds[row, h * E + e]: GPU h holds expert e; kept up to date swap by swap
    holds = torch.zeros(b, p * num_experts, dtype=torch.bool).scatter_(1, gpu * num_experts + flat_exp, True)
    active = torch.arange(b)
    for _ in range(rounds):
        it, ex = flat_item[active].view(-1, p, s), flat_exp[active]
        n = len(active)
        load = it.sum(-1)  # [A, P]
        top, g = load.max(dim=1)
        mine = it[torch.arange(n), g]  # [A, S]
        mine_e = ex.view(n, p, s)[torch.arange(n), g]
        row = active[:, None]
        h_has = holds[row[:, :, None], (torch.arange(p) * num_experts)[None, None, :] + mine_e[:, :, None]]  # [A, S, P]
        g_has = holds[row, g[:, None] * num_experts + ex]  # [A, P*S]: g holds the item's expert
        # swapping mine[i] for it[h, j] moves d = mine[i] - it[h, j] off g; the pair's larger load
        # becomes max(top - d, load[h] + d) = (top + load[h]) / 2 + |d - (top - load[h]) / 2|.
        # Useless swaps (d <= 0, d >= the gap, or h == g) cost >= top and are never taken.
        half = (top[:, None] - load) / 2
        cost = (mine[:, :, None, None] - (it + half[:, :, None])[:, None]).abs_()
        cost += ((top[:, None] + load) / 2)[:, None, :, None]  # [A, S, P, S]
        cost.masked_fill_(h_has[..., None], math.inf)
        cost = cost.view(n, s, p * s).masked_fill_(g_has[:, None, :], math.inf)
        best, pick = cost.flatten(1).min(dim=1)
        ok = best < top * (1 - 1e-6)  # strict gain beyond float32 noise
        if not bool(ok.any()):
            break
        active, pick = active[ok], pick[ok]
        a = g[ok] * s + pick // (p * s)  # flat position of the item leaving the worst GPU
        c = pick % (p * s)  # flat position of its partner
        ea, ec = flat_exp[active, a], flat_exp[active, c]
        ga, gc = gpu[a] * num_experts, gpu[c] * num_experts
        rows, pos, src = active.repeat(2), torch.cat([a, c]), torch.cat([c, a])
        flat_item[rows, pos] = flat_item[rows, src]
        flat_exp[rows, pos] = flat_exp[rows, src]
        holds[rows, torch.cat([ga + ea, gc + ec])] = False
        holds[rows, torch.cat([gc + ea, ga + ec])] = True
    return flat_exp.view(b, p, s)


def repair(phy2log: torch.Tensor, w: torch.Tensor, cnt: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Rearrange the layers where a GPU holds two replicas of one expert so none does.

    Each round, in every such layer, one extra replica swaps with a slot of a GPU that lacks its
    expert and whose expert the first GPU lacks (the pair with the lowest larger load); a layer
    with no such pair is dealt round-robin (replicas grouped by expert, slot k to GPU k mod P),
    which keeps the rule because no expert has more than P replicas.
    """
    layers, r = phy2log.shape
    e = w.shape[1]
    s = r // num_gpus
    phy = phy2log.clone()
    gpu = torch.arange(r) // s
    for _ in range(r):
        bad = duplicated(phy, num_gpus).nonzero().flatten()
        if not len(bad):
            return phy
        sub, n = phy[bad], len(bad)
        rows = torch.arange(n)
        xs = (w[bad] / cnt[bad]).gather(1, sub)
        load = xs.view(n, num_gpus, s).sum(-1)
        count = torch.zeros(n, num_gpus * e, dtype=torch.int64).scatter_add_(1, gpu * e + sub, torch.ones_like(sub))
        extra = count.gather(1, gpu * e + sub) > 1  # [A, R] slots whose GPU holds their expert twice
        i = extra.long().argmax(1)  # the first such slot
        g, a = gpu[i], sub[rows, i]
        holds = count > 0
        h_has_a = holds.gather(1, gpu * e + a[:, None])  # [A, R]
        g_has_b = holds.view(n, num_gpus, e)[rows, g].gather(1, sub)
        d = xs[rows, i][:, None] - xs
        worse = torch.maximum(load[rows, g][:, None] - d, load[:, gpu] + d)
        worse = worse.masked_fill(h_has_a | g_has_b, math.inf)
        best, j = worse.min(1)
        fixable = best < math.inf
        for k in bad[~fixable].tolist():  # no swap partner: deal the layer round-robin
            order = phy[k].sort(stable=True).values
            phy[k] = order.view(s, num_gpus).t().reshape(-1)
        rows_ok, bad_ok = rows[fixable], bad[fixable]
        ii, jj = i[fixable], j[fixable]
        vi, vj = sub[rows_ok, ii], sub[rows_ok, jj]
        phy[bad_ok, ii], phy[bad_ok, jj] = vj, vi
    return phy


def refined_plan(
    w: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(phy2log, logcnt) of the refined policy for float32 loads ``w[L, E]`` (see the module doc)."""
    layers, experts = w.shape
    spg = num_slots // num_gpus
    slot2e, _, cnt = replicate_experts(w, num_slots, cap=num_gpus)
    pack, rank = balanced_packing((w / cnt).gather(1, slot2e), num_gpus)
    phy = torch.empty_like(slot2e).scatter_(1, pack * spg + rank, slot2e)
    phy = repair(phy, w, cnt, num_gpus)
    item = (w / cnt).gather(1, phy).view(layers, num_gpus, spg)
    phy = refine_swaps(item, phy.view(layers, num_gpus, spg), experts).flatten(1)
    if uses_hierarchy(num_groups, num_nodes):
        base, _, base_cnt = hierarchical_plan(w, num_slots, num_groups, num_nodes, num_gpus)
    else:
        base, _, base_cnt = hierarchical_plan(w, num_slots, 1, 1, num_gpus)
    base = repair(base, w, base_cnt, num_gpus)  # the published plan, made to keep the slot rule
    # compared in float64 on the plans themselves: the alternative must be strictly better
    better = gpu_loads(w, phy, num_gpus, cnt).max(1).values < gpu_loads(w, base, num_gpus, base_cnt).max(1).values
    take = (better | duplicated(base, num_gpus)).unsqueeze(1)  # an expert with > P replicas cannot be separated
    return torch.where(take, phy, base), torch.where(take, cnt, base_cnt)
