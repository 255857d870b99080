"""How much of a lone action's expert all-to-all its own program hides, with no peer to wait for.

In a lone F, B or BW (warm-up, cool-down, all of 1F1B and ZB1P) nothing but the action's own
independent parts can run while an exchange travels. On a shared machine the exchanges of
``step_vs_torch`` are dominated by waiting for EP peers that were not scheduled (the lag), which
no order of one's own parts can hide. This benchmark measures the order alone: one process
runs a stage of examples/cpu.yaml's model as EP rank 0 of 2 over a transport that hands every
rank's rows back (both ranks hold the same data) after a fixed latency, on a thread, like an
asynchronous exchange whose peers are always on time. For each latency it runs lone F, B
(weight gradients queued), B+ (a B whose W comes next, so it starts the W's work while its
exchanges travel: the executor's rule) and BW actions in turn, and an F&F pair (two
micro-batches' forwards interleaved, ``schedule.pair_forwards``; its time is the pair's), and
reports the share of exchange time the action computed through (1 - wait / total, as the
executor's timings count it).

    python benchmarks/lone_overlap.py [--config examples/cpu.yaml] [--latency-us 100,300] [--reps 30] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from portapipe.backends.cpu import CPUBackend
import portapipe
from portapipe.config import load_config
from portapipe.models.expert_parallel import ExpertParallel
from portapipe.models.moe import build_blocks
from portapipe.scheduling.overlap import Tape, run, run_pair
from portapipe.scheduling.wgrad import WeightGradQueue

# examples/cpu.yaml as the package ships it: the default works when installed, too
DEFAULT_CONFIG = Path(portapipe.__file__).resolve().parent / "configs" / "cpu.yaml"


class _Late:
    """An exchange's work that completes ``latency`` seconds after it was issued."""

    def __init__(self, latency: float) -> None:
        self._done_at = time.perf_counter() + latency
        self._future: torch.futures.Future = torch.futures.Future()
        timer = threading.Timer(latency, lambda: self._future.set_result(None))
        timer.daemon = True
        timer.start()

    def wait(self) -> bool:
        left = self._done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


class LatencyLoopback(CPUBackend):
    """EP rank 0 of 2 whose peer holds the same data: every exchange returns what was sent."""

    def __init__(self, latency: float) -> None:
        super().__init__()
        self.latency = latency

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        output.copy_(input)  # the routing's counts: blocking, not an expert exchange

    def expert_all_to_all(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> _Late:
        output.copy_(input)
        return _Late(self.latency)


def measure(config: Any, latency: float, reps: int) -> dict[str, float]:
    """Hidden share of each lone action kind at one latency (stage: the last block of two)."""
    ep = ExpertParallel(LatencyLoopback(latency), size=2, rank=0)
    block = build_blocks(config.model, [1], 2, ep, seed=config.train.seed)[1]
    g = torch.Generator().manual_seed(0)
    m = config.model
    x = torch.randn(config.train.micro_batch_size, m.seq_len, m.hidden, generator=g).to(block.final_norm.weight.dtype)
    y = torch.randint(0, m.vocab_size, (config.train.micro_batch_size, m.seq_len), generator=g)
    sums = {k: [0.0, 0.0] for k in ("F", "B", "B+", "BW", "F&F")}
    wall: dict[str, list[float]] = {k: [] for k in sums}
    for i in range(reps + 2):
        for kind in ("B", "B+", "BW"):
            st = ep.stats
            st.reset()
            t0 = time.perf_counter()
            tape = Tape()
            loss = run(block.program(tape, x, y))
            t1 = time.perf_counter()
            f_total, f_wait = st.total_s, st.wait_s
            queue = None if kind == "BW" else WeightGradQueue(fill_waits=kind == "B+")
            run(tape.backward(loss, torch.ones_like(loss), queue))
            t2 = time.perf_counter()
            if queue is not None:
                queue.run()
            block.zero_grad(set_to_none=True)
            if i < 2:  # warm-up
                continue
            sums["F"][0] += f_total
            sums["F"][1] += f_wait
            sums[kind][0] += st.total_s - f_total
            sums[kind][1] += st.wait_s - f_wait
            wall["F"].append(t1 - t0)
            wall[kind].append(t2 - t1)
        # two micro-batches' forwards interleaved (schedule.pair_forwards); their tapes are dropped
        ep.stats.reset()
        t0 = time.perf_counter()
        run_pair(block.program(Tape(), x, y), block.program(Tape(), x, y))
        if i >= 2:
            sums["F&F"][0] += ep.stats.total_s
            sums["F&F"][1] += ep.stats.wait_s
            wall["F&F"].append(time.perf_counter() - t0)
    out: dict[str, float] = {}
    for kind, (total, wait) in sums.items():
        out[f"{kind}_hidden_pct"] = round(100.0 * max(0.0, 1.0 - wait / total), 1) if total > 0 else 0.0
        out[f"{kind}_median_ms"] = round(1e3 * statistics.median(wall[kind]), 3)
    total = sum(t for t, _ in sums.values())
    out["all_hidden_pct"] = round(100.0 * max(0.0, 1.0 - sum(w for _, w in sums.values()) / total), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="[examples/cpu.yaml]")
    parser.add_argument("--latency-us", default="100,300", help="comma-separated exchange latencies in microseconds")
    parser.add_argument("--reps", type=int, default=30, help="timed F+B, F+B+ and F+BW rounds per latency")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        latencies = [float(v) for v in args.latency_us.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--latency-us {args.latency_us!r}: expected comma-separated numbers")
    if args.reps < 1 or not latencies or min(latencies) < 0:
        parser.error(f"--reps must be >= 1 and --latency-us non-negative numbers, got --reps {args.reps} --latency-us {args.latency_us}")
    config = load_config(args.config, ["backend=cpu", *args.overrides])
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    results = {f"{lat:g}us": measure(config, lat * 1e-6, args.reps) for lat in latencies}
    report = {
        "benchmark": "lone_overlap",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "load_avg_1m_before": round(load, 2), "load_avg_1m_after": round(os.getloadavg()[0], 2)},
        "model": {k: getattr(config.model, k) for k in ("hidden", "n_layers", "n_dense", "n_experts", "top_k", "moe_hidden", "n_shared", "dtype")},
        "tokens_per_microbatch": config.train.micro_batch_size * config.model.seq_len,
        "reps": args.reps,
        "latency": results,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    from portapipe.cli import guarded

    sys.exit(guarded(main))
