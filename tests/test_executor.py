"""The executor runs hand-written action lists exactly, frees activations, and fails loudly."""

from __future__ import annotations

import time
from typing import Any

import pytest

from portapipe.config import Config, ConfigError, load_config
from portapipe.ranks.launch import LaunchError, run_ranks
from portapipe.compose import PipelineRuntime
from portapipe.scheduling.executor import build_schedule, mean_loss
from portapipe.scheduling.ir import Schedule, parse_action
from portapipe.verify.compare import compare
from portapipe.verify.pipelined import microbatches, step_report

MODEL = dict(
    dtype="float64", vocab_size=32, hidden=16, n_layers=4, n_dense=1, n_heads=2, ffn_hidden=32,
    moe_hidden=16, n_experts=4, top_k=2, seq_len=8,
)


def _config(**schedule: Any) -> Config:
    return load_config(
        {
            "backend": "cpu",
            "parallel": {"pp": 2, "ep": 1},
            "schedule": {"name": "1f1b", "microbatches": 4, **schedule},
            "model": MODEL,
            "train": {"micro_batch_size": 2},
        }
    )


def _schedule(name: str, lists: list[str]) -> Schedule:
    """A two-rank, two-stage schedule from text, e.g. '0F0 0F1 0B0 0W0 ...' per rank."""
    return Schedule(
        name=name, n_ranks=2, n_microbatches=4, stage_rank=[0, 1], stage_block=[0, 1], pipelines=[[0, 1]],
        mb_pipeline=[0] * 4, actions=[[parse_action(a) for a in text.split()] for text in lists],
    )


# GPipe: all forwards, then all input-gradient backwards, then all weight gradients.
GPIPE = _schedule(
    "gpipe",
    [
        "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0W0 0W1 0W2 0W3",
        "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3 1W3 1W2 1W1 1W0",
    ],
)
# Hand-made F&B pairs on one stage, mixing full and split backwards.
PAIRS = _schedule(
    "pairs",
    [
        "0F0 0F1 (0F2;0BW0) (0F3;0B1) 0W1 0BW2 0B3 0W3",
        "1F0 (1F1;1B0) 1W0 (1F2;1BW1) (1F3;1BW2) 1BW3",
    ],
)


def _run(backend: Any, raw: dict[str, Any], schedules: list[Schedule | None]) -> list[dict[str, Any]]:
    from portapipe.config import config_from_dict

    config = config_from_dict(raw)
    groups = backend.parallel_groups(2, 1, 1)
    out = []
    for schedule in schedules:
        runtime = PipelineRuntime(config, backend, groups, schedule=schedule)
        out.append(step_report(runtime, microbatches(config, 0)))
    return out


@pytest.mark.multiproc
def test_hand_written_schedules_match_the_single_process_step() -> None:
    config = _config()
    results = run_ranks(_run, 2, config.to_dict(), [GPIPE, PAIRS, None])
    for i, name in enumerate(["gpipe", "pairs", "1f1b"]):
        report = compare(config, [r[i] for r in results])
        assert report.loss_diff == 0.0, name
        assert report.max_rel_grad_diff <= 1e-12, (name, report.worst_param)
        assert report.max_bias_diff == 0.0, name
    # Activations are freed by the backward that needs them: GPipe holds all 4 micro-batches,
    # 1F1B at most pp - rank on each rank.
    assert [r[0]["timings"]["peak_activations"] for r in results] == [4.0, 4.0]
    assert [r[2]["timings"]["peak_activations"] for r in results] == [2.0, 1.0]
    # Load statistics: every routed row of every micro-batch is counted once, per MoE layer.
    counts = results[0][2]["expert_counts"]
    layers = results[0][2]["expert_layers"] + results[1][2]["expert_layers"]
    assert layers == [1, 2, 3]  # layer 0 is dense
    assert int(counts.sum()) == len(results[0][2]["expert_layers"]) * 4 * 2 * 8 * 2
    timings = results[1][2]["timings"]
    assert timings["step_s"] > 0 and 0.0 <= timings["bubble_frac"] <= 1.0
    assert results[0][2]["tokens"] == 4 * 2 * 8


