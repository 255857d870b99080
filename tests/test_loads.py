"""Load recording and the periodic rebalance: window, interval, min_gain, logging, EP gathering."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from portapipe.balancing.eplb import balancedness
from portapipe.balancing.loads import LoadWindow, Rebalancer
from portapipe.balancing.migration import migrate_parameters
from portapipe.balancing.placement import ExpertPlacement
from portapipe.config import BalancerConfig
from portapipe.ranks.launch import run_ranks


def test_window_keeps_the_last_k_steps() -> None:
    win = LoadWindow(3, num_layers=2, num_experts=4)
    assert torch.equal(win.loads(), torch.zeros(2, 4, dtype=torch.float64))
    for s in range(5):
        win.record(torch.full((2, 4), float(s)))
    assert len(win) == 3
    assert torch.equal(win.loads(), torch.full((2, 4), 2.0 + 3.0 + 4.0, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[layers, experts\] = \[2, 4\], got \(4, 2\)"):
        win.record(torch.ones(4, 2))
    with pytest.raises(ValueError, match="window must be >= 1"):
        LoadWindow(0, 2, 4)


def skewed(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.exp(torch.randn(2, 8, generator=g) * 1.5).mul(100).round()


def test_window_state_round_trip_keeps_the_newest_steps() -> None:
    win = LoadWindow(3, num_layers=2, num_experts=4)
    for s in range(4):
        win.record(torch.full((2, 4), float(s)))
    again = LoadWindow(3, 2, 4)
    again.load_state_dict(win.state_dict())
    assert torch.equal(again.loads(), win.loads())
    again.record(torch.full((2, 4), 9.0))  # the window slides on from the restored steps
    assert torch.equal(again.loads(), torch.full((2, 4), 2.0 + 3.0 + 9.0, dtype=torch.float64))
    shorter = LoadWindow(2, 2, 4)
    shorter.load_state_dict(win.state_dict())
    assert torch.equal(shorter.loads(), torch.full((2, 4), 2.0 + 3.0, dtype=torch.float64))
    empty = LoadWindow(3, 2, 4)
    again.load_state_dict(empty.state_dict())
    assert len(again) == 0
    with pytest.raises(ValueError, match=r"shape \(3, 2, 4\).*\[n, 2, 5\]"):
        LoadWindow(3, 2, 5).load_state_dict(win.state_dict())


def test_rebalances_every_interval_and_logs_before_and_after(caplog: pytest.LogCaptureFixture) -> None:
    reb = Rebalancer(2, 8, num_replicas=12, num_gpus=4, num_groups=4, num_nodes=2, interval=3, window=2, min_gain=0.0)
    start = reb.placement
    assert start.phy2log[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    with caplog.at_level(logging.INFO, logger="portapipe.balancing"):
        events = [reb.step(s, skewed(s)) for s in range(6)]
    assert [e is not None for e in events] == [False, False, True, False, False, True]
    first = events[2]
    assert first is not None and first.applied and first.previous is start
    window = skewed(1).double() + skewed(2).double()  # the last 2 steps before the decision
    assert first.before == pytest.approx(float(balancedness(window, start.phy2log, 4).mean()))
    assert first.after == pytest.approx(float(balancedness(window, first.placement.phy2log, 4).mean()))
    assert first.after > first.before
    assert reb.placement is events[5].placement  # type: ignore[union-attr]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and f"{first.before:.4f} -> {first.after:.4f}" in lines[0] and "rebalanced" in lines[0]


def test_min_gain_skips_small_improvements(caplog: pytest.LogCaptureFixture) -> None:
    reb = Rebalancer(2, 8, num_replicas=12, num_gpus=4, interval=1, window=1, min_gain=0.99)
    start = reb.placement
    with caplog.at_level(logging.INFO, logger="portapipe.balancing"):
        event = reb.step(0, skewed(0))
    assert event is not None and not event.applied and event.gain < 0.99
    assert reb.placement is start and event.placement is start
    assert "kept the current placement" in caplog.records[0].getMessage()
    # the same loads again: the plan in force is already this plan, nothing to do
    reb2 = Rebalancer(2, 8, num_replicas=12, num_gpus=4, interval=1, window=1)
    assert reb2.step(0, skewed(0)).applied  # type: ignore[union-attr]
    assert not reb2.step(1, skewed(0)).applied  # type: ignore[union-attr]


def test_from_config_and_bad_arguments() -> None:
    cfg = BalancerConfig(kind="eplb", interval=5, window=4, min_gain=0.01, redundant=1, nodes=2, policy="hierarchical")
    reb = Rebalancer.from_config(cfg, num_layers=3, num_experts=16, ep=4, model_groups=4)
    assert reb.args == (20, 4, 2, 4) and reb.interval == 5 and reb.window.window == 4 and reb.min_gain == 0.01
    with pytest.raises(ValueError, match="R % P = 18 % 4"):
        Rebalancer(2, 16, num_replicas=18, num_gpus=4)
    with pytest.raises(ValueError, match="min_gain must be >= 0"):
        Rebalancer(2, 16, num_replicas=16, num_gpus=4, min_gain=-1)


# ------------------------------------------------------------------------------ 2 gloo ranks
def _ep_ranks(backend: Any) -> dict[str, Any]:
    """Each rank records only its own router counts; the window holds the EP-group sum."""
    rank = torch.distributed.get_rank()
    reb = Rebalancer(1, 4, num_replicas=6, num_gpus=2, interval=2, window=2)
    start = reb.placement
    # expert weights per local slot: row = the slot's expert id, repeated
    w = torch.nn.Parameter(start.experts_on(rank).double().unsqueeze(1).repeat(1, 3))
    own = [torch.tensor([[2.0, 1.0, 3.0, 30.0]]) * (rank + 1), torch.tensor([[1.0, 2.0, 2.0, 20.0]]) * (rank + 1)]
    events = [reb.step(s, own[s], backend) for s in range(2)]
    event = events[1]
    assert event is not None
    if event.applied:
        migrate_parameters(event.previous, event.placement, {"w": w}, backend)
    return {"window": reb.window.loads(), "phy2log": reb.placement.phy2log, "applied": event.applied,
            "rows": w.detach()[:, 0].tolist(), "mine": reb.placement.experts_on(rank).tolist()}


@pytest.mark.multiproc
def test_loads_gathered_over_the_ep_group_and_every_rank_decides_the_same() -> None:
    a, b = run_ranks(_ep_ranks, 2, pg_timeout_s=30, wall_timeout_s=120)
    total = torch.tensor([[2.0, 1.0, 3.0, 30.0]]) * 3 + torch.tensor([[1.0, 2.0, 2.0, 20.0]]) * 3
    assert torch.equal(a["window"], total.double()) and torch.equal(b["window"], total.double())
    assert a["applied"] and b["applied"] and torch.equal(a["phy2log"], b["phy2log"])
    # the hot expert got a replica on each rank (no rank holds an expert twice), the next one the last spare
    assert ExpertPlacement(a["phy2log"], 2).logcnt[0].tolist() == [1, 1, 2, 2]
    for out in (a, b):
        assert out["rows"] == [float(e) for e in out["mine"]]  # each slot now holds its expert's rows


def test_incremental_replans_with_refined_the_layers_a_published_plan_doubled() -> None:
    # a checkpoint of a run with policy hierarchical, resumed with incremental: layer 0's placement
    # holds expert 0 twice on a GPU, which incremental cannot start from; layer 1's keeps the rule
    from portapipe.balancing.eplb import rebalance_experts
    from portapipe.balancing.slots import duplicated

    w0 = torch.tensor([[1000.0, 1, 1, 1, 1, 1, 1, 1], [9.0, 8, 7, 6, 5, 4, 3, 2]])
    placed = rebalance_experts(w0, 16, 1, 1, 4, policy="hierarchical")
    assert duplicated(placed[0], 4).tolist() == [True, False]
    bal = Rebalancer(2, 8, 16, 4, policy="incremental", placement=ExpertPlacement.from_plan(placed, 4), interval=1,
                     window=1, max_moved=0.25)
    w = torch.tensor([[1.0, 1000, 1, 1, 1, 1, 1, 1], [2.0, 3, 4, 5, 6, 7, 8, 9]], dtype=torch.float64)
    event = bal.step(0, w)
    assert event.policy == "incremental+refined" and event.applied
    refined = rebalance_experts(w, 16, 1, 1, 4, policy="refined")
    incremental = rebalance_experts(w[1:], 16, 1, 1, 4, policy="incremental", current=placed[0][1:], max_moved=0.25)
    assert torch.equal(event.placement.phy2log, torch.cat([refined[0][:1], incremental[0]]))
    assert not duplicated(event.placement.phy2log, 4).any()
    assert bal.step(1, w).policy == "incremental"  # from then on every layer keeps the rule
