"""benchmarks/lone_overlap.py: lone F, B, B+ and BW actions and an F&F pair over a transport with
a fixed latency report the share of exchange time they computed through; bad arguments exit 2."""

from __future__ import annotations

import json

import pytest


def test_reports_each_lone_action_kind_per_latency(capsys: pytest.CaptureFixture[str], bench_module) -> None:
    small = ["--set", "model.hidden=32", "--set", "model.seq_len=16", "--set", "train.micro_batch_size=2"]
    assert bench_module("lone_overlap").main(["--reps", "7", "--latency-us", "0,2000", *small]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["latency"]) == ["0us", "2000us"]
    for figures in report["latency"].values():
        for kind in ("F", "B", "B+", "BW", "F&F", "all"):
            assert 0.0 <= figures[f"{kind}_hidden_pct"] <= 100.0
        assert all(figures[f"{kind}_median_ms"] > 0 for kind in ("F", "B", "B+", "BW", "F&F"))
    # a B that starts its W's work computes through more of its exchanges than one that does
    # not, and two forwards paired more than one alone (7 rounds: one round's share is at the
    # mercy of a loaded machine's scheduler)
    slow = report["latency"]["2000us"]
    assert slow["B+_hidden_pct"] > slow["B_hidden_pct"]
    assert slow["F&F_hidden_pct"] > slow["F_hidden_pct"]
    # a 2 ms exchange is not over before anything waits for it: some of it is waited for
    assert report["latency"]["2000us"]["all_hidden_pct"] < 100.0


@pytest.mark.parametrize("args", [["--reps", "0"], ["--latency-us", "-5"], ["--latency-us", "fast"]])
def test_bad_arguments_exit_2_before_running(args: list[str], capsys: pytest.CaptureFixture[str], bench_module) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench_module("lone_overlap").main(args)
    assert exit_.value.code == 2
    assert capsys.readouterr().out == ""
