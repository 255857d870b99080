"""benchmarks/restart.py: a killed rank's restart timed from the kill to the first step after it,
its shares adding up to the whole, against a cold resume of the same folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "restart.py"
SMALL = ["model.hidden=32", "model.seq_len=16", "train.micro_batch_size=2", "checkpoint.every=4"]


@pytest.mark.multiproc
def test_the_restart_benchmark_reports_a_restart_and_its_shares_against_a_cold_resume() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--repeats", "1", *[x for s in SMALL for x in ("--set", s)]],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["setup"]["checkpoint_every"] == 4 and report["setup"]["killed_after_step"] == 6
    assert report["setup"]["resumed_from"] in ([4], [0])  # step 4's checkpoint, unless its save in the background had not ended
    restart, cold = report["restart"], report["cold_resume"]
    shares = ("detect_s", "launch_s", "build_s", "load_s", "first_step_s")
    assert all(restart[k] > 0 for k in shares) and sum(restart[k] for k in shares) == pytest.approx(restart["fault_to_first_step_s"])
    assert sum(report["shares"].values()) == pytest.approx(1.0)
    assert sum(cold[k] for k in shares[1:]) == pytest.approx(cold["process_start_to_first_step_s"])
    assert report["checkpoint_interval_s"] == pytest.approx(4 * report["median_step_s"])
    assert report["goal_met"] == (restart["fault_to_first_step_s"] < report["checkpoint_interval_s"])
    assert report["cold_over_restart"] == pytest.approx(cold["process_start_to_first_step_s"] / restart["fault_to_first_step_s"])
