"""benchmarks/balance_e2e.py's summary of a variant's steps and its variants (its full runs are too
slow for the suite: the figures in docs/balancers-in-training.md come from the script itself), and
one step of its smallest run with the ranks pinned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from balance_e2e import load_skew, summarise, variant_config  # noqa: E402


def _step(step_s: float, wait: float, bal: float, balancer: dict) -> dict:
    return {"step_s": step_s, "after_step_s": 0.01, "ep_wait_frac": wait, "rank_balancedness": bal, "balancer": balancer}


def test_summary_takes_medians_after_warmup_and_migrations_over_every_step() -> None:
    moved = {"rebalance": {"bytes_moved": 100, "applied": True}, "replicas_used": True, "replica_cost_ms": 9.0}
    steps = [_step(9.0, 0.5, 0.5, moved)] + [
        _step(s, w, 0.9, {"replicas_used": used, "replica_cost_ms": c})
        for s, w, used, c in ((1.0, 0.1, True, 2.0), (3.0, 0.3, False, 5.0), (2.0, 0.2, True, 4.0))
    ]
    out = summarise(steps, warmup=1)
    assert out["step_s"] == 2.0 and out["ep_wait_frac"] == 0.2 and out["rank_balancedness"] == 0.9
    assert out["bytes_migrated"] == 100 and out["rebalances_applied"] == 1  # the warm-up step's migration counts
    # the replicas' cost is the median over the steps they were in use
    assert out["replicas_used_steps"] == 2 and out["replica_cost_ms_per_step"] == 3.0 and out["after_step_ms"] == 10.0


def test_summary_gives_the_phases_processor_time_when_every_step_has_it() -> None:
    steps = [{**_step(1.0, 0.1, 1.0, {}), "step_cpu_s": c, "optimizer_cpu_s": c / 100, "after_step_cpu_s": c / 1000}
             for c in (0.5, 0.7, 0.6)]
    out = summarise(steps, warmup=0)
    assert (out["step_cpu_ms"], out["optimizer_cpu_ms"], out["after_step_cpu_ms"]) == (600.0, 6.0, 0.6)
    assert "step_cpu_ms" not in summarise([_step(1.0, 0.1, 1.0, {})] + steps, warmup=0)  # a step without it: no figure


def test_load_skew_is_max_over_mean_of_the_summed_loads_mean_over_layers() -> None:
    steps = [{"expert_counts": [[3, 1, 0, 0], [1, 1, 1, 1]]}, {"expert_counts": [[1, 1, 1, 1], [1, 1, 1, 1]]}, {"expert_counts": None}]
    # layer 0: loads 4, 2, 1, 1 (max / mean 2); layer 1: even (1)
    assert load_skew(steps) == 1.5
    assert load_skew([{"expert_counts": None}]) is None


def test_variants_differ_only_in_routing_and_balancer(tmp_path: Path) -> None:
    a = variant_config("ep4", "loads", "none", "examples/expert_loads.txt", tmp_path / "a", 4)
    b = variant_config("ep4", "uniform", "lplb", "examples/expert_loads.txt", tmp_path / "b", 4)
    assert a["bench"]["router_skew_from"] == "examples/expert_loads.txt" and b["bench"]["force_uniform_routing"] is True
    assert a["model"] == b["model"] and a["parallel"] == b["parallel"] == {"pp": 1, "ep": 4, "dp": 1, "world_size": None, "layers_per_stage": None}
    assert b["balancer"]["kind"] == "lplb" and b["balancer"]["stay_off"] is True
    c = variant_config("ep2", "trained", "eplb", "unused", tmp_path / "c", 4, trained=tmp_path / "hf")
    assert c["model"]["init_from"] == str(tmp_path / "hf") and c["bench"]["router_skew_from"] is None
    assert c["balancer"]["min_gain"] == "auto" and c["balancer"]["stay_off"] is True
    # lplb_on: the same LPLB with its replicas never switched off
    on = variant_config("ep4", "loads", "lplb_on", "examples/expert_loads.txt", tmp_path / "e", 4)
    assert on["balancer"]["stay_off"] is False and {**on["balancer"], "stay_off": True} == variant_config(
        "ep4", "loads", "lplb", "examples/expert_loads.txt", tmp_path / "f", 4)["balancer"]
    with pytest.raises(KeyError):
        variant_config("ep3", "loads", "none", "x", tmp_path / "d", 4)


@pytest.mark.multiproc
def test_one_step_with_pinned_ranks_says_each_ranks_cores(tmp_path: Path) -> None:
    from portapipe.ranks import pinning

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "benchmarks" / "balance_e2e.py"), "--layouts", "ep2", "--sources", "loads", "uniform",
           "--balancers", "none", "--steps", "1", "--warmup", "0", "--pin-cores", "auto", "--out-dir", str(tmp_path / "runs")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    layout = json.loads(out.stdout)["layouts"]["ep2"]
    want = pinning.plan("auto", 2)
    placed = layout["placement"]
    assert placed["pin_cores"] == "auto" and placed["pinned"] is (want is not None)
    if want is not None:  # 2 usable cores or more: one set each, one thread per core
        assert placed["cores_by_rank"] == [pinning.describe(c) for c in want] and placed["threads_by_rank"] == [len(c) for c in want]
    assert set(layout["variants"]) == {"loads:none", "uniform:none"}


def test_pinning_more_ranks_than_cores_is_refused_in_one_line_before_any_layout_runs(tmp_path: Path) -> None:
    from portapipe.ranks import pinning

    if len(pinning.usable_cores()) >= 8:
        pytest.skip("this machine has a core for each of 8 ranks")
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "benchmarks" / "balance_e2e.py"), "--layouts", "ep2", "pp2ep4", "--sources", "loads", "uniform",
           "--steps", "1", "--warmup", "0", "--pin-cores", "true", "--out-dir", str(tmp_path / "runs")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and out.stdout == "" and len(lines) == 1, out.stderr
    assert lines[0].startswith("portapipe: config error: launch.pin_cores: true") and "8 ranks" in lines[0]
