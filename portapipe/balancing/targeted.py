"""The incremental policy's targeted search: swaps that bring each hot GPU just below a target.

With a budget of B changed slots per layer, swaps (two slots each) can relieve about B / 2 GPUs,
so the best a layer can end at is near the load of its (B / 2 + 1)-th hottest GPU. This search
aims there directly. For a target load ``tau`` it takes the hottest GPU ``g`` while it is above
``tau`` and swaps one of its slots with a slot of one of the ``COLD`` least loaded GPUs ``h``:

- among the swaps that bring ``g`` to ``tau`` or below and keep ``h`` there (a *fit*), the
  cheapest by :class:`~.plan_value.SlotPrice` (a slot given back its current expert is free,
  an expert fetched within the node costs 1, across nodes ``inter_node_cost``), then the one
  moving the least load (best fit: it leaves the cold GPUs' room for the GPUs still to come);
- with no fit, the swap leaving the higher of the two loads lowest (levelling ``g`` and ``h``),
  if that is below ``g``'s load.

Every swap keeps each expert's replica count and the rule that no GPU holds an expert twice, and
only lowers the hottest GPU, so a layer's maximum never rises. Targets are the loads of the
(B / 2 + o)-th hottest GPU for o in ``OFFSETS`` (each a batch row beside the others), and every
layer keeps, of all its rows and all their steps, the plan of the highest worth
(:func:`~.plan_value.plan_values`); the budget counts slots that differ from ``current``.

Aiming matters because the budget binds: on DeepSeek-V3's shape at 10-15% load drift about 13
GPUs per layer are above 1.01 x the mean and 10% of the slots pay for 14 swaps, so a swap spent
levelling a GPU only part of the way is a GPU left hot. Replica counts never change here; the
rounds of :mod:`.incremental` (which add and drop replicas) plan the layers this search leaves
above the highest of its targets.
"""

from __future__ import annotations

import torch

from .plan_value import SlotPrice, plan_values

#: partner GPUs of each swap: this many of the least loaded
COLD = 6

#: targets: the (budget // 2 + o)-th hottest GPU's load, for each o
OFFSETS = (-2, -1, 0, 1)


