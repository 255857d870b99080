"""An exchange's completion time is taken only while its stats are timed (it costs a callback on
the communication thread per exchange); the step's timings say when the totals are not known."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from portapipe.scheduling import exchange as exchange_module
from portapipe.scheduling.exchange import A2AStats, Pending
from portapipe.scheduling.executor import a2a_timings

ROOT = Path(__file__).resolve().parents[1]


class _Work:
    """A work handle whose rows arrive when the test says (:meth:`arrive` runs the future's
    callbacks); ``wait`` takes ``wait_for`` seconds of the test's clock."""

    def __init__(self, now: list[float], wait_for: float) -> None:
        self.now, self.wait_for = now, wait_for
        self.futures = 0
        self.future: torch.futures.Future = torch.futures.Future()

    def get_future(self) -> Any:
        self.futures += 1
        return self.future

    def arrive(self) -> None:
        self.future.set_result(None)

    def wait(self) -> None:
        self.now[0] += self.wait_for

    def is_completed(self) -> bool:
        return self.future.done()


@pytest.mark.parametrize("timed", [True, False])
def test_an_exchanges_total_runs_from_issue_to_its_completion(timed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issued at t = 1, the rows arrive at t = 3 (the communication thread's callback), the caller
    waits from t = 10 to 10.5: 0.5 s blocked, 2 s in flight (not the 9.5 s to the end of the wait)."""
    now = [1.0]
    monkeypatch.setattr(exchange_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    stats, work = A2AStats(timed=timed), _Work(now, wait_for=0.5)
    pending = Pending(torch.zeros(2), work, stats)
    assert not pending.arrived and pending.in_flight
    now[0] = 3.0
    work.arrive()
    assert pending.arrived
    now[0] = 10.0
    pending.wait()
    assert work.futures == (1 if timed else 0)
    assert stats.count == 1 and stats.wait_s == 0.5
    assert stats.total_s == (2.0 if timed else 0.0)
    assert stats.hidden_frac == (0.75 if timed else 0.0)


def test_an_exchange_whose_completion_is_not_reported_counts_to_the_end_of_its_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A work handle without a future: issue (t = 1) to the end of the wait (t = 4.5)."""
    now = [1.0]
    monkeypatch.setattr(exchange_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    stats = A2AStats()
    pending = Pending(torch.zeros(2), _NoFuture(now), stats)
    now[0] = 4.0
    pending.wait()
    assert (stats.wait_s, stats.total_s) == (0.5, 3.5)


class _NoFuture:
    """A work handle that cannot report its completion; ``wait`` takes 0.5 s of the test's clock."""

    def __init__(self, now: list[float]) -> None:
        self.now = now

    def wait(self) -> None:
        self.now[0] += 0.5


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
