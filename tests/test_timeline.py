"""The recorded timeline (log.timeline), torch.profiler's labels (log.profiler) and `portapipe timeline`.

One launch of 4 gloo ranks trains a small model a few steps on every schedule (pp 2 x ep 2), with
zero-memory level1 and recompute moe, with a clock skewed per rank, and with rank 0 alone under
torch.profiler; the tests read what those runs wrote. The rest needs no ranks.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from portapipe.backends.base import SpanClock
from portapipe.cli import main
from portapipe.config import ConfigError, load_config
from portapipe.scheduling import spans
from portapipe.timeline import align, analyze, plan, trace

MODEL = {"hidden": 32, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2,
         "n_shared": 1, "seq_len": 16, "dtype": "float32"}
SCHEDULES = ("1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev")
SKEW_S = 0.75  # rank r's clock runs r x this ahead in the skewed run


def raw(log_dir: Path, schedule: str = "dualpipev", steps: int = 2, **over: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "backend": "cpu",
        "parallel": {"pp": 2, "ep": 2, "dp": 1},
        "schedule": {"name": schedule, "microbatches": 4},
        "model": dict(MODEL),
        "train": {"steps": steps, "micro_batch_size": 2, "warmup_steps": 1},
        "data": {"val_fraction": 0.0},
        "log": {"dir": str(log_dir), "progress": False, "timeline": {"steps": [2]}},
        "checkpoint": {"at_end": False},
    }
    for section, keys in over.items():
        out.setdefault(section, {}).update(keys)
    return out


class SkewedClock(SpanClock):
    """The host clock ``skew`` seconds ahead: a machine whose clock differs from rank 0's."""

    def __init__(self, skew: float) -> None:
        self.skew = skew

    def now(self) -> float:
        return super().now() + self.skew

    def read(self, marks: Any) -> list[float | None]:
        return [None if t is None else t + self.skew for t in super().read(marks)]


def _skewed(backend: Any, config_dict: dict[str, Any]) -> dict[str, Any]:
    """A run whose ranks' clocks disagree, recorded by a hook given that clock."""
    from portapipe.checkpoint.run import plan_on_ranks
    from portapipe.compose import PipelineRuntime
    from portapipe.config import config_from_dict
    from portapipe.config.schema import TimelineConfig
    from portapipe.timeline.hook import TimelineHook
    from portapipe.training.loop import Trainer

    config = config_from_dict(config_dict)
    groups = backend.parallel_groups(config.parallel.pp, config.parallel.dp, config.parallel.ep)
    run, locks = plan_on_ranks(config, backend, groups.rank, None)
    try:
        hook = TimelineHook(TimelineConfig(steps=[2]), config.log.dir, config.to_dict(), backend, groups, clock=SkewedClock(SKEW_S * groups.rank))
        return Trainer(backend, config, groups, run, PipelineRuntime(config, backend, groups), hooks=[hook]).run()
    finally:
        locks.release()


def _all_runs(backend: Any, root: str) -> dict[str, Any]:
    from portapipe.train import train_rank

    base = Path(root)
    runs = {name: raw(base / name, name) for name in SCHEDULES}
    # 1F1B's blocks hold two layers: the first of each recomputed (moe: layer 2), zero-memory on the rest (layers 1 and 3)
    runs["memory"] = raw(base / "memory", "1f1b", memory={"zero_memory": "level1", "recompute": "moe", "recompute_layers": 1})
    runs["profiled"] = raw(base / "profiled", steps=3, log={"profiler": {"steps": [2], "ranks": [0]}})
    # LPLB with its replicas on from the start, rebalancing after step 2
    runs["lplb"] = raw(base / "lplb", balancer={"kind": "lplb", "interval": 2, "stay_off": False, "redundant": 1})
    out = {name: train_rank(type(backend)(backend.options), config) for name, config in runs.items()}
    config = raw(base / "skewed")
    config["log"].pop("timeline")  # the test's hook records it
    out["skewed"] = _skewed(type(backend)(backend.options), config)
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from portapipe.ranks.launch import run_ranks

    root = tmp_path_factory.mktemp("timeline")
    summaries = run_ranks(_all_runs, 4, str(root), wall_timeout_s=600, pg_timeout_s=30)[0]
    return {"root": root, "summaries": summaries}


def _doc(recorded: dict[str, Any], name: str) -> dict[str, Any]:
    return trace.read(recorded["root"] / name, 2)


