"""The replica gradient sum between the holders of each expert (balancing/replica_sum.py): every
holder of a replicated expert ends with the same total, bit for bit, which is the sum over all
of the expert's replicas on every rank; unreplicated slots are untouched; a rank sends each of its
replicated experts only to the other ranks holding it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from portapipe.balancing.replica_sum import exchange_pays, holder_plan, sum_over_holders

EP = 4
# [slots] per layer, 4 slots per rank. Layer 0: expert 0 on ranks 0, 1, 2 (twice on rank 1),
# expert 5 on ranks 1 and 3, expert 9 twice on rank 3 only. Layer 1: 14 experts, copies of
# experts 0 and 1 on rank 3.
LAYOUTS = [
    [0, 1, 2, 3, 0, 0, 5, 4, 0, 6, 7, 8, 5, 9, 9, 10],
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0, 1],
]
WIDTHS = (6, 10)  # two tensors per layer of different row lengths, as gate_up and down


def _full_rows(layer: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Every slot's gradient rows, the same on every rank; magnitudes far apart, so a different
    order of addition gives a different float32 result."""
    g = torch.Generator().manual_seed(100 * layer + width)
    scale = 10.0 ** torch.randint(-4, 5, (len(LAYOUTS[layer]), width), generator=g)
    return (torch.randn(len(LAYOUTS[layer]), width, generator=g, dtype=torch.float64) * scale).to(dtype)


def _exchange(backend: Any, how: str) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    per = len(LAYOUTS[0]) // EP
    jobs = []
    for layer, layout in enumerate(LAYOUTS):
        plan = holder_plan(torch.tensor(layout), EP, rank)
        for width in WIDTHS:
            jobs.append((_full_rows(layer, width, torch.float32)[rank * per:(rank + 1) * per].clone(), plan))
    sent = sum_over_holders(jobs, backend, None, EP, rank, how)
    return {"rows": [rows for rows, _ in jobs], "sent": sent}


def _both(backend: Any) -> dict[str, Any]:
    return {how: _exchange(backend, how) for how in ("exchange", "all_reduce")}


@pytest.fixture(scope="module")
def both() -> list[dict[str, Any]]:
    from portapipe.ranks.launch import run_ranks

    return run_ranks(_both, EP, wall_timeout_s=120)


@pytest.mark.parametrize("how", ["exchange", "all_reduce"])
def test_every_holder_ends_with_the_same_total_of_all_replicas(both: list[dict[str, Any]], how: str) -> None:
    exchanged = [r[how] for r in both]
    j = 0
    for layer, layout in enumerate(LAYOUTS):
        p2l = torch.tensor(layout)
        for width in WIDTHS:
            got = torch.cat([r["rows"][j] for r in exchanged])  # [slots, width] in slot order
            before = _full_rows(layer, width, torch.float32)
            j += 1
            for expert in p2l.unique().tolist():
                slots = (p2l == expert).nonzero().flatten()
                if len(slots) == 1:
                    assert torch.equal(got[slots], before[slots])  # untouched
                    continue
                bits = got[slots].view(torch.int32)
                assert (bits == bits[0]).all(), f"layer {layer}: holders of expert {expert} differ"
                exact = before[slots].to(torch.float64).sum(0)
                torch.testing.assert_close(got[slots[0]].to(torch.float64), exact, rtol=1e-6, atol=1e-3)


def test_each_expert_goes_only_to_its_other_holders(both: list[dict[str, Any]]) -> None:
    # layer 0: rank 0 holds expert 0 (other holders 1, 2); rank 1 holds 0 (0, 2) and 5 (3);
    # rank 2 holds 0 (0, 1); rank 3 holds 5 (1) and 9 only itself. Layer 1: experts 0 and 1 on ranks 0 and 3.
    parts = {0: [2, 2], 1: [3, 0], 2: [2, 0], 3: [1, 2]}  # [layer 0, layer 1] parts sent per rank
    for rank, r in enumerate(both):
        assert r["exchange"]["sent"] == sum(parts[rank]) * sum(WIDTHS) * 4
        # the all-reduce path: a row for each of the 3 + 2 replicated experts, 2 (ep - 1) / ep of them sent
        assert r["all_reduce"]["sent"] == int((3 + 2) * sum(WIDTHS) * 4 * 2 * (EP - 1) / EP)
    plan = holder_plan(torch.tensor(LAYOUTS[0]), EP, 1)
    assert plan.slots.tolist() == [0, 1, 2] and plan.pos.tolist() == [0, 0, 1]
    assert {k: v.tolist() for k, v in plan.shared.items()} == {0: [0], 2: [0], 3: [1]}
    alone = holder_plan(torch.tensor([0, 0, 1, 2]), 2, 0)  # replicas on one rank: summed locally
    assert not alone.exchange and alone.shared == {} and alone.slots.tolist() == [0, 1]


def test_the_exchange_is_taken_when_it_sends_enough_fewer_bytes() -> None:
    rows = torch.zeros(4, 8)
    # one copy per rank of the next rank's expert (EPLB, redundant 1): 2 parts sent per rank against 6 all-reduced
    spread = holder_plan(torch.tensor([0, 1, 2, 3, 3, 4, 5, 6, 6, 7, 8, 9, 9, 10, 11, 0]), 4, 0)
    assert spread.most_sent == 2 and spread.replicated == 4 and exchange_pays([(rows, spread)], 4)
    # every replicated expert on 3 of 4 ranks: as many parts as the all-reduce, which is faster per byte
    wide = holder_plan(torch.tensor([0, 1, 2, 3, 3, 4, 5, 0, 6, 7, 0, 3, 8, 9, 3, 6]), 4, 0)
    assert wide.most_sent >= 3 and not exchange_pays([(rows, wide)], 4)
    with pytest.raises(ValueError, match="how: 'ring'"):
        sum_over_holders([(rows, spread)], None, None, 4, 0, how="ring")


def test_mixed_dtypes_are_refused() -> None:
    plan = holder_plan(torch.tensor([0, 0, 1, 2]), 2, 0)
    with pytest.raises(TypeError, match="different dtypes"):
        sum_over_holders([(torch.zeros(2, 3), plan), (torch.zeros(2, 3, dtype=torch.float64), plan)], None, None, 2, 0)


def test_one_rank_sums_its_own_replicas() -> None:
    plan = holder_plan(torch.tensor([0, 1, 0, 2]), 1, 0)
    rows = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    assert sum_over_holders([(rows, plan)], None, None, 1, 0) == 0
    assert rows.flatten().tolist() == [4.0, 2.0, 4.0, 4.0]
