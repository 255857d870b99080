"""benchmarks/balance_e2e.py's summary of a variant's steps (its runs are too slow for the suite:
the figures in docs/balancers-in-training.md come from the script itself)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from balance_e2e import summarise, variant_config  # noqa: E402


def _step(step_s: float, wait: float, bal: float, balancer: dict) -> dict:
    return {"step_s": step_s, "after_step_s": 0.01, "ep_wait_frac": wait, "rank_balancedness": bal, "balancer": balancer}


def test_summary_takes_medians_after_warmup_and_migrations_over_every_step() -> None:
    moved = {"rebalance": {"bytes_moved": 100, "applied": True}, "lp_ran": True, "lp_cost_ms": 9.0}
    steps = [_step(9.0, 0.5, 0.5, moved)] + [
        _step(s, w, 0.9, {"lp_ran": ran, "lp_cost_ms": 2.0}) for s, w, ran in ((1.0, 0.1, True), (3.0, 0.3, False), (2.0, 0.2, True))
    ]
    out = summarise(steps, warmup=1)
    assert out["step_s"] == 2.0 and out["ep_wait_frac"] == 0.2 and out["rank_balancedness"] == 0.9
    assert out["bytes_migrated"] == 100 and out["rebalances_applied"] == 1  # the warm-up step's migration counts
    assert out["lp_steps_run"] == 2 and out["lp_ms_per_step"] == 2.0 and out["after_step_ms"] == 10.0


def test_variants_differ_only_in_routing_and_balancer(tmp_path: Path) -> None:
    a = variant_config("ep4", "skew", "none", "examples/expert_loads.txt", tmp_path / "a", 4)
    b = variant_config("ep4", "uniform", "lplb", "examples/expert_loads.txt", tmp_path / "b", 4)
    assert a["bench"]["router_skew_from"] == "examples/expert_loads.txt" and b["bench"]["force_uniform_routing"] is True
    assert a["model"] == b["model"] and a["parallel"] == b["parallel"] == {"pp": 1, "ep": 4, "dp": 1, "world_size": None}
    assert b["balancer"]["kind"] == "lplb" and b["balancer"]["stay_off"] is True
