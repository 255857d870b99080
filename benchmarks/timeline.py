"""What recording a timeline costs: the same run's steps with ``log.timeline`` on and off, in turns.

One training run of the config (default examples/cpu.yaml: DualPipeV on 4 gloo ranks, pp 2 x ep
2). After ``--warmup`` steps, the steps go in pairs, and in each pair one step is recorded and
the other is not, the recorded one second in even pairs and first in odd ones, so a drift in the
machine's load falls on both alike. A step's time is the executor's (``step_s`` of metrics.jsonl:
the slowest rank's step, from its first action to its gathers; what the recording adds between
steps, the ranks' clock alignment and the gathering and writing of the files, is outside it, as
it is outside every step that is not recorded). The ranks' processor time of each step (all
their threads, from the batch to the update: what the recording adds as work, less shaken by
other processes on the machine than the wall time) is taken beside it. Prints one JSON object:
each pair's on / off ratios, their medians (the claim: within 2%), the medians of each side, the residual bound of the
clocks' alignment over the recorded steps, and what the calls cost apart from the machine's load:
the emitting calls on the path of a step that is not recorded, each form timed here in a loop (a
context variable read and a shared no-op span), times the calls a recorded step made on its
busiest rank, as a share of the median step (``off``); the same calls recording (``on_calls``:
the bookkeeping inside a recorded step, the completion callbacks run at once).

    python benchmarks/timeline.py [--config examples/cpu.yaml] [--pairs 15] [--warmup 3] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from portapipe.config import load_config
from portapipe.scheduling import spans
from portapipe.timeline import analyze, trace


def recorded_steps(warmup: int, pairs: int) -> list[int]:
    """The recorded step (1-based) of each pair: the second of even pairs, the first of odd ones."""
    return [warmup + 2 * k + (2 if k % 2 == 0 else 1) for k in range(pairs)]


def off_call_s(reps: int = 200_000) -> tuple[float, float]:
    """Seconds the two forms of the core's emitting calls cost when no step is recorded: a span
    around a block, and a transfer's begin / issued / waiting / end."""
    span, begin, issued, waiting, end, compute = spans.span, spans.begin, spans.issued, spans.waiting, spans.end, spans.COMPUTE
    t0 = time.perf_counter()
    for _ in range(reps):
        with span(compute, "x"):
            pass
    t1 = time.perf_counter()
    for _ in range(reps):
        token = begin(compute, "x")
        issued(token, None)
        with waiting(token):
            pass
        end(token)
    t2 = time.perf_counter()
    return (t1 - t0) / reps, (t2 - t1) / reps


def on_call_s(reps: int = 50_000) -> tuple[float, float]:
    """The same two forms on a recorded step, on the CPU's clock: a span, and a transfer whose work
    has a future (its completion callback run at once, as a finished exchange's is). Reading the
    marks into rows happens after the step, outside its time."""
    import torch.futures

    from portapipe.backends.base import SpanClock
    from portapipe.timeline.record import StepRecorder

    class Work:
        def get_future(self) -> Any:
            fut = torch.futures.Future()
            fut.set_result(None)
            return fut

    work = Work()
    rec = StepRecorder(SpanClock())
    spans.install(rec)
    try:
        t0 = time.perf_counter()
        for _ in range(reps):
            with spans.span(spans.COMPUTE, "x"):
                pass
        t1 = time.perf_counter()
        for _ in range(reps):
            token = spans.begin(spans.EXCHANGES, ("dispatch", 1))
            spans.issued(token, work)
            with spans.waiting(token):
                pass
            spans.end(token)
        t2 = time.perf_counter()
    finally:
        spans.uninstall(rec)
    return (t1 - t0) / reps, (t2 - t1) / reps


def calls(events: list[dict[str, Any]]) -> tuple[int, int]:
    """(spans, transfers) one rank's recorded step emitted: what the same step calls when it is not
    recorded (a pair's two halves each ask once more whether to follow them: counted as spans)."""
    spans_ = sum(e["kind"] in ("action", "part") for e in events) + 2 * sum("stage2" in e for e in events if e["kind"] == "action")
    return spans_, sum(e["kind"] in ("exchange", "p2p", "reduce") for e in events)


