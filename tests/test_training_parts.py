"""The training loop's parts, each on its own: the apply / skip / diverge decision, the LR setting a
divergence names, the progress a run starts from, and the hooks' points in a real run."""

from __future__ import annotations

import math
from typing import Any

import pytest

from portapipe.config import TrainConfig, config_from_dict
from portapipe.optim.lr_schedule import Phase, phase_index
from portapipe.training.decide import PrecisionPolicy
from portapipe.training.hooks import StepHook
from portapipe.training.summary import Progress
from portapipe.training.update import lr_key

MODEL = {"hidden": 16, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2,
         "seq_len": 16, "dtype": "float32"}


def _config(log_dir: str, dtype: str = "float32", **train: Any) -> dict[str, Any]:
    return {
        "backend": "cpu", "parallel": {"pp": 2, "ep": 1, "dp": 1}, "schedule": {"name": "1f1b", "microbatches": 2},
        "model": {**MODEL, "dtype": dtype}, "train": {"steps": 4, "micro_batch_size": 2, "lr": 1e-2, **train},
        "data": {"val_fraction": 0.0}, "log": {"dir": log_dir, "progress": False}, "checkpoint": {"every": 2},
    }


# ------------------------------------------------------------------------------ the decision
def test_a_finite_step_is_applied_and_a_non_finite_one_diverges_at_its_own_step():
    policy = PrecisionPolicy(config_from_dict(_config("/tmp/unused")))
    applied = policy.decide(0, 2.5, 1.0)
    assert (applied.kind, applied.scale, applied.ends) == ("apply", 1.0, None) and applied.applied
    for loss, norm in ((math.nan, 1.0), (2.5, math.inf)):
        d = policy.decide(6, loss, norm)
        assert d.kind == "diverge" and not d.applied and d.ends["step"] == 7
        assert math.isnan(d.ends["loss"]) or math.isinf(d.ends["grad_norm"])
    assert policy.overflows == 0 and policy.scale == 1.0  # no loss scale without float16


def test_float16_skips_an_overflow_at_half_the_scale_and_ends_after_max_skipped_in_a_row():
    policy = PrecisionPolicy(config_from_dict(_config("/tmp/unused", dtype="float16", max_skipped_steps=3)))
    start = policy.scale
    kinds = [policy.decide(s, math.inf, 1.0) for s in range(2)]
    assert [(d.kind, d.scale, d.ends) for d in kinds] == [("skip", start, None), ("skip", start / 2, None)]
    assert policy.decide(2, 1.0, 1.0).kind == "apply"  # a clean step: the count in a row starts again
    skips = [policy.decide(s, math.nan, 1.0) for s in range(3, 6)]
    assert [d.kind for d in skips] == ["skip"] * 3 and skips[0].ends is None and skips[1].ends is None
    assert skips[2].ends["step"] == 6 and skips[2].ends["reason"].startswith("3 steps in a row overflowed in float16 (train.max_skipped_steps 3)")
    assert policy.overflows == 5


# --------------------------------------------------------------------------- the LR setting
def test_the_lr_setting_a_divergence_names():
    train = TrainConfig(steps=50, lr=1e-2, min_lr=1e-3, warmup_steps=4)
    assert [lr_key(s, train, None, None, True) for s in (0, 3, 49)] == ["train.lr"] * 3  # warm-up, then train.lr for good
    assert [lr_key(s, train, 20, None, True) for s in (10, 19, 20, 30)] == ["train.lr"] * 2 + ["train.min_lr"] * 2  # past the cosine
    phases = [{"kind": "warmup", "steps": 2}, {"kind": "constant", "steps": 3, "lr": 5.0}, {"kind": "cosine", "steps": 4, "lr": 1e-4}]
    assert lr_key(0, train, None, phases, True) == "train.lr_schedule[0].lr (warmup to 0.01)"  # a warm-up ends at train.lr
    assert lr_key(4, train, None, phases, True) == "train.lr_schedule[1].lr (constant to 5)"
    assert lr_key(99, train, None, phases, True) == "train.lr_schedule[2].lr (cosine to 0.0001)"  # past the end: the last
    assert lr_key(2, train, None, phases, False) == ("phase 1 of the LR schedule kept from the checkpoint (train.lr_schedule "
                                                     "replaces it) (constant to 5)")


def test_phase_index_counts_optimizer_steps():
    phases = [Phase("warmup", 2, 1.0), Phase("constant", 3, 1.0), Phase("cosine", 1, 0.1)]
    assert [phase_index(s, phases) for s in range(8)] == [0, 0, 1, 1, 1, 2, 2, 2]


# ------------------------------------------------------------------------------- progress
def test_a_resume_continues_its_checkpoints_progress_and_a_load_starts_its_own_at_the_step():
    kept = {"progress": {"step": 20, "first_loss": 6.5, "tokens": 1000, "train_s": 3.0, "losses": [5.0, 4.0]}}
    assert Progress.restored(kept, "resume") == Progress(20, 6.5, 1000, 3.0, [5.0, 4.0])
    assert Progress.restored(kept, "load") == Progress(step=20)
    assert Progress.restored(None, "new") == Progress()


# ------------------------------------------------------------------------------- the hooks
class _Seen(StepHook):
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def before_step(self, step: int) -> None:
        self.calls.append(("before", step))

    def after_update(self, step: int, last: bool) -> None:
        self.calls.append(("update", step, last))

    def after_record(self, step: int, row: dict[str, Any] | None) -> None:
        self.calls.append(("record", step, None if row is None else row["step"]))

    def close(self, failing: bool) -> None:
        self.calls.append(("close", failing))


def _hooked_run(backend: Any, raw: dict[str, Any]) -> list[tuple[Any, ...]]:
    from portapipe.checkpoint.run import plan_on_ranks
    from portapipe.compose import PipelineRuntime
    from portapipe.training.loop import Trainer

    config = config_from_dict(raw)
    groups = backend.parallel_groups(config.parallel.pp, config.parallel.dp, config.parallel.ep)
    run, locks = plan_on_ranks(config, backend, groups.rank, None)
    seen = _Seen()
    try:
        summary = Trainer(backend, config, groups, run, PipelineRuntime(config, backend, groups), hooks=[seen]).run()
    finally:
        locks.release()
    assert summary["steps"] == 4 and "diverged" not in summary
    return seen.calls


@pytest.mark.multiproc
def test_every_rank_calls_each_hook_at_each_point_of_each_step_in_order(tmp_path):
    from portapipe.ranks.launch import run_ranks

    calls = run_ranks(_hooked_run, 2, _config(str(tmp_path)), wall_timeout_s=300)
    want = [c for s in range(4) for c in (("before", s), ("update", s, s == 3), ("record", s, s + 1))] + [("close", False)]
    assert calls == [want, want]