def _step_s(recorded: dict[str, Any], name: str, step: int = 2) -> float:
    rows = [json.loads(line) for line in (recorded["root"] / name / "metrics.jsonl").read_text().splitlines()]
    return next(r["step_s"] for r in rows if r["kind"] == "train" and r["step"] == step)


# ------------------------------------------------------------------------------ what must show
@pytest.mark.multiproc
@pytest.mark.parametrize("name", [*SCHEDULES, "memory", "lplb"])
def test_every_schedule_is_recorded_causally_right_every_action_once_in_its_order(recorded, name) -> None:
    doc = _doc(recorded, name)
    schedule = plan.schedule_of(doc)
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3] and doc["clock"] == "wall"
    assert analyze.causality(doc, schedule) == []
    assert analyze.action_problems(doc, schedule) == []
    names = {e["name"] for e in doc["events"]}
    # exchanges read as the schedule does: kind, layer, micro-batch; and their reverse in the backward
    assert {"dispatch L1 mb0", "combine L1 mb0", "dispatch grad L1 mb0", "combine grad L1 mb0", "counts L1 mb0"} <= names
    assert {"data", "step", "grad sync", "step end", "figures", "optimizer"} <= names
    assert "validation" in names  # the run's last step, recorded: the end's validation with it (outside the step)
    assert any(e["kind"] == "reduce" for e in doc["events"])  # the gradient buckets' reductions
    if name == "memory":  # zero-memory's re-dispatch and recompute's replays
        assert {"re-dispatch L1 mb0", "re-dispatch L3 mb0", "dispatch replay L2 mb0", "combine replay grad L2 mb0"} <= names
    if name == "lplb":  # the balancer's work: its step, its rebalance, LPLB's solve of each micro-batch's routing
        assert {"balancer", "LPLB rebalance", "LPLB solve L1 mb0", "LPLB solve L3 mb3"} <= names
    if name in ("dualpipe", "dualpipev"):
        assert any(n.startswith("F&B s") for n in names)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [*SCHEDULES, "memory", "lplb"])
def test_compute_exposed_communication_and_idle_add_up_to_each_ranks_step(recorded, name) -> None:
    doc = _doc(recorded, name)
    walls = []
    for r, events in analyze.by_rank(doc).items():
        a = analyze.accounting(events)
        total = a["compute_s"] + sum(a["exposed_s"].values()) + a["idle_s"]
        assert abs(total - a["wall_s"]) <= 0.01 * a["wall_s"], (r, a)
        assert a["compute_s"] > 0 and a["exposed_s"]["all-to-all"] > 0 and a["idle_s"] >= 0
        walls.append(a["wall_s"])
    # the slowest rank's recorded step is the step time the executor measured on its own
    assert max(walls) == pytest.approx(_step_s(recorded, name), rel=0.01, abs=5e-4)


@pytest.mark.multiproc
def test_the_trace_is_valid_chrome_trace_json_with_a_process_per_rank_and_a_track_per_stream(recorded) -> None:
    for name in (*SCHEDULES, "memory"):
        chrome_path, _ = trace.paths(recorded["root"] / name, 2)
        doc = json.loads(chrome_path.read_text())
        assert trace.trace_problems(doc) == [], name
        meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
        assert sorted(e["args"]["name"] for e in meta if e["name"] == "process_name") == [
            "rank 0 (pp 0, dp 0, ep 0)", "rank 1 (pp 0, dp 0, ep 1)", "rank 2 (pp 1, dp 0, ep 0)", "rank 3 (pp 1, dp 0, ep 1)"]
        threads = {e["args"]["name"] for e in meta if e["name"] == "thread_name"}
        assert {"compute", "exchanges", "pipeline p2p", "gradient sync"} <= threads
        begins = sum(e["ph"] == "B" for e in doc["traceEvents"])
        assert begins == sum(e["ph"] == "E" for e in doc["traceEvents"]) > 0
        assert doc["otherData"]["max_residual_bound_s"] == max(doc["otherData"]["residual_bound_s"]) < 0.05
        # no two spans of one lane overlap
        lanes: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for e in doc["traceEvents"]:
            if e["ph"] == "X":
                lanes.setdefault((e["pid"], e["tid"]), []).append(e)
        for spans_ in lanes.values():
            spans_.sort(key=lambda e: e["ts"])
            assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(spans_, spans_[1:]))