class ProcessorTime:
    """A step hook: this rank's processor time (all its threads: the communication's too) from
    before a step's batch to after its update, by 1-based step."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self._t0 = 0.0

    def before_step(self, step: int) -> None:
        self._t0 = time.process_time()

    def after_update(self, step: int, last: bool) -> None:
        self.seconds[step + 1] = time.process_time() - self._t0

    def after_record(self, step: int, row: Any) -> None:
        pass

    def close(self, failing: bool) -> None:
        pass


def _rank(backend: Any, config_dict: dict[str, Any]) -> dict[int, float]:
    """One rank of the run (as ``portapipe train``'s), with its processor time per step."""
    from portapipe.checkpoint.run import plan_on_ranks
    from portapipe.compose import PipelineRuntime
    from portapipe.config import config_from_dict
    from portapipe.training.loop import Trainer

    config = config_from_dict(config_dict)
    backend.manual_seed(config.train.seed)
    groups = backend.parallel_groups(config.parallel.pp, config.parallel.dp, config.parallel.ep)
    run, locks = plan_on_ranks(config, backend, groups.rank, None)
    cpu = ProcessorTime()
    try:
        Trainer(backend, config, groups, run, PipelineRuntime(config, backend, groups), hooks=[cpu]).run()
    finally:
        locks.release()
    return cpu.seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"))
    ap.add_argument("--pairs", type=int, default=15, help="pairs of steps, one recorded in each [15]")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the first pair [3]")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, e.g. schedule.name=1f1b")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.warmup < 0:
        ap.error(f"--pairs {args.pairs} / --warmup {args.warmup}: at least one pair, no negative warm-up")
    from portapipe.ranks.launch import rank_threads, run_ranks
    from portapipe.train import check_before_launch

    chosen = recorded_steps(args.warmup, args.pairs)
    folder = Path(tempfile.mkdtemp(prefix="portapipe-timeline-bench-"))
    overrides = [*args.set, f"train.steps={args.warmup + 2 * args.pairs}", f"log.dir={folder}", "log.progress=false",
                 f"log.timeline.steps={chosen}", "checkpoint.at_end=false", "checkpoint.every=0", "data.val_fraction=0.0"]
    config = load_config(args.config, overrides)
    load_before = os.getloadavg()
    try:
        check_before_launch(config)
        cpu = run_ranks(_rank, config.world_size, config.to_dict(), backend=config.backend, threads=rank_threads(config.world_size),
                        pg_timeout_s=300.0, wall_timeout_s=1800.0)
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        step_s = {r["step"]: r["step_s"] for r in rows if r["kind"] == "train"}
        docs = [trace.read(folder, s) for s in chosen]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    pairs = []
    for k, on in enumerate(chosen):
        first = args.warmup + 2 * k + 1
        off = first + 1 if on == first else first
        cpu_on, cpu_off = sum(c[on] for c in cpu), sum(c[off] for c in cpu)
        pairs.append({"on_step": on, "off_step": off, "on_s": step_s[on], "off_s": step_s[off], "on_over_off": step_s[on] / step_s[off],
                      "processor_on_s": cpu_on, "processor_off_s": cpu_off, "processor_on_over_off": cpu_on / cpu_off})
    span_s, transfer_s = off_call_s()
    span_n, transfer_n = max((calls(events) for doc in docs for events in analyze.by_rank(doc).values()), key=lambda c: c[0] * span_s + c[1] * transfer_s)
    per_step = span_n * span_s + transfer_n * transfer_s
    on_span_s, on_transfer_s = on_call_s()
    on_step = span_n * on_span_s + transfer_n * on_transfer_s
    median_off = statistics.median(p["off_s"] for p in pairs)
    ratio = statistics.median(p["on_over_off"] for p in pairs)
    report = {
        "benchmark": "timeline",
        "command": "python benchmarks/timeline.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "setup": {"config": args.config, "schedule": config.schedule.name, "pp": config.parallel.pp, "ep": config.parallel.ep,
                  "dp": config.parallel.dp, "warmup": args.warmup, "pairs": args.pairs, "recorded_steps": chosen},
        "pairs": pairs,
        "median_on_over_off": ratio,
        "within_2_percent": abs(ratio - 1) <= 0.02,
        "median_processor_on_over_off": statistics.median(p["processor_on_over_off"] for p in pairs),
        "median_step_s": {"on": statistics.median(p["on_s"] for p in pairs), "off": median_off},
        "alignment_bound_s": {"max": max(r["alignment"]["bound_s"] for doc in docs for r in doc["ranks"]),
                              "median": statistics.median(r["alignment"]["bound_s"] for doc in docs for r in doc["ranks"] if r["rank"] > 0)},
        "off": {"span_call_s": span_s, "transfer_calls_s": transfer_s, "spans_per_step": span_n, "transfers_per_step": transfer_n,
                "per_step_s": per_step, "share_of_step": per_step / median_off},
        "on_calls": {"span_call_s": on_span_s, "transfer_calls_s": on_transfer_s, "per_step_s": on_step, "share_of_step": on_step / median_off},
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    from portapipe.cli import guarded  # errors as one line, as the CLI prints them

    sys.exit(guarded(main))
