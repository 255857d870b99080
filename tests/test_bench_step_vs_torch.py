"""`portapipe bench step_vs_torch` (the README's headline speed figure) runs on the installed
torch, and its three variants of each schedule compute the same step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiproc
def test_step_vs_torch_runs_and_ours_and_torchs_pipelines_agree() -> None:
    # 2 ranks (pp 2, no expert parallelism) and a small model: the API and the check, not the speed.
    small = ["--set", "parallel.ep=1", "--set", "model.hidden=32", "--set", "model.seq_len=16", "--set", "train.micro_batch_size=2"]
    cmd = [sys.executable, "-m", "portapipe.cli", "bench", "step_vs_torch", "--steps", "1", "--warmup", "0", "--pin-cores", "auto", *small]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    report = json.loads(out.stdout)
    # torch 2.11 / 2.12's DualPipeV cannot run these blocks (found by presence); the others must run
    from torch.distributed.pipelining import _backward

    assert set(report["torch_unsupported"]) == (set() if hasattr(_backward, "_autograd_grad_for_inputs") else {"dualpipev"})
    for schedule in sorted({"dualpipev", "interleaved"} - set(report["torch_unsupported"])):
        same = report[schedule]["same_computation"]
        assert same["loss_ours"] == same["loss_torch"] == same["loss_ours_no_overlap"]
        assert same["max_rel_grad_diff_torch_vs_ours"] < 1e-5 and same["max_rel_grad_diff_no_overlap_vs_ours"] < 1e-5
        assert same["torch_grads_in_buckets"] is True  # one gradient reduction: the buckets, for torch's pipeline too
        # every rank's processor time per step, for each variant
        proc = report[schedule]["processor_ms_per_step_by_rank"]
        assert sorted(proc) == ["ours", "ours_no_overlap", "torch"]
        assert all(len(v) == report["ranks"] and min(v) > 0 for v in proc.values()), proc
        assert abs(report[schedule]["processor_ours_over_torch"] - sum(proc["ours"]) / sum(proc["torch"])) < 0.01
        # the floor: every rank's processor time spread over the host's usable cores
        cores, floor, step = report["machine"]["cores_usable"], report[schedule]["processor_floor_s"], report[schedule]["median_step_s"]
        assert cores >= 1 and sorted(floor) == sorted(proc)
        for k, v in proc.items():
            assert abs(floor[k] - sum(v) / cores / 1000.0) < 1e-3
            assert abs(report[schedule]["cores_busy_pct"][k] - 100.0 * floor[k] / step[k]) < 0.5
        assert abs(report[schedule]["ours_floor_over_torch"] - floor["ours"] / step["torch"]) < 0.01
        # one step timing the exchanges follows the timed step; its time is reported apart
        assert report[schedule]["a2a_timing_steps"] == 1 and report[schedule]["median_step_s"]["ours_exchanges_timed"] > 0
        assert report[schedule]["a2a_wait_ms_per_step"] == report[schedule]["a2a_total_ms_per_step"] == 0.0  # ep 1: no exchange
        assert report[schedule]["counts_a2a_total_ms_per_step"] == 0.0 and report[schedule]["counts_a2a_hidden_pct"] is None
    assert report["pair_forwards"] is False
    # pinned where every rank can have a core (2 ranks): each rank's cores, shared by ours and torch's variants
    from portapipe.ranks import pinning

    want = pinning.plan("auto", report["ranks"])
    placed = report["placement"]
    assert placed["pin_cores"] == "auto" and placed["pinned"] is (want is not None) and len(placed["cores_by_rank"]) == report["ranks"]
    if want is not None:
        assert placed["cores_by_rank"] == [pinning.describe(c) for c in want] and placed["threads_by_rank"] == [len(c) for c in want]


@pytest.mark.parametrize("steps, warmup", [("0", "1"), ("-1", "1"), ("2", "-1")])
def test_step_counts_it_cannot_time_exit_2_before_ranks_start(steps: str, warmup: str) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_vs_torch.py"), "--steps", steps, "--warmup", warmup]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == f"step_vs_torch.py: error: --steps must be >= 1 and --warmup >= 0, got --steps {steps} --warmup {warmup}"


def test_pinning_more_ranks_than_cores_is_refused_in_one_line_before_ranks_start() -> None:
    from portapipe.ranks import pinning

    if len(pinning.usable_cores()) >= 4:
        pytest.skip("this machine has a core for each of the 4 ranks")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_vs_torch.py"), "--steps", "1", "--pin-cores", "true"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and out.stdout == "" and len(lines) == 1, out.stderr
    assert lines[0].startswith("portapipe: config error: launch.pin_cores: true") and "4 ranks" in lines[0]
