"""EPLB equals the published algorithm: its public example, and an independent slow reference.

The reference below is written straight from the algorithm's description (REFERENCE.md, EPLB):
plain Python lists, one layer at a time, float32 rounding emulated after every arithmetic step
(a float64 operation rounded to float32 is exact for + and /), ties to the lowest index.
"""

from __future__ import annotations

import random
import struct

import pytest
import torch

from portapipe.balancing.eplb import balancedness, lower_bound, rebalance_experts




def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def ref_pack(loads: list[float], packs: int) -> tuple[list[int], list[int]]:
    """Items heaviest first into the non-full pack of least total (lowest index on ties)."""
    n = len(loads)
    cap = n // packs
    if cap == 1:
        return list(range(n)), [0] * n
    total, count = [0.0] * packs, [0] * packs
    pack, rank = [0] * n, [0] * n
    for i in sorted(range(n), key=lambda i: -loads[i]):  # sorted() is stable: equal loads by index
        best = min((p for p in range(packs) if count[p] < cap), key=lambda p: total[p])
        pack[i], rank[i] = best, count[best]
        total[best] = f32(total[best] + loads[i])
        count[best] += 1
    return pack, rank


def ref_replicate(loads: list[float], slots: int) -> tuple[list[int], list[int], list[int]]:
    n = len(loads)
    count = [1] * n
    slot2e, rank = list(range(n)), [0] * n
    for _ in range(slots - n):
        per = [f32(loads[e] / count[e]) for e in range(n)]
        e = per.index(max(per))  # first maximum
        slot2e.append(e)
        rank.append(count[e])
        count[e] += 1
    return slot2e, rank, count


def ref_layer(w: list[float], slots: int, groups: int, nodes: int, gpus: int) -> tuple[list[int], list[list[int]], list[int]]:
    """One layer: (phy2log, log2phy as lists of slots in replica order, logcnt)."""
    if groups % nodes:
        groups, nodes = 1, 1
    w = [f32(x) for x in w]
    e_total = len(w)
    size = e_total // groups
    gload = [0.0] * groups
    for g in range(groups):
        for x in w[g * size:(g + 1) * size]:
            gload[g] = f32(gload[g] + x)
    gpack, grank = ref_pack(gload, nodes)
    per_node, slots_per_node = e_total // nodes, slots // nodes
    gpus_per_node, spg = gpus // nodes, slots // gpus
    # node-major order of the logical experts
    node_experts: list[list[int]] = [[] for _ in range(nodes)]
    for node in range(nodes):
        for g in sorted((g for g in range(groups) if gpack[g] == node), key=lambda g: grank[g]):
            node_experts[node].extend(range(g * size, (g + 1) * size))
    phy2log, prank, logcnt = [0] * slots, [0] * slots, [0] * e_total
    for node in range(nodes):
        experts = node_experts[node]
        assert len(experts) == per_node
        loads = [w[e] for e in experts]
        s2e, rank, count = ref_replicate(loads, slots_per_node)
        rloads = [f32(loads[e] / count[e]) for e in s2e]
        pack, pos = ref_pack(rloads, gpus_per_node)
        for q in range(slots_per_node):
            slot = node * slots_per_node + pack[q] * spg + pos[q]
            phy2log[slot] = experts[s2e[q]]
            prank[slot] = rank[q]
        for i, e in enumerate(experts):
            logcnt[e] = count[i]
    log2phy = [[s for _, s in sorted((prank[s], s) for s in range(slots) if phy2log[s] == e)] for e in range(e_total)]
    return phy2log, log2phy, logcnt


def check_against_reference(w: torch.Tensor, r: int, g: int, n: int, p: int, policy: str = "hierarchical") -> None:
    phy2log, log2phy, logcnt = rebalance_experts(w, r, g, n, p, policy=policy)
    layers, experts = w.shape
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    assert log2phy.shape == (layers, experts, r - experts + 1)
    for layer in range(layers):
        rg, rn = (1, 1) if policy == "global" else (g, n)
        ref_p2l, ref_l2p, ref_cnt = ref_layer(w[layer].tolist(), r, rg, rn, p)
        assert phy2log[layer].tolist() == ref_p2l, (layer, r, g, n, p)
        assert logcnt[layer].tolist() == ref_cnt
        for e in range(experts):
            row = [s for s in log2phy[layer, e].tolist() if s >= 0]
            assert log2phy[layer, e, len(row):].eq(-1).all(), "padding must be at the tail"
            assert set(row) == set(ref_l2p[e])
            assert row[0] == ref_l2p[e][0], "the original replica comes first"