@pytest.mark.multiproc
def test_skewed_clocks_are_aligned_and_dropping_a_ranks_offset_breaks_causality(recorded) -> None:
    doc = _doc(recorded, "skewed")
    schedule = plan.schedule_of(doc)
    for info in doc["ranks"]:
        a = info["alignment"]
        assert a["offset_s"] == pytest.approx(-SKEW_S * info["rank"], abs=a["bound_s"] + 1e-3)
        assert len(a["samples"]) == (align.ROUNDS if info["rank"] else 0)
    assert analyze.causality(doc, schedule) == [] and analyze.action_problems(doc, schedule) == []
    for rank in (1, 2):  # rank 1 shares rank 0's pipeline position (exchanges), rank 2 its EP rank (p2p)
        dropped = analyze.shifted(doc, rank, -doc["ranks"][rank]["alignment"]["offset_s"])
        broken = analyze.causality(dropped, schedule)
        assert broken and all("completed at" in line for line in broken), rank


@pytest.mark.multiproc
def test_profiling_rank_0_alone_lets_the_run_finish_with_every_action_a_labelled_range(recorded) -> None:
    root = recorded["root"] / "profiled"
    assert recorded["summaries"]["profiled"]["steps"] == 3 and recorded["summaries"]["profiled"]["final_loss"] is not None
    assert sorted(p.name for p in (root / "profiler").iterdir()) == ["rank0_step2.json.gz"]
    events = json.loads(gzip.open(root / "profiler" / "rank0_step2.json.gz").read())["traceEvents"]
    labels = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    doc = _doc(recorded, "profiled")  # the timeline of the same step names the same things
    rank0 = {e["name"] for e in doc["events"] if e["rank"] == 0 and e["kind"] in ("action", "wait", "part")}
    assert rank0 <= labels, sorted(rank0 - labels)[:5]
    assert {"dispatch L3 mb0", "wait dispatch L3 mb0", "F s0 mb0"} <= labels  # rank 0 holds layers 0 and 3