def targeted_plans(
    w: torch.Tensor, current: torch.Tensor, num_gpus: int, budget: int, min_gain: float, price: SlotPrice,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(phy2log [L, R], worth [L], reached [L]) of the best plan the targeted search finds per
    layer for loads ``w`` [L, E] from ``current`` [L, R] (see the module doc); worth 0 keeps
    ``current``. ``reached``: the plan's hottest GPU is at most the highest target (swaps did
    what they should)."""
    layers, r = current.shape
    experts = w.shape[1]
    s, p = r // num_gpus, num_gpus
    if p < 2 or budget == 0:  # no swap to make
        return current.clone(), torch.zeros(layers, dtype=torch.float64), torch.ones(layers, dtype=torch.bool)
    cnt = torch.zeros(layers, experts, dtype=torch.int64).scatter_add_(1, current, torch.ones_like(current))
    mean = w.to(torch.float64).sum(1) / p
    # load per replica in units of the layer's mean GPU load; swaps keep every count
    x = (w.to(torch.float64) / cnt.clamp(min=1) / mean.clamp(min=1e-300)[:, None]).to(torch.float32)
    start = x.gather(1, current).view(layers, p, s).sum(-1)  # [L, P]
    ks = sorted({min(max(budget // 2 + o, 0), p - 1) for o in OFFSETS})
    ranked = start.sort(1, descending=True).values
    aim = ranked[:, ks[0]]  # the least of the targets: swaps alone should reach it
    row = torch.arange(layers).repeat_interleave(len(ks))  # the layer of each batch row
    gpu = torch.arange(r) // s
    node_of = price.node[torch.arange(p) * s]  # [P] node of each GPU
    nodes = price.on_node.shape[1] // experts
    stride = p * experts
    held = torch.zeros(layers, stride, dtype=torch.bool).scatter_(1, gpu * experts + current, True).view(-1)  # in current
    bal0 = torch.where(mean > 0, 1.0 / start.max(1).values.to(torch.float64).clamp(min=1e-30), 1.0)
    best, worth = current[row].clone(), torch.zeros(row.numel(), dtype=torch.float64)
    # the live rows' state (rows that stop are dropped): original row, target, layer, placement,
    # slot loads, GPU loads, holdings, changed slots, their prices, moved slots
    orig = torch.arange(row.numel())
    tau = ranked[:, ks].reshape(-1)
    lay = row.clone()
    cur = current[row]
    phy, xs = cur.clone(), x[row].gather(1, cur)
    loads = xs.view(-1, p, s).sum(-1)
    holds = torch.zeros(row.numel(), stride, dtype=torch.bool).scatter_(1, gpu * experts + cur, True)
    ch = torch.zeros_like(cur)  # 1 where a slot differs from current
    paid = torch.zeros(cur.shape)  # each slot's price (SlotPrice.of)
    moved = torch.zeros(row.numel(), dtype=torch.int64)  # changed slots whose rows come from another GPU
    c = min(COLD, p - 1)
    ar = torch.arange(s)
    priced_nodes = price.inter != 1.0
    for _ in range(budget + 8):  # free moves (restoring slots) may add steps
        n = orig.numel()
        if n == 0:
            break
        top, g = loads.max(1)
        room = budget - ch.sum(1)
        cold = loads.topk(c, largest=False).indices  # [n, C]
        mine = g[:, None] * s + ar  # [n, S]
        theirs = (cold[:, :, None] * s + ar).view(n, c * s)  # [n, Q]
        a, xa = phy.gather(1, mine), xs.gather(1, mine)
        b, xb = phy.gather(1, theirs), xs.gather(1, theirs)
        d = xa[:, :, None] - xb[:, None, :]  # [n, S, Q] load g gives h
        new_g, new_h = top[:, None, None] - d, loads.gather(1, theirs // s)[:, None, :] + d
        # no GPU may hold an expert twice: b must not be on g, a not on h
        b_on_g = holds.gather(1, g[:, None] * experts + b)  # [n, Q]
        a_on_h = holds.gather(1, (cold[:, None, :] * experts + a[:, :, None]).view(n, -1)).view(n, s, c)
        ok = (d > 0) & ~b_on_g[:, None, :] & ~a_on_h.repeat_interleave(s, 2)
        ca, cb = cur.gather(1, mine), cur.gather(1, theirs)
        to_g, to_h = b[:, None, :] != ca[:, :, None], a[:, :, None] != cb[:, None, :]  # [n, S, Q] slot differs from current
        if bool((room < 2).any()):  # a swap changes at most two slots
            cost = to_g.to(torch.int64) + to_h - ch.gather(1, mine)[:, :, None] - ch.gather(1, theirs)[:, None, :]
            ok &= cost <= room[:, None, None]
        fits = ok & (torch.maximum(new_g, new_h) <= tau[:, None, None])
        fitted = fits.flatten(1).any(1)
        # with no fit: the swap leaving the higher of the two loads lowest
        key = None if bool(fitted.all()) else torch.maximum(new_g, new_h).masked_fill_(~ok, float("inf"))
        if bool(fitted.any()):
            # a fit: cheapest (SlotPrice: the two slots' new experts' against their old ones'), then the least load moved
            if priced_nodes:
                on = price.on_node[lay]  # [n, nodes * E]
                near_g = on.gather(1, node_of[g][:, None] * experts + b)  # [n, Q]
                near_a = on.gather(1, (torch.arange(nodes)[None, None, :] * experts + a[:, :, None]).view(n, -1)).view(n, s, nodes)
                near_h = near_a.gather(2, node_of[theirs // s][:, None, :].expand_as(d))  # [n, S, Q]
                priced = (to_g * torch.where(near_g, 1.0, price.inter)[:, None, :] + to_h * torch.where(near_h, 1.0, price.inter)
                          - paid.gather(1, mine)[:, :, None] - paid.gather(1, theirs)[:, None, :])
            else:
                priced = to_g.to(torch.float32) + to_h - ch.gather(1, mine)[:, :, None] - ch.gather(1, theirs)[:, None, :]
            fit_key = (priced * 1e3 + d).masked_fill_(~fits, float("inf"))  # d in mean GPU loads: below 1e3
            key = fit_key if key is None else torch.where(fitted[:, None, None], fit_key, key)
        best_key, pick = key.flatten(1).min(1)
        go = torch.isfinite(best_key) & (fitted | (best_key < top)) & (top > tau)
        if not bool(go.all()):  # drop the rows that stop
            keep = go.nonzero().flatten()
            if keep.numel() == 0:
                break
            orig, tau, lay, cur, phy, xs, loads, holds, ch, paid, moved = (
                t[keep] for t in (orig, tau, lay, cur, phy, xs, loads, holds, ch, paid, moved))
            pick, mine, theirs, a, xa, b, xb = (t[keep] for t in (pick, mine, theirs, a, xa, b, xb))
            n = keep.numel()
        m = torch.arange(n)
        i, j = pick // (c * s), pick % (c * s)
        si, sj = mine[m, i], theirs[m, j]
        ea, eb = a[m, i], b[m, j]
        gi, gj = si // s, sj // s
        # moved: a changed slot whose expert was not on its GPU in current (its rows cross GPUs)
        base = lay * stride
        for slot, q, new in ((si, gi, eb), (sj, gj, ea)):
            was = ch[m, slot].bool() & ~held[base + q * experts + phy[m, slot]]
            now = (new != cur[m, slot]) & ~held[base + q * experts + new]
            moved += now.to(torch.int64) - was.to(torch.int64)
        holds[m, gi * experts + ea] = False
        holds[m, gj * experts + eb] = False
        holds[m, gi * experts + eb] = True
        holds[m, gj * experts + ea] = True
        phy[m, si], phy[m, sj] = eb, ea
        xs[m, si], xs[m, sj] = xb[m, j], xa[m, i]
        for slot, q in ((si, gi), (sj, gj)):
            v = phy[m, slot]
            differs = v != cur[m, slot]
            ch[m, slot] = differs.to(torch.int64)
            near = price.on_node[lay, node_of[q] * experts + v]
            paid[m, slot] = torch.where(differs, torch.where(near, 1.0, price.inter), 0.0)
        loads = xs.view(n, p, s).sum(-1)
        value = 1.0 / loads.max(1).values.to(torch.float64).clamp(min=1e-30) - bal0[lay]
        value -= torch.where(moved > 0, min_gain * moved / r, 0.0)
        better = value > worth[orig]
        best[orig[better]], worth[orig[better]] = phy[better], value[better]
    # the best row of each layer (the first on ties: the highest target), its worth recomputed
    k = worth.view(layers, len(ks)).argmax(1)
    plans = best[torch.arange(layers) * len(ks) + k]
    top = x.gather(1, plans).view(layers, p, s).sum(-1).max(1).values
    return plans, plan_values(w, plans, current, num_gpus, min_gain), top <= aim
