"""Migration-aware EPLB: the ``incremental`` policy, vectorised over layers.

A rebalance of a running model moves every changed slot's expert weights and optimizer state
between GPUs. The other policies plan from scratch and change nearly every slot; this one starts
from the placement in force (``current``) and changes as few slots as the balance gained is
worth, at most ``max_moved`` * R per layer. Two searches plan each layer:

- the **targeted search** (:mod:`.targeted`): swaps that bring each GPU above a target load
  just below it, the cheapest fit first (an expert fetched within its node before one from
  another node), for a few targets near the load of the (budget / 2 + 1)-th hottest GPU;
- the **rounds** below, for the layers the targeted search leaves above the highest of its
  targets (they also add and drop replicas, which a hot expert may need).

Each round, in every layer that can still improve, each of its ``HOT`` most loaded GPUs
``g`` proposes the best of three kinds of move, ranked by balance gained per slot changed:

- **swap** a slot of ``g`` with a slot of another GPU (two slots change, replica counts do not);
- **drop** a replica held by ``g`` (its expert has others), giving the slot to another expert;
- **add** a replica of one of ``g``'s experts on another GPU, in a slot whose expert has others.

A move is proposed only if every GPU whose load it raises ends strictly below ``g``'s load and
``g`` falls, so a layer's sorted GPU loads only fall and its maximum never rises. The gain of a
move is how far it brings the highest of those loads below ``g``'s, estimated conservatively (a
lightly loaded GPU whose share of an expert shrinks is not credited, and neither is the partner
GPU of an add when it also holds the expert losing a replica). The cost of a move is the change in
the number of slots that differ from ``current`` (a move that restores a slot's original expert
costs nothing or less). Partners are the slots of the least loaded GPUs, ``PARTNERS`` of them per
hot GPU and different for each, so the hot GPUs of a round never compete for one. A round keeps
the proposals that share no GPU (including the holders an add or drop raises) and no expert with
a hotter one, within the budget, so each estimate holds. Rounds stop at ``max_moved`` * R changed
slots per layer or when no move gains.

Every step of either search is a candidate: per layer the policy returns the plan that maximises
``balancedness gain - min_gain * moved / R`` (:func:`~.plan_value.plan_values`: balancedness is
mean / max GPU load, in float64, on the plans themselves; ``moved`` counts the slots whose new
expert's rows must come from another GPU, i.e. the bytes moved over the bytes of all slots), the
targeted search's plan on ties. ``current`` itself is a candidate with value 0, so no layer ever ends less
balanced than it was.

Slot rules, as in ``refined``: every expert keeps at least one slot and no GPU holds two replicas
of one expert; ``current`` must already keep them.
"""

from __future__ import annotations

import math

import torch

from .plan_value import SlotPrice, plan_values
from .slots import check_distinct
from .targeted import targeted_plans

#: a move must lower the GPU it relieves by more than this fraction of its load (float32 noise)
EPS = 1e-6

#: GPUs relieved per round in each layer (the most loaded ones), so rounds << moves
HOT = 4

#: each hot GPU's swap and add partners are the slots of this many of the least loaded GPUs
PARTNERS = 2

#: add candidates: the slots of those GPUs that lose least by giving up their replica
ADD_SLOTS = 4

#: default price of a change whose expert crosses nodes, against 1 within a node (see SlotPrice)
INTER_NODE_COST = 2.0


def check_current(current: torch.Tensor | object, layers: int, experts: int, num_replicas: int, num_gpus: int) -> torch.Tensor:
    """``current`` as an int64 [layers, R] placement; ValueError naming what does not fit."""
    try:
        cur = torch.as_tensor(current)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"current must be a [layers, num_replicas] table of integer expert ids: {exc}") from None
    if cur.dtype.is_floating_point or cur.dtype.is_complex or cur.dtype == torch.bool:
        raise ValueError(f"current must hold integer expert ids, got dtype {cur.dtype}")
    cur = cur.to(device="cpu", dtype=torch.int64)
    if tuple(cur.shape) != (layers, num_replicas):
        raise ValueError(f"current must be [layers, num_replicas] = [{layers}, {num_replicas}], got {list(cur.shape)}")
    if bool((cur < 0).any()) or bool((cur >= experts).any()):
        raise ValueError(f"current holds expert ids in [{int(cur.min())}, {int(cur.max())}]; they must lie in [0, {experts})")
    cnt = torch.zeros(layers, experts, dtype=torch.int64).scatter_add_(1, cur, torch.ones_like(cur))
    if bool((cnt == 0).any()):
        layer, expert = (int(i) for i in (cnt == 0).nonzero()[0])
        raise ValueError(f"current gives expert {expert} of layer {layer} no slot; every expert needs one")
    check_distinct(cur, num_gpus, "current")
    return cur