@pytest.mark.multiproc
def test_the_timeline_command_prints_each_ranks_figures_beside_the_plan_and_draws_it(recorded, tmp_path, capsys) -> None:
    run_dir = recorded["root"] / "dualpipev"
    png = tmp_path / "step.png"
    assert main(["timeline", str(run_dir), "--step", "2", "--out", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checks"] == {"causality": [], "actions": []} and png.stat().st_size > 10_000
    assert [r["rank"] for r in out["ranks"]] == [0, 1, 2, 3] and out["plan_costs"] == "the run's own measured times"
    for r in out["ranks"]:
        assert set(r["exposed"]) == {"all-to-all", "pipeline p2p", "gradient sync", "step end"}
        assert 0 <= r["bubble"]["measured"] < 1 and 0 <= r["bubble"]["planned"] < 1
        diffs = [abs(o["diff_ms"]) for o in r["off_plan"]]
        assert len(diffs) == plan.OFF_PLAN and diffs == sorted(diffs, reverse=True)
        assert all(o["diff_ms"] == pytest.approx(o["measured_ms"] - o["planned_ms"]) for o in r["off_plan"])
    # priced by a device profile instead: the planner's time model of the same schedule
    assert main(["timeline", str(run_dir), "--step", "2", "--profile", "h800", "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert priced["plan_costs"].startswith("profile published figures for NVIDIA H800") and 0 < priced["plan_step_ms"] < out["plan_step_ms"]
    assert main(["timeline", str(run_dir), "--profile", str(tmp_path / "none.json")]) == 2
    assert "none.json' does not exist (make one with `portapipe profile CONFIG" in capsys.readouterr().err
    # the same figures as text; the newest recorded step when none is named
    assert main(["timeline", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "rank 3 (pp 1, ep 1, dp 0): step" in text and "most off the plan:" in text and "check:" not in text


@pytest.mark.multiproc
def test_the_plan_from_measured_times_prices_each_action_at_its_kinds_median(recorded) -> None:
    doc = _doc(recorded, "1f1b")
    schedule = plan.schedule_of(doc)
    costs = plan.MeasuredCosts(doc, schedule)
    events = analyze.by_rank(doc)[0]
    took = sorted(t for i, t in analyze.busy(events).items() if events[i]["ir"].startswith("0F"))
    peers = analyze.by_rank(doc)[1]  # rank 1 runs the same pipeline position
    took += [t for i, t in analyze.busy(peers).items() if peers[i]["ir"].startswith("0F")]
    import statistics

    assert costs.of(schedule.actions[0][0], 0) == pytest.approx(statistics.median(took))
    with pytest.raises(ValueError, match="not this run's schedule"):
        costs.of(schedule.actions[1][-1], 0)


# ------------------------------------------------------------------------------ without ranks
def test_the_timeline_keys_are_refused_where_they_would_do_nothing() -> None:
    config = load_config("examples/cpu.yaml", ["log.timeline.steps=[3, 4]", "log.timeline.every=10"])
    assert [s for s in range(1, 31) if config.log.timeline.chosen(s)] == [3, 4, 10, 20, 30]
    assert load_config("examples/cpu.yaml").log.timeline.chosen(1) is False  # off by default
    cases = {
        "log.timeline.steps=[0]": "log.timeline.steps: [0]: expected a list of steps, whole numbers >= 1",
        "log.timeline.steps=[101]": "log.timeline.steps: [101] past train.steps = 100, never run",
        "log.profiler.ranks=[0]": "log.profiler.ranks: [0] has no effect: log.profiler.steps chooses no step",
        "log.profiler.steps=[true]": "log.profiler.steps: [True]: expected a list of steps",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_config("examples/cpu.yaml", [override])
    with pytest.raises(ConfigError, match=r"log.profiler.ranks: \[4\] not among the run's 4 ranks \(0..3\)"):
        load_config("examples/cpu.yaml", ["log.profiler.steps=[2]", "log.profiler.ranks=[0, 4]"])


def test_nothing_is_recorded_unless_a_recorder_is_installed_and_two_record_one_step_together() -> None:
    assert spans.span(spans.COMPUTE, "x") is spans.OFF and spans.begin(spans.P2P, "y") is None
    heard: list[tuple[str, Any]] = []

    class Ear:
        def __init__(self, name: str) -> None:
            self.name = name

        def span(self, track: str, what: Any, args: Any = None) -> Any:
            heard.append((self.name, what))
            return spans.OFF

    a, b = Ear("a"), Ear("b")
    spans.install(a)
    spans.install(b)
    with spans.span(spans.COMPUTE, "both"):
        pass
    spans.uninstall(a)  # each ends at its own point, in any order
    with spans.span(spans.COMPUTE, "b only"):
        pass
    spans.uninstall(b)
    assert heard == [("a", "both"), ("b", "both"), ("b", "b only")] and spans.span(spans.COMPUTE, "z") is spans.OFF


def test_the_shortest_round_trip_sets_the_offset_and_its_half_the_bound() -> None:
    samples = [(10.0, 5.2, 10.4), (11.0, 6.05, 11.1), (12.0, 7.5, 13.0)]
    got = align.from_samples(samples)
    assert got.offset_s == pytest.approx(6.05 - 11.05) and got.bound_s == pytest.approx(0.05)
    assert align.from_samples([]) == align.Alignment()


def _aligned_exit(backend: Any, tick_s: float) -> float:
    """This rank's host time on leaving :func:`align.measure`, each clock reading ``tick_s`` long."""
    import time

    def slow_now() -> float:
        time.sleep(tick_s)
        return time.perf_counter()

    align.measure(backend, slow_now)
    return time.perf_counter()


@pytest.mark.multiproc
def test_every_rank_leaves_the_alignment_together() -> None:
    """Rank 0 answers the ranks one after another, so rank 1 is done a whole rank's rounds (3 clock
    readings each) before rank 2: left to go, it would start the recorded step that far ahead of
    the others and wait inside it for them. One host, so perf_counter is one clock for all."""
    from portapipe.ranks.launch import run_ranks

    tick = 0.02
    exits = run_ranks(_aligned_exit, 3, tick, wall_timeout_s=120)
    stagger_without = align.ROUNDS * 3 * tick
    assert max(exits) - min(exits) < stagger_without / 3, (exits, stagger_without)


def test_trace_problems_name_what_breaks_the_format() -> None:
    good = {"traceEvents": [{"ph": "B", "name": "a", "pid": 0, "tid": 0, "ts": 1.0}, {"ph": "E", "name": "a", "pid": 0, "tid": 0, "ts": 2.0},
                            {"ph": "X", "name": "x", "pid": 0, "tid": 1, "ts": 1.0, "dur": 3.0}]}
    assert trace.trace_problems(good) == []
    bad = {"traceEvents": [{"ph": "B", "name": "a", "pid": 0, "tid": 0, "ts": 1.0}, {"ph": "B", "name": "b", "pid": 0, "tid": 0, "ts": 2.0},
                           {"ph": "E", "name": "a", "pid": 0, "tid": 0, "ts": 3.0}, {"ph": "X", "name": "x", "pid": 0, "tid": 1, "ts": 1.0, "dur": -1},
                           {"ph": "X", "name": "y", "pid": 0, "tid": 1, "ts": "1"}, {"ph": "E", "pid": 1, "tid": 0, "ts": 1.0}]}
    assert trace.trace_problems(bad) == [
        "event 2: the end of a at 3.0 closes b begun at 2.0",
        "event 3: dur -1 is not a number >= 0",
        "event 4 (X): lacks dur",
        "event 5: an end on pid 1 tid 0 with no begin open",
        "a on pid 0 tid 0 begins and never ends",
    ]


def test_the_command_names_what_is_missing(tmp_path, capsys) -> None:
    assert main(["timeline", str(tmp_path), "--step", "3"]) == 2
    assert "step_3.rows.json does not exist: no step was recorded there (log.timeline)" in capsys.readouterr().err
    assert main(["timeline", str(tmp_path)]) == 2
    assert "holds no recorded step: record some with log.timeline" in capsys.readouterr().err
    assert main(["timeline", str(tmp_path), "--out", str(tmp_path / "x.txt")]) == 2
    assert "its suffix .txt is not a format matplotlib writes" in capsys.readouterr().err


def test_the_cost_benchmark_records_one_step_of_each_pair_first_and_second_in_turn(bench_module) -> None:
    bench = bench_module("timeline")
    assert bench.recorded_steps(3, 4) == [5, 6, 9, 10]  # pairs (4, 5), (6, 7), (8, 9), (10, 11)
    events = [{"kind": "action", "stage2": 1}, {"kind": "action"}, {"kind": "part"}, {"kind": "wait"}, {"kind": "exchange"}, {"kind": "p2p"}]
    assert bench.calls(events) == (3 + 2, 2)  # a pair's halves each ask whether to follow them
    span_s, transfer_s = bench.off_call_s(reps=1000)
    assert 0 < span_s < 1e-4 and 0 < transfer_s < 1e-4


def test_a_device_clock_records_events_where_the_work_runs_and_synchronizes_only_to_start_and_read() -> None:
    """Events on the current stream; an async work's completion on a watch stream that waited for it
    (NCCL / HCCL), or its future's host time (gloo); one synchronisation before the step, one to read."""
    from portapipe.backends.base import EventSpanClock

    log: list[str] = []
    device_now = [100.0]  # the device's clock, ms

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at: float | None = None

        def record(self) -> None:
            self.at = device_now[0]
            log.append(f"record on {stream[0]}")

        def synchronize(self) -> None:
            log.append("event synchronize")

        def elapsed_time(self, end: "Event") -> float:
            return end.at - self.at

    stream = ["compute"]

    class Ctx:
        def __init__(self, s: str) -> None:
            self.s = s

        def __enter__(self) -> None:
            self.was, stream[0] = stream[0], self.s

        def __exit__(self, *exc: object) -> None:
            stream[0] = self.was

    class Work:
        def wait(self) -> None:
            log.append(f"wait on {stream[0]}")

    clock = EventSpanClock(Event, lambda: log.append("device synchronize"), lambda: "watch", Ctx)
    clock.start()
    host0 = clock._origin
    assert log == ["device synchronize", "record on compute", "event synchronize"]
    log.clear()
    device_now[0] = 102.5
    begin = clock.mark()
    done = clock.done(Work())
    device_now[0] = 110.0
    end = clock.mark()
    assert log == ["record on compute", "wait on watch", "record on watch", "record on compute"]  # nothing waited on the host
    log.clear()
    assert clock.read([begin, done, end]) == pytest.approx([host0 + 0.0025, host0 + 0.0025, host0 + 0.010])
    assert log == ["device synchronize"]  # once, after the step
    gloo = EventSpanClock(Event, lambda: None, lambda: "watch", Ctx, works_on_streams=False)
    assert gloo.done(Work()) is None  # a work with no future: its caller's wait bounds it
