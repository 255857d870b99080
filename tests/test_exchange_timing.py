"""An exchange's completion time is taken only while its stats are timed (it costs a callback on
the communication thread per exchange); the step's timings say when the totals are not known."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from portapipe.scheduling.exchange import A2AStats, Pending
from portapipe.scheduling.executor import a2a_timings

ROOT = Path(__file__).resolve().parents[1]


class _Work:
    """A work handle whose future runs its callbacks at once (the rows have arrived)."""

    def __init__(self) -> None:
        self.futures = 0

    def get_future(self) -> Any:
        self.futures += 1
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


@pytest.mark.parametrize("timed", [True, False])
def test_completion_is_taken_only_while_the_stats_are_timed(timed: bool) -> None:
    stats, work = A2AStats(timed=timed), _Work()
    pending = Pending(torch.zeros(2), work, stats)
    assert pending.arrived and pending.in_flight
    pending.wait()
    assert work.futures == (1 if timed else 0)
    assert stats.count == 1 and stats.wait_s >= 0.0
    # timed: issue -> completion (the callback ran at issue), never less than the wait
    assert (stats.total_s >= stats.wait_s and stats.total_s > 0.0) if timed else stats.total_s == 0.0


def test_step_timings_of_an_untimed_step_give_waits_and_no_totals() -> None:
    step, fb = A2AStats(total_s=4.0, wait_s=1.0), A2AStats(total_s=3.0, wait_s=0.25)
    counts = A2AStats(total_s=0.5, wait_s=0.4)
    got = a2a_timings(step, fb, counts)
    assert got["a2a_hidden_frac"] == 0.75 and got["fb_a2a_hidden_frac"] == pytest.approx(1 - 0.25 / 3)
    assert got["edge_a2a_total_s"] == 1.0 and got["edge_a2a_wait_s"] == 0.75 and got["edge_a2a_hidden_frac"] == 0.25
    assert got["counts_a2a_total_s"] == 0.5 and got["counts_a2a_hidden_frac"] == pytest.approx(0.2)  # apart from the rows'
    step.timed = False
    got = a2a_timings(step, fb, counts)
    assert [got[f"{p}a2a_wait_s"] for p in ("", "fb_", "edge_", "counts_")] == [1.0, 0.25, 0.75, 0.4]
    assert all(got[f"{p}a2a_{k}"] is None for p in ("", "fb_", "edge_", "counts_") for k in ("total_s", "hidden_frac"))


def test_step_vs_torch_times_exchanges_on_one_step_after_every_n() -> None:
    spec = importlib.util.spec_from_file_location("step_vs_torch", ROOT / "benchmarks" / "step_vs_torch.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("step_vs_torch", mod)
    spec.loader.exec_module(mod)
    assert mod.timing_steps(5, 2) == [False, False, True, False, False, True, False, True]
    assert mod.timing_steps(3, 0) == [True, True, True]
    assert mod.timing_steps(1, 4) == [False, True]