def test_public_example() -> None:
    w = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                      [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    phy2log, log2phy, logcnt = rebalance_experts(w, 16, 4, 2, 8)
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                               [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    check_against_reference(w, 16, 4, 2, 8)


SHAPES = [  # (experts, slots, groups, nodes, gpus)
    (12, 16, 4, 2, 8),
    (16, 24, 4, 2, 4),
    (32, 48, 8, 4, 8),
    (24, 24, 6, 3, 6),  # no redundancy: pure placement
    (20, 30, 5, 1, 5),
    (16, 20, 4, 4, 4),
    (18, 24, 3, 2, 4),  # groups % nodes != 0: the global fallback
    (64, 72, 8, 2, 8),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}R{}G{}N{}P{}".format(*s))
def test_equals_reference_on_random_loads(shape: tuple[int, int, int, int, int]) -> None:
    e, r, g, n, p = shape
    rng = random.Random(hash(shape) % 1000)
    for trial in range(6):
        # distinct integer loads (exact in float32) in one batch of layers
        layers = 3
        w = torch.tensor([rng.sample(range(1, 50 * e), e) for _ in range(layers)], dtype=torch.float32)
        check_against_reference(w, r, g, n, p)
        check_against_reference(w, r, g, n, p, policy="global")


def test_equals_reference_with_ties_and_zeros() -> None:
    rng = random.Random(7)
    w = torch.tensor([[rng.choice([0, 0, 3, 5, 5, 8]) for _ in range(16)] for _ in range(4)], dtype=torch.float32)
    check_against_reference(w, 24, 4, 2, 4)
    check_against_reference(torch.zeros(2, 16), 24, 4, 2, 4)


def test_layers_are_independent() -> None:
    """The batched result equals one call per layer: no state leaks between layers."""
    torch.manual_seed(1)
    w = torch.distributions.LogNormal(0.0, 1.0).sample((5, 32))
    for policy in ("hierarchical", "global", "refined"):
        full = rebalance_experts(w, 48, 8, 4, 8, policy=policy)
        for layer in range(5):
            one = rebalance_experts(w[layer:layer + 1], 48, 8, 4, 8, policy=policy)
            for a, b in zip(full, one):
                assert torch.equal(a[layer:layer + 1], b)


def test_plan_invariants() -> None:
    torch.manual_seed(2)
    w = torch.distributions.LogNormal(0.0, 1.5).sample((6, 64))
    for policy in ("hierarchical", "global", "refined"):
        phy2log, log2phy, logcnt = rebalance_experts(w, 96, 8, 2, 16, policy=policy)
        assert (logcnt >= 1).all() and (logcnt.sum(1) == 96).all()
        counted = torch.zeros_like(logcnt).scatter_add_(1, phy2log, torch.ones_like(phy2log))
        assert torch.equal(counted, logcnt)
        for layer in range(6):
            for e in range(64):
                slots = log2phy[layer, e][log2phy[layer, e] >= 0]
                assert len(slots) == logcnt[layer, e]
                assert (phy2log[layer, slots] == e).all()


def test_hierarchical_keeps_groups_on_one_node() -> None:
    torch.manual_seed(3)
    w = torch.rand(4, 32) * 100
    phy2log, _, _ = rebalance_experts(w, 48, 8, 4, 8)
    group = phy2log // 4  # 8 groups of 4 experts
    node = torch.arange(48) // 12  # 4 nodes of 12 slots
    for layer in range(4):
        for g in range(8):
            assert len(set(node[group[layer] == g].tolist())) == 1


def test_balancedness_and_lower_bound_by_hand() -> None:
    # two GPUs of two slots; expert 0 (load 8) has two replicas of 4
    w = torch.tensor([[8.0, 4.0, 2.0]])
    phy2log = torch.tensor([[0, 1, 0, 2]])  # GPU0: 4 + 4 = 8, GPU1: 4 + 2 = 6
    assert balancedness(w, phy2log, 2).item() == pytest.approx(7 / 8)
    # lower bound: max(total / P = 7, best max load per replica with 4 slots = 4)
    assert lower_bound(w, 4, 2).item() == pytest.approx(7.0)
    # one hot expert and no spare slot: the replica bound dominates
    assert lower_bound(torch.tensor([[30.0, 1.0, 1.0, 1.0]]), 4, 4).item() == pytest.approx(30.0)
    # with spares the hot expert splits as far as the slots allow: 30 / 3 = 10 > 33 / 4
    assert lower_bound(torch.tensor([[30.0, 1.0, 1.0, 1.0]]), 6, 2).item() == pytest.approx(16.5)
    assert lower_bound(torch.tensor([[30.0, 1.0, 1.0, 1.0]]), 8, 8).item() == pytest.approx(30 / 5)
    assert balancedness(torch.zeros(1, 3), torch.tensor([[0, 1, 2, 0]]), 2).item() == 1.0


def test_lower_bound_holds_for_every_policy() -> None:
    torch.manual_seed(4)
    w = torch.distributions.LogNormal(0.0, 2.0).sample((8, 32))
    lb = lower_bound(w, 40, 8)
    for policy in ("hierarchical", "global", "refined"):
        phy2log, _, logcnt = rebalance_experts(w, 40, 4, 2, 8, policy=policy)
        from portapipe.balancing.eplb import gpu_loads

        assert (gpu_loads(w, phy2log, 8, logcnt).max(1).values >= lb * (1 - 1e-9)).all()


@pytest.mark.parametrize(
    "args, words",
    [
        ((torch.ones(2, 12), 10, 4, 2, 2), ["R=10", "E=12"]),
        ((torch.ones(2, 12), 16, 4, 2, 6), ["num_replicas", "num_gpus", "16 % 6"]),
        ((torch.ones(2, 12), 16, 5, 5, 8), ["E % num_groups", "12 % 5"]),
        ((torch.ones(2, 8), 16, 3, 2, 8), ["E % num_groups", "8 % 3"]),  # whatever the node count
        ((torch.ones(2, 8), 16, 4, 3, 8), ["P % num_nodes", "8 % 3"]),  # even where the hierarchy falls back
        ((torch.ones(2, 12), 18, 4, 2, 3), ["P % num_nodes", "3 % 2"]),
        ((torch.ones(12), 16, 4, 2, 8), ["2-D"]),
        ((torch.ones(2, 12), 16, 0, 2, 8), ["num_groups", "0"]),
    ],
)
def test_bad_shapes_name_rule_and_numbers(args: tuple, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        rebalance_experts(*args)
    for word in words:
        assert word in str(info.value)


def test_bad_loads_name_position_and_value() -> None:
    w = torch.ones(2, 12)
    w[1, 5] = -3.0
    with pytest.raises(ValueError, match=r"negative.*layer 1 expert 5 \(-3.0\)"):
        rebalance_experts(w, 16, 4, 2, 8)
    w[1, 5] = float("nan")
    with pytest.raises(ValueError, match=r"NaN.*layer 1 expert 5"):
        rebalance_experts(w, 16, 4, 2, 8)
    w[1, 5] = float("inf")
    with pytest.raises(ValueError, match=r"infinite.*layer 1 expert 5"):
        rebalance_experts(w, 16, 4, 2, 8)
    with pytest.raises(ValueError, match="policy must be one of hierarchical, global, refined"):
        rebalance_experts(torch.ones(2, 12), 16, 4, 2, 8, policy="best")


def test_groups_not_divisible_by_nodes_falls_back_to_global() -> None:
    torch.manual_seed(5)
    w = torch.rand(3, 18) * 50
    a = rebalance_experts(w, 24, 3, 2, 4)
    b = rebalance_experts(w, 24, 3, 2, 4, policy="global")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_global_policy_ignores_group_and_node_rules() -> None:
    w = torch.arange(1, 25, dtype=torch.float32).view(2, 12)
    with pytest.raises(ValueError, match="12 % 5"):
        rebalance_experts(w, 16, 5, 5, 8)
    a = rebalance_experts(w, 16, 5, 5, 8, policy="global")
    b = rebalance_experts(w, 16, 1, 1, 8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