def _raise_on_rank_1(backend: Any, raw: dict[str, Any]) -> None:
    from portapipe.config import config_from_dict

    config = config_from_dict(raw)
    groups = backend.parallel_groups(2, 1, 1)
    runtime = PipelineRuntime(config, backend, groups)
    data = microbatches(config, 0)
    runtime.step(data[:-1] if groups.pp_rank == 1 else data)  # rank 0 waits for rank 1 forever


@pytest.mark.multiproc
def test_a_rank_raising_mid_step_ends_all_ranks_promptly_with_its_traceback() -> None:
    t0 = time.perf_counter()
    with pytest.raises(LaunchError) as err:
        run_ranks(_raise_on_rank_1, 2, _config().to_dict(), pg_timeout_s=120)
    assert time.perf_counter() - t0 < 60  # not the 120 s collective timeout
    assert err.value.rank == 1
    assert "step() got 3 micro-batches; schedule 1f1b runs 4" in err.value.traceback


def test_schedules_that_cannot_run_fail_before_ranks_start() -> None:
    config = _config(name="interleaved", chunks=2)
    config.schedule.microbatches = 3  # bypasses load_config's cross checks on purpose
    with pytest.raises(ConfigError) as err:
        build_schedule(config)
    assert any("interleaved" in line for line in err.value.problems)
    ok = build_schedule(_config(name="zb1p"))
    assert ok.n_ranks == 2 and any(a.kind.is_comm for a in ok.actions[0])


def test_mean_loss_sums_in_replica_then_microbatch_order() -> None:
    rows = [[0.1, 0.2], [0.3, 1e16]]
    assert mean_loss(rows) == (((0.1 + 0.2) + 0.3) + 1e16) / 4


def test_without_w_split_every_backward_is_full() -> None:
    s = build_schedule(_config(name="zb1p", w_split=False))
    kinds = {h.kind.value for acts in s.actions for a in acts for h in a.halves()}
    assert "W" not in kinds and "B" not in kinds and "BW" in kinds


def test_a_completed_send_is_let_go_after_the_next_compute_and_its_error_still_raised() -> None:
    """The step keeps a sent tensor only while its send is in flight (the executor looks after
    each compute action); a completed send is waited on (which raises what it raised), and a
    work that cannot say whether it completed is kept to the step's end, as before."""
    from portapipe.scheduling.step_run import StepRun

    class Work:
        def __init__(self, done: bool, error: Exception | None = None) -> None:
            self.done, self.error, self.waited = done, error, False

        def is_completed(self) -> bool:
            return self.done

        def wait(self) -> bool:
            self.waited = True
            if self.error is not None:
                raise self.error
            return True

    class Opaque:  # a transport's work without is_completed
        def wait(self) -> bool:
            return True

    run = object.__new__(StepRun)
    run.sent = {}  # no step is recorded: no send has a span
    done, flying, opaque = Work(True), Work(False), Opaque()
    run.sends = [(done, "a"), (flying, "b"), (opaque, "c")]
    run._release_sent()
    assert [t for _, t in run.sends] == ["b", "c"] and done.waited and not flying.waited
    flying.done = True
    run._release_sent()
    assert [t for _, t in run.sends] == ["c"]
    run.sends = [(Work(True, RuntimeError("peer gone")), "d")]
    with pytest.raises(RuntimeError, match="peer gone"):
        run._release_sent()


def _count_releases(backend: Any, raw: dict[str, Any]) -> tuple[int, int]:
    from portapipe.config import config_from_dict
    from portapipe.scheduling.step_run import StepRun

    config = config_from_dict(raw)
    runtime = PipelineRuntime(config, backend, backend.parallel_groups(2, 1, 1))
    calls = [0]
    release = StepRun._release_sent

    def counted(self: StepRun) -> None:
        calls[0] += 1
        release(self)

    StepRun._release_sent = counted  # type: ignore[method-assign]
    try:
        step_report(runtime, microbatches(config, 0))
    finally:
        StepRun._release_sent = release  # type: ignore[method-assign]
    return calls[0], sum(not a.kind.is_comm for a in runtime.actions)


@pytest.mark.multiproc
def test_the_step_looks_at_its_sends_after_every_compute_action() -> None:
    results = run_ranks(_count_releases, 2, _config().to_dict())
    assert all(calls == computes > 0 for calls, computes in results), results