def _round(
    w: torch.Tensor, phy: torch.Tensor, cnt: torch.Tensor, cur: torch.Tensor, num_gpus: int, room: torch.Tensor,
    price: SlotPrice,
):
    """One round of moves for every layer: (accept[A, M], slots[A, M, 2], values[A, M, 2], dec[A, M], inc[A, M]).

    Each of the ``M`` most loaded GPUs of a layer proposes its best move; :func:`_resolve` keeps
    those that do not interact with a hotter proposal and fit ``room`` [A] (changed slots the
    layer may still spend). A single-slot move repeats its slot and value in both columns;
    ``dec`` / ``inc`` lose / gain a replica (equal for a swap). Moves are ranked by gain per
    ``price`` of the slots they change (see :class:`~.plan_value.SlotPrice`); the budget counts slots.

    Partners: the t-th hottest GPU's are ``PARTNERS`` of the least loaded GPUs (the t-th, the
    (t + M)-th, ...), so no two hot GPUs compete for one. For a swap of slot i (expert a) of hot GPU
    g with partner GPU h, the two slots of h whose loads bracket the one that would level g and h
    (the gain is unimodal in it); for an add, the ``ADD_SLOTS`` partner slots that lose least by
    giving up their replica.
    """
    a, r = phy.shape
    e = w.shape[1]
    s = r // num_gpus
    m = max(1, min(HOT, num_gpus // 2))
    k = max(1, min(PARTNERS, (num_gpus - m) // m))  # partner GPUs of each hot GPU
    gpu = torch.arange(r) // s  # [R] GPU of each slot
    x = w / cnt  # load per replica [A, E]
    xs = x.gather(1, phy)  # [A, R]
    load = xs.view(a, num_gpus, s).sum(-1)  # [A, P]
    ls = load[:, gpu]  # [A, R] load of each slot's GPU
    order = load.sort(dim=1, descending=True, stable=True).indices
    hot = order[:, :m]
    # the t-th hottest GPU's partners: the t-th, (t + M)-th, ... least loaded GPUs, so the hot
    # GPUs of a round never compete for one partner
    cold = order[:, num_gpus - m * k:].flip(1).view(a, k, m).transpose(1, 2)  # [A, M, K]
    top = load.gather(1, hot)  # [A, M]
    mine = hot[:, :, None] * s + torch.arange(s)  # [A, M, S] slots of the hot GPUs
    flat_m = mine.view(a, -1)
    ea, xa = phy.gather(1, flat_m).view(a, m, s), xs.gather(1, flat_m).view(a, m, s)
    ch = (phy != cur).float()  # [A, R] slots already changed
    cur_m, ch_m = cur.gather(1, flat_m).view(a, m, s), ch.gather(1, flat_m).view(a, m, s)
    holds = torch.zeros(a, num_gpus * e, dtype=torch.bool).scatter_(1, gpu * e + phy, True)  # [A, P*E]
    on_g = holds.view(a, num_gpus, e).gather(1, hot[:, :, None].expand(a, m, e))  # [A, M, E]
    # what dropping a slot's replica does to the other holders of its expert: the GPUs that are
    # not hot rise by ``rise`` (``others``: the highest of them); the hot GPUs are followed one by
    # one below, so a hot GPU that also loses load in the same move is credited for it
    rise = torch.where(cnt > 1, w / (cnt - 1).clamp(min=1) - x, math.inf)  # [A, E]
    is_hot = torch.zeros(a, num_gpus, dtype=torch.bool).scatter_(1, hot, True)[:, gpu]  # [A, R]
    top_holder = torch.full((a, e), -math.inf).scatter_reduce_(1, phy, ls.masked_fill(is_hot, -math.inf), "amax")
    others = (top_holder + rise).gather(1, phy)  # [A, R] (counts the slot's own GPU too: conservative)
    t_is = torch.eye(m, dtype=torch.bool)  # [M, M'] the hot GPU itself
    multi = (cnt > 1).gather(1, phy)  # [A, R] the slot's expert has another replica
    y = w / (cnt + 1)  # [A, E] load per replica with one more
    ya = y.gather(1, ea.view(a, -1)).view(a, m, s)
    T = top[:, :, None, None]
    rest = (top[:, :, None] - xa)[..., None]  # [A, M, S, 1] g's load without slot i

    def best(gain: torch.Tensor, cost: torch.Tensor, priced: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Best candidate per hot GPU by gain per priced change (free moves first, by gain): (score, index, cost)."""
        ok = (gain > T * EPS) & (cost <= room[:, None, None, None])
        score = torch.where(priced > 0, gain / priced.clamp(min=1e-9), gain + 1e30).masked_fill_(~ok, -math.inf)
        sc, idx = score.flatten(2).max(2)
        return sc, idx, cost.flatten(2).gather(2, idx[..., None]).squeeze(2)

    def pick(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return t.reshape(a, m, -1).gather(2, idx[..., None]).squeeze(2)

    # swap slot i (expert a) of a hot GPU with one of the two slots of a cold GPU h whose loads
    # bracket the one that would level the two GPUs (the gain is unimodal in it)
    cold_x, cold_pos = xs.view(a, num_gpus, s).gather(1, cold.reshape(a, m * k, 1).expand(a, m * k, s)).view(a, m, k, s).sort(dim=3)
    ideal = xa[..., None] - (T - load.gather(1, cold.reshape(a, -1)).view(a, m, 1, k)) / 2  # [A, M, S, K]
    below = (cold_x[:, :, None] < ideal[..., None]).sum(-1)  # [A, M, S, K] slots of h below the ideal
    near = torch.stack([(below - 1).clamp(min=0), below.clamp(max=s - 1)], 4)  # [A, M, S, K, 2]
    pos = cold_pos[:, :, None].expand(a, m, s, k, s).gather(4, near)
    j = (cold[:, :, None, :, None] * s + pos).view(a, -1)  # [A, M*S*K*2]
    b, xb, lj, chj, curj = (t.gather(1, j).view(a, m, s, 2 * k) for t in (phy, xs, ls, ch, cur))
    d = xa[..., None] - xb
    gain = torch.minimum(d, T - lj - d)  # = top - max(top - d, load_h + d)
    twice = holds.gather(1, ((j // s).view(a, m, s, 2 * k) * e + ea[..., None]).view(a, -1)).view(a, m, s, 2 * k)
    twice |= on_g.gather(2, b.view(a, m, -1)).view(a, m, s, 2 * k)
    cost = (b != cur_m[..., None]).float() - ch_m[..., None] + (ea[..., None] != curj).float() - chj
    mine_x = mine[..., None].expand(a, m, s, 2 * k)
    j4 = j.view(a, m, s, 2 * k)
    priced = price.delta(phy, mine_x, b) + price.delta(phy, j4, ea[..., None].expand_as(j4))
    sw = best(gain.masked_fill_(twice, -math.inf), cost, priced)

    # add: a slot of a cold GPU whose expert has other replicas (one of the ADD_SLOTS that lose
    # least by giving it up) becomes a replica of a
    js = (cold[..., None] * s + torch.arange(s)).reshape(a, m * k * s)
    key = torch.maximum((ls - xs).gather(1, js), others.gather(1, js)).masked_fill_(~multi.gather(1, js), math.inf)
    q = min(ADD_SLOTS, k * s)
    jq = js.view(a, m, k * s).gather(2, key.view(a, m, k * s).topk(q, dim=2, largest=False).indices)  # [A, M, Q]
    bq, lq, oq, mq, chq, curq = (t.gather(1, jq.view(a, -1)).view(a, m, 1, q) for t in (phy, ls - xs, others, multi, ch, cur))
    # g sheds a's share x_a - y_a; each other hot GPU t' holding b rises by rise[b], less a's share
    # if it holds a too (hot GPUs holding only a lose load and cannot break the move)
    hb = on_g.gather(2, bq.reshape(a, 1, m * q).expand(a, m, m * q)).view(a, m, m, 1, q)  # [A, M', M, 1, Q]
    ha = on_g.gather(2, ea.reshape(a, 1, m * s).expand(a, m, m * s)).view(a, m, m, s, 1)  # [A, M', M, S, 1]
    hot_new = top.view(a, m, 1, 1, 1) + rise.gather(1, bq.view(a, -1)).view(a, 1, m, 1, q) * hb - (xa - ya).view(a, 1, m, s, 1) * ha
    hot_new = hot_new.masked_fill_(~(hb | t_is.view(1, m, m, 1, 1)), -math.inf).amax(1)  # [A, M, S, Q]
    gain = T - torch.maximum(torch.maximum(hot_new, lq + ya[..., None]), oq)
    twice = holds.gather(1, ((jq // s * e)[:, :, None, :] + ea[..., None]).view(a, -1)).view(a, m, s, q)
    cost = (ea[..., None] != curq).float() - chq
    jq4 = jq[:, :, None, :].expand(a, m, s, q)
    ad = best(gain.masked_fill_(twice | ~mq, -math.inf), cost, price.delta(phy, jq4, ea[..., None].expand_as(jq4)))

    # drop: slot i (a has other replicas) becomes a replica of the expert not on g with the least
    # load per replica, or of the slot's original expert (a restore)
    few = y.topk(min(s + 1, e), dim=1, largest=False)  # g holds s experts: one of these is not on it
    light = few.values[:, None, :].masked_fill(on_g.gather(2, few.indices[:, None, :].expand(a, m, -1)), math.inf).min(2)
    light_f = few.indices.gather(1, light.indices)  # [A, M]
    y_cur = y.gather(1, cur_m.view(a, -1)).view(a, m, s).masked_fill_(on_g.gather(2, cur_m), math.inf)
    y_new = torch.stack([light.values[:, :, None].expand(a, m, s), y_cur], 3)  # [A, M, S, 2]
    f = torch.stack([light_f[:, :, None].expand(a, m, s), cur_m], 3)
    # the other hot GPUs holding a rise by rise[a]
    h_a = ha.view(a, m, m, s)  # [A, M', M, S]
    hot_rise = (top.view(a, m, 1, 1) + rise.gather(1, ea.view(a, -1)).view(a, 1, m, s)).masked_fill_(~h_a | t_is.view(1, m, m, 1), -math.inf)
    worst_other = torch.maximum(others.gather(1, flat_m).view(a, m, s), hot_rise.amax(1))[..., None]
    gain = T - torch.maximum(rest + y_new, worst_other)
    cost = (f != cur_m[..., None]).float() - ch_m[..., None]
    dr = best(gain.masked_fill_(~multi.gather(1, flat_m).view(a, m, s, 1), -math.inf), cost,
              price.delta(phy, mine[..., None].expand_as(f), f))

    # decode the chosen move of each hot GPU: (first slot, its value, second slot, its value,
    # expert losing a replica, expert gaining one); a swap changes no count (dec == inc)
    kind = torch.stack([sw[0], ad[0], dr[0]], 2).max(2)
    i_sw, i_ad, i_dr = sw[1] // (2 * k), ad[1] // q, dr[1] // 2
    j_sw, j_ad = pick(j.view(a, m, -1), sw[1]), pick(jq, ad[1] % q)
    a_sw, a_ad, a_dr = pick(ea, i_sw), pick(ea, i_ad), pick(ea, i_dr)
    f_dr = pick(f, dr[1])
    slot_sw, slot_dr = pick(mine, i_sw), pick(mine, i_dr)
    b_sw, b_ad = phy.gather(1, j_sw), phy.gather(1, j_ad)

    def choose(*options: torch.Tensor) -> torch.Tensor:
        return torch.where(kind.indices == 0, options[0], torch.where(kind.indices == 1, options[1], options[2]))

    s1, v1 = choose(slot_sw, j_ad, slot_dr), choose(b_sw, a_ad, f_dr)
    s2, v2 = choose(j_sw, j_ad, slot_dr), choose(a_sw, a_ad, f_dr)
    dec, inc = choose(a_sw, b_ad, a_dr), choose(a_sw, a_ad, f_dr)
    spent = choose(sw[2], ad[2], dr[2])
    return _resolve(kind.values > -math.inf, hot, gpu, holds.view(a, num_gpus, e), s1, v1, s2, v2, dec, inc, spent, room)


def _resolve(valid, hot, gpu, holds, s1, v1, s2, v2, dec, inc, spent, room):
    """Take each layer's proposed moves hottest first, skipping any that would interact with a
    hotter proposal (a common GPU: a slot's GPU, the hot GPU, or a holder an add / drop raises; or
    a common expert) and any past the layer's budget. Every accepted move's estimate then holds."""
    a, m = valid.shape
    p, e = holds.shape[1], holds.shape[2]
    touched = torch.zeros(a, m, p).scatter_(2, torch.stack([hot, gpu[s1], gpu[s2]], 2), 1.0)
    raised = holds.gather(2, dec[:, None, :].expand(a, p, m)).transpose(1, 2) & (dec != inc)[..., None]
    touched = touched.masked_fill_(raised, 1.0)
    experts = torch.zeros(a, m, e).scatter_(2, torch.stack([dec, inc, v1], 2), 1.0)
    clash = (torch.bmm(touched, touched.transpose(1, 2)) + torch.bmm(experts, experts.transpose(1, 2))) > 0  # [A, M, M]
    earlier = torch.ones(m, m, dtype=torch.bool).tril(-1)  # [t, t']: t' is hotter than t
    accept = valid & ~(clash & earlier & valid[:, None, :]).any(2)
    accept &= (spent * accept).cumsum(1) <= room[:, None]
    return accept, torch.stack([s1, s2], 2), torch.stack([v1, v2], 2), dec, inc


def incremental_plan(
    w: torch.Tensor, current: torch.Tensor, num_gpus: int, max_moved: float, min_gain: float,
    num_nodes: int = 1, inter_node_cost: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(phy2log [L, R], logcnt [L, E]) of the incremental policy for float32 loads ``w`` (see module doc);
    with ``num_nodes`` > 1 a change whose expert must cross nodes costs ``inter_node_cost`` in the
    ranking of moves (:class:`~.plan_value.SlotPrice`)."""
    layers, experts = w.shape
    price = SlotPrice(current, experts, num_gpus, num_nodes, inter_node_cost)
    budget = math.floor(max_moved * current.shape[1] + 1e-9)
    phy, worth, reached = targeted_plans(w, current, num_gpus, budget, min_gain, price)
    # where swaps did not reach even the highest target, the rounds' moves (replicas added and dropped too)
    hard = (~reached).nonzero().flatten()
    if hard.numel():
        plan, value = _rounds(w[hard], current[hard], num_gpus, budget, min_gain, price.rows(hard))
        better = value > worth[hard]
        phy[hard[better]] = plan[better]
    cnt = torch.zeros(layers, experts, dtype=torch.int64).scatter_add_(1, phy, torch.ones_like(phy))
    return phy, cnt


def _rounds(
    w: torch.Tensor, current: torch.Tensor, num_gpus: int, budget: int, min_gain: float, price: SlotPrice,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(phy2log [L, R], worth [L]) of the best round per layer (module doc: each round's placement
    is a candidate; round 0 is ``current``, worth 0)."""
    layers, experts = w.shape
    r = current.shape[1]
    phy = current.clone()
    cnt = torch.zeros(layers, experts, dtype=torch.int64).scatter_add_(1, phy, torch.ones_like(phy))
    snapshots = [phy.clone()]
    active = torch.arange(layers)
    for _ in range(2 * budget + 8 if budget else 0):  # free moves (restoring slots) may add rounds
        sub = phy[active]
        room = budget - (sub != current[active]).sum(1)
        accept, slots, values, dec, inc = _round(w[active], sub, cnt[active], current[active], num_gpus, room, price.rows(active))
        moved = accept.any(1)
        if not bool(moved.any()):
            break
        at = active[:, None].expand_as(accept)[accept]
        phy[at.repeat_interleave(2), slots[accept].flatten()] = values[accept].flatten()
        cnt.index_put_((at, dec[accept]), torch.tensor(-1), accumulate=True)
        cnt.index_put_((at, inc[accept]), torch.tensor(1), accumulate=True)
        active = active[moved]
        snapshots.append(phy.clone())
    # per layer, the round with the best balancedness gain net of min_gain per moved fraction
    k = len(snapshots)
    stack = torch.stack(snapshots)  # [K, L, R]
    value = plan_values(w.repeat(k, 1), stack.view(k * layers, r), current.repeat(k, 1), num_gpus, min_gain).view(k, layers)
    best = value.argmax(0)  # the first maximum: the fewest rounds among equals
    return stack[best, torch.arange(layers)], value[best, torch.arange(layers)]
