"""Clocks and rounds shared by the measurements of ``portapipe profile``: processor time of
this thread, the least disturbed wall time, compute spans between communication calls, and a
mean over ranks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

def cpu() -> float:
    """This thread's processor time: what a part costs, however busy other processes keep the machine."""
    return time.thread_time()


def least_time(fn: Callable[[], None], reps: int) -> float:
    """Wall time of the least disturbed of ``reps`` runs (communication waits, so processor time
    would not count it; other processes' load only ever adds to it)."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def cpu_time(fn: Callable[[], None], reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = cpu()
        fn()
        out.append(cpu() - t0)
    return statistics.median(out)


def rounds(call: Callable[[], None], spans: list[float], reps: int) -> tuple[list[float], float]:
    """Compute for each of ``spans`` seconds of processor time in turn, then ``call``
    (communication, waited for), ``reps`` times over, as a stage computes between exchanges
    (taking the spans in turn keeps a drift in the machine's speed out of their differences).
    Returns the mean wall time of ``call`` after each span (what the rank waits, its peers' lag
    included: the mean, since the rare long waits are part of every step) and the processor
    time the process's other threads (a CPU backend's communication threads) spent per call,
    which a call alone measures poorly: who does the work depends on who waits."""
    call()  # the peers line up
    waited = [0.0] * len(spans)
    p0, t0 = time.process_time(), cpu()
    for _ in range(reps):
        for i, span in enumerate(spans):
            spin(span)
            w0 = time.perf_counter()
            call()
            waited[i] += time.perf_counter() - w0
    background = (time.process_time() - p0) - (cpu() - t0)
    return [w / reps for w in waited], max(0.0, background) / (reps * len(spans))


def spin(seconds: float) -> None:
    """Compute for ``seconds`` of this thread's processor time (small matrix products)."""
    a = torch.randn(64, 64)
    t0 = cpu()
    while cpu() - t0 < seconds:
        a = torch.tanh(a @ a)


def mean_over(backend: Any, values: list[float], group: Any, size: int) -> list[float]:
    """The mean of ``values`` over the ``size`` ranks of ``group``."""
    t = torch.tensor(values, dtype=torch.float64)
    backend.all_reduce(t, group=group)
    return [float(v) / size for v in t]
