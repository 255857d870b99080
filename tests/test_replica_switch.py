"""The balancers' on / off switch (``balancer.stay_off``): the predicted gain of the replicas
against their measured cost, the loads it is computed from, out-of-date replicas refilled from
their first slots, and a run whose replicas go off and on again training exactly as one whose
replicas never go off."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from portapipe.balancing.migration import plan_migration
from portapipe.balancing.placement import ExpertPlacement
from portapipe.balancing.pricing import replica_gain_s
from portapipe.balancing.replica_switch import ReplicaSwitch, first_slot_loads, spread_loads
from portapipe.config import load_config


def test_loads_with_and_without_replicas() -> None:
    # 4 experts on 2 ranks, 3 slots each: rank 0 holds 0, 1, 2; rank 1 holds 3, 0 (copy), 1 (copy)
    p = ExpertPlacement(torch.tensor([[0, 1, 2, 3, 0, 1]]), 2, 4)
    counts = torch.tensor([[40.0, 20.0, 10.0, 10.0]])
    first = first_slot_loads(counts, p.log2phy, 3, 2)
    assert first.tolist() == [[70.0, 10.0]]
    spread = spread_loads(counts, p.log2phy, p.logcnt, 3, 2)
    assert spread.tolist() == [[20.0 + 10.0 + 10.0, 10.0 + 20.0 + 10.0]]


def test_first_slots_are_spread_over_the_ranks() -> None:
    # identity layout of 6 experts in 8 slots on 2 ranks: rank 0 holds 0-3, rank 1 holds 4, 5 and copies of 0, 1
    p = ExpertPlacement.identity(1, 6, 2, 8)
    assert first_slot_loads(torch.ones(1, 6), p.log2phy, 4, 2).tolist() == [[4.0, 2.0]]
    even = p.with_first_slots_balanced()
    assert torch.equal(even.phy2log, p.phy2log) and torch.equal(even.logcnt, p.logcnt)
    assert first_slot_loads(torch.ones(1, 6), even.log2phy, 4, 2).tolist() == [[3.0, 3.0]]
    assert sorted(even.log2phy[0, 0, :2].tolist()) == [0, 6]  # the same replicas, another one first
    # by load: the heavy expert 0 keeps rank 0 for itself, expert 1 goes first to rank 1
    loads = torch.tensor([[10.0, 5.0, 1.0, 1.0, 1.0, 1.0]])
    by_load = p.with_first_slots_balanced(loads)
    assert first_slot_loads(loads, by_load.log2phy, 4, 2).tolist() == [[12.0, 7.0]]


@pytest.mark.parametrize("experts,ep,slots", [(12, 4, 16), (8, 4, 12), (4, 2, 6), (12, 4, 24), (8, 2, 12)])
def test_the_starting_placement_is_even_on_even_loads(experts: int, ep: int, slots: int) -> None:
    p = ExpertPlacement.even(2, experts, ep, slots).with_first_slots_balanced()
    per, even = slots // ep, torch.full((2, ep), experts / ep)
    ones = torch.ones(2, experts)
    assert torch.equal(spread_loads(ones, p.log2phy, p.logcnt, per, ep), even)  # replicas in use
    assert torch.equal(first_slot_loads(ones, p.log2phy, per, ep), even)  # replicas off
    assert all(len(set(r)) == per for r in p.phy2log[0].view(ep, per).tolist())  # an expert at most once per rank
    assert sorted(set(p.phy2log[0].tolist())) == list(range(experts))
    # the identity layout's copies pile onto the last ranks: uneven with replicas in use
    if (experts, ep, slots) == (12, 4, 16):
        i = ExpertPlacement.identity(1, experts, ep, slots)
        assert spread_loads(torch.ones(1, experts), i.log2phy, i.logcnt, per, ep).tolist() == [[2.0, 4.0, 4.0, 2.0]]


def test_switch_decides_from_the_mean_gain_and_cost(caplog: pytest.LogCaptureFixture) -> None:
    sw = ReplicaSwitch(enabled=True, kind="eplb")
    sw.charge(0.004)
    assert sw.figures(0.001) == {"gain_s": 0.001, "cost_s": 0.004, "refresh_s": 0.0}
    assert sw.decide(1, [{"gain_s": 0.001, "cost_s": 0.004}])["replicas_used"] and sw.on  # step 1 only measures
    with caplog.at_level(logging.INFO, logger="portapipe.balancing"):
        sw.decide(2, [{"gain_s": 0.001, "cost_s": 0.004}, {"gain_s": 0.002, "cost_s": 0.004}, None])
    assert not sw.on and "predicted gain 1.500 ms < cost 4.000 ms per step: skipping routing to replicas" in caplog.text
    # while off nothing is charged: the last measured cost is kept
    assert sw.figures(0.0)["cost_s"] == 0.004
    out = sw.decide(3, [{"gain_s": 0.01, "cost_s": 0.004}])
    assert sw.on and out == {"replicas_used": False, "replicas_off_steps": 1, "replica_gain_ms": 10.0, "replica_cost_ms": 4.0}
    never = ReplicaSwitch(enabled=False, kind="lplb")
    never.decide(5, [{"gain_s": 0.0, "cost_s": 1.0}])
    assert never.on


def _timed_layers(seconds: float, rows: int) -> list[Any]:
    """Two MoE layers whose experts computed ``rows`` rows in ``seconds`` between them last step."""
    return [SimpleNamespace(moe=SimpleNamespace(clock=SimpleNamespace(last=(seconds / 2, rows // 2)))) for _ in range(2)]


def test_gain_is_the_busiest_ranks_work_over_the_step() -> None:
    layers = _timed_layers(0.2, 200)  # 1 ms per row
    even = torch.tensor([[40.0, 40.0], [40.0, 40.0]])
    # layer 0 loads rank 0, layer 1 rank 1: each rank computes 80 rows over the step either way,
    # so spreading them saves nothing (per layer it would have looked like 2 x 30 rows)
    crossed = torch.tensor([[70.0, 10.0], [10.0, 70.0]])
    assert replica_gain_s(crossed, even, layers, dp=1) == 0.0
    # both layers load rank 0: it computes 140 rows instead of 80
    same = torch.tensor([[70.0, 10.0], [70.0, 10.0]])
    assert replica_gain_s(same, even, layers, dp=1) == pytest.approx(0.060)
    assert replica_gain_s(same, even, layers, dp=2) == pytest.approx(0.030)  # counts summed over 2 DP replicas
    assert replica_gain_s(same, even, _timed_layers(0.0, 0), dp=1) == 0.0  # nothing measured yet


def test_replicas_off_come_back_only_when_the_gain_pays_for_their_refill() -> None:
    sw = ReplicaSwitch(enabled=True, kind="lplb")
    sw.decide(2, [{"gain_s": 0.001, "cost_s": 0.010, "refresh_s": 0.0}], horizon=4)
    assert not sw.on
    sw.refresh_s = 0.080  # the refill measured when they last came back
    assert sw.figures(0.0)["refresh_s"] == 0.080
    # gain - cost = 10 ms per step pays 40 ms over the 4 steps, not the 80 ms refill
    out = sw.decide(3, [{"gain_s": 0.020, "cost_s": 0.010, "refresh_s": 0.080}], horizon=4)
    assert not sw.on and out["replica_cost_ms"] == pytest.approx(30.0)
    sw.decide(4, [{"gain_s": 0.031, "cost_s": 0.010, "refresh_s": 0.080}], horizon=4)
    assert sw.on
    # once on, the refill is paid: they stay on while the gain beats the cost alone
    sw.decide(5, [{"gain_s": 0.011, "cost_s": 0.010, "refresh_s": 0.080}], horizon=4)
    assert sw.on


def test_stale_replicas_are_refilled_and_never_copied_from() -> None:
    # expert 0 on rank 0 (slot 0, first) and rank 1 (slot 3, a replica gone out of date)
    p = ExpertPlacement(torch.tensor([[0, 1, 2, 0]]), 2, 3)
    fresh = plan_migration(p, p)
    assert fresh.rows_moved == 0
    plan = plan_migration(p, p, stale=frozenset({3}))
    assert plan.rows_moved == 1 and plan.sends == {(0, 1): [0]}  # rank 0 sends its slot 0 to rank 1
    assert plan.source[1] == [("keep", 0), ("recv", 0)]
    # a new placement that puts expert 0 on rank 1 twice takes neither copy from the stale slot
    new = ExpertPlacement(torch.tensor([[0, 1, 0, 2]]), 2, 3)
    assert plan_migration(p, new).source[1] == [("copy", 1), ("copy", 0)]  # slot 2 from the replica in slot 3
    plan = plan_migration(p, new, stale=frozenset({3}))
    assert plan.sends == {(0, 1): [0]} and plan.source[1] == [("recv", 0), ("copy", 0)]


STEPS = 6


def _config(log_dir: Path, stay_off: bool, kind: str = "eplb", zero_stage: int = 0, dp: int = 1) -> dict[str, Any]:
    # eplb: the identity placement replicates experts 0 and 1; lplb: each rank's ring copy. No
    # rebalance in the run (a ZeRO stage shards the optimizer state a rebalance would move).
    balancer = {"kind": kind, "redundant": 1, "interval": 100, "stay_off": stay_off, **({"topology": "ring"} if kind == "lplb" else {})}
    return load_config(
        {
            "backend": "cpu",
            "parallel": {"pp": 1, "ep": 2, "dp": dp},
            "schedule": {"name": "1f1b", "microbatches": 2},
            "model": {"vocab_size": 256, "hidden": 32, "n_layers": 2, "n_dense": 0, "n_heads": 2, "ffn_hidden": 32,
                      "moe_hidden": 32, "n_experts": 4, "top_k": 2, "seq_len": 16, "dtype": "float64"},
            "balancer": balancer,
            "train": {"steps": STEPS, "micro_batch_size": 2, "lr": 1e-2, "min_lr": 1e-2, "warmup_steps": 0, "zero_stage": zero_stage},
            "log": {"dir": str(log_dir), "progress": False},
            "checkpoint": {"every": 0},
        }
    ).to_dict()


def force_replicas_off_for_steps_2_and_3() -> None:
    """In this process, every switch that may turn its replicas off (``stay_off``) does so for steps
    2 and 3 and turns them on again from step 4, whatever the measured times say (the decision's
    figures are still computed and recorded)."""
    from portapipe.balancing import replica_switch

    decide = replica_switch.ReplicaSwitch.decide

    def forced(self: Any, step: int, parts: list[Any], horizon: int = 1) -> dict[str, Any]:
        out = decide(self, step, parts, horizon)
        if self.enabled:
            self.on = step not in (1, 2)
        return out

    replica_switch.ReplicaSwitch.decide = forced  # type: ignore[method-assign]


def _train_both(backend: Any, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from portapipe.train import train_rank

    force_replicas_off_for_steps_2_and_3()
    out = {}
    for name, raw in configs.items():
        train_rank(backend, raw)
        path = Path(raw["log"]["dir"]) / "metrics.jsonl"
        out[name] = [json.loads(line) for line in path.read_text().splitlines() if '"kind": "train"' in line]
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("kind, zero_stage, dp", [("eplb", 0, 1), ("lplb", 1, 1), ("lplb", 0, 2)])
def test_replicas_off_then_on_train_exactly_as_replicas_always_on(tmp_path: Path, kind: str, zero_stage: int, dp: int) -> None:
    """zero_stage 0: the replicas skip their gradient sum while off (at dp 2 their rows are not
    reduced over DP either) and are refilled before they take tokens again. Under ZeRO their
    optimizer rows cannot be refilled, so they are summed while off too: skipping it would leave
    them two steps behind from step 4 on."""
    from portapipe.ranks.launch import run_ranks

    configs = {"switched": _config(tmp_path / "switched", True, kind, zero_stage, dp),
               "always": _config(tmp_path / "always", False, kind, zero_stage, dp)}
    runs = run_ranks(_train_both, 2 * dp, configs, wall_timeout_s=300)[0]
    switched, always = runs["switched"], runs["always"]
    assert [m["balancer"]["replicas_used"] for m in switched] == [True, False, False, True, True, True]
    assert all(m["balancer"]["replicas_used"] for m in always)
    # steps 2-3 routed nothing to replicas; after step 3 (zero_stage 0) the two replicas of each layer were refilled
    assert [m["balancer"]["replica_tokens"] > 0 for m in switched] == [True, False, False, True, True, True]
    refilled = [0, 0, 4, 0, 0, 0] if zero_stage == 0 else [0] * STEPS
    assert [m["balancer"].get("replicas_refreshed_rows", 0) for m in switched] == refilled
    # replicas are exact copies, so only the order of the gradient sums differs: an out-of-date
    # replica (weights and AdamW moments of two steps ago) would change the loss from step 4 on
    for a, b in zip(switched, always):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-12, abs=0)
