"""The training loop: LR schedule, clipping, metrics file, and real runs on gloo (checkpoints: test_checkpoint_*.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from portapipe.config import TrainConfig, load_config
from portapipe.checkpoint.files import atomic_write
from portapipe.metrics.log import MetricsLog, strict
from portapipe.training.update import clip_coefficient, lr_at


# ------------------------------------------------------------------------------- LR schedule
def test_lr_warms_up_linearly_then_follows_a_half_cosine_to_min_lr():
    tc = TrainConfig(steps=20, lr=1e-2, min_lr=1e-3, warmup_steps=4)
    lrs = [lr_at(s, tc, 20) for s in range(20)]
    assert lrs[:4] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])
    assert lrs[4] == pytest.approx(1e-2)
    assert lrs[-1] == pytest.approx(1e-3)
    for s in range(4, 20):  # closed form: progress runs 0..1 over steps 4..19
        progress = (s - 4) / 15
        assert lrs[s] == pytest.approx(1e-3 + 0.5 * 9e-3 * (1 + math.cos(math.pi * progress)))
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_lr_without_warmup_starts_at_full_lr():
    tc = TrainConfig(steps=3, lr=2e-3, min_lr=0.0, warmup_steps=0)
    assert [lr_at(s, tc, 3) for s in range(3)] == pytest.approx([2e-3, 1e-3, 0.0])


def test_clip_coefficient_scales_to_max_norm_only_when_exceeded():
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 1.0) == pytest.approx(0.25)
    assert clip_coefficient(4.0, 0.0) == 1.0  # 0 disables clipping
    assert clip_coefficient(float("nan"), 1.0) == 1.0  # not hidden: the loss shows it


def test_lr_schedule_ends_at_its_horizon_not_at_the_last_step():
    """The horizon (train.lr_schedule_steps, or a resumed run's) places the end of the cosine; past it, min_lr."""
    tc = TrainConfig(steps=20, lr=1e-2, min_lr=1e-3, warmup_steps=4)
    planned = [lr_at(s, tc, 40) for s in range(40)]
    assert planned[:20] == [lr_at(s, tc.model_copy(update={"steps": 40}), 40) for s in range(20)]  # train.steps plays no part
    assert planned[39] == pytest.approx(1e-3) and planned[20] > 1e-3
    short = [lr_at(s, tc, 20) for s in range(40)]
    assert short[:20] == planned[:4] + short[4:20] and short[19:] == [1e-3] * 21


def test_without_a_horizon_the_lr_stays_after_the_warm_up_whatever_train_steps_is():
    """The default: no decay, so 20 steps then a resume to 40 train as 40 straight steps."""
    for steps in (20, 40):
        tc = TrainConfig(steps=steps, lr=1e-2, min_lr=1e-3, warmup_steps=4)
        assert [lr_at(s, tc, None) for s in range(40)] == [2.5e-3, 5e-3, 7.5e-3, 1e-2] + [1e-2] * 36


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path):
    target = tmp_path / "f.json"
    target.write_bytes(b"before")

    def crash(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, crash)
    assert target.read_bytes() == b"before" and [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_metrics_are_strict_json():
    assert strict({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": -float("inf"), "e": 2}}) == {"a": None, "b": [1.0, None], "c": {"d": None, "e": 2}}


def test_metrics_log_drops_steps_after_the_resumed_checkpoint(tmp_path):
    log = MetricsLog(tmp_path, None)
    for s in range(1, 6):
        log.write({"kind": "train", "step": s, "loss": 1.0 / s})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 6, "lo')  # cut short by a crash
    resumed = MetricsLog(tmp_path, 3)
    resumed.write({"kind": "train", "step": 4, "loss": 0.3})
    resumed.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_a_resume_says_what_it_dropped_and_which_rows_are_missing(tmp_path, capsys):
    """One line for the lines that are not JSON, one for the steps up to the checkpoint that have
    no row (log.every's steps only), each naming the file; a whole file says nothing."""
    log = MetricsLog(tmp_path, None)
    for s in (1, 2, 5, 6):
        log.write({"kind": "train", "step": s, "loss": 1.0})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("not json\n{\"kind\": \"train\", \"step\": 7, \"lo\n")
    MetricsLog(tmp_path, 6).close()
    err = capsys.readouterr().err.strip().splitlines()
    path = tmp_path / "metrics.jsonl"
    assert err == [f"portapipe: {path}: 2 lines that are not JSON dropped on resume (cut short by a crash, or edited)",
                   f"portapipe: {path}: no row for 2 of the steps up to 6 that log.every 1 writes (steps 3-4); the file reads as the run from there on"]
    MetricsLog(tmp_path, 6, every=2).close()  # steps 2, 4, 6: 4 is missing
    assert capsys.readouterr().err.strip().splitlines() == [
        f"portapipe: {path}: no row for 1 of the steps up to 6 that log.every 2 writes (steps 4); the file reads as the run from there on"]
    MetricsLog(tmp_path, 2).close()
    assert capsys.readouterr().err == ""


def test_a_resumed_metrics_log_keeps_every_kind_of_row_up_to_its_step_and_no_summary(tmp_path):
    log = MetricsLog(tmp_path, None)
    written = [{"kind": "memory", "step": 0, "params": 1}, {"kind": "train", "step": 1, "loss": 1.0},
               {"kind": "overflow", "step": 2, "loss_scale": 65536.0}, {"kind": "train", "step": 3, "loss": 0.5, "balancer": {"moved": 1}},
               {"kind": "validation", "step": 3, "loss": 0.6}, {"kind": "overflow", "step": 4, "loss_scale": 32768.0},
               {"kind": "summary", "steps": 4}]
    for row in written:
        log.write(row)
    log.close()
    MetricsLog(tmp_path, 3).close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == written[:5]


def test_a_manifest_is_strict_json_whatever_floats_it_is_given(tmp_path):
    from portapipe.checkpoint.files import write_json

    write_json(tmp_path / "m.json", {"losses": [1.0, float("nan")], "scale": float("inf")})
    assert json.loads((tmp_path / "m.json").read_text()) == {"losses": [1.0, None], "scale": None}


def test_a_skipped_steps_loss_is_not_progress():
    from portapipe.training.summary import Progress

    p = Progress()
    p.record(1, None, 64, 0.1)
    p.record(2, 5.5, 64, 0.1)
    p.record(3, None, 64, 0.1)
    assert (p.step, p.first_loss, p.losses, p.tokens) == (3, 5.5, [5.5], 192)


# --------------------------------------------------------------------------- real training
def _tiny_config(log_dir: Path) -> dict:
    return load_config(
        {
            "backend": "cpu",
            "parallel": {"pp": 2, "ep": 2, "dp": 1},
            "schedule": {"name": "dualpipev", "microbatches": 4},
            "model": {"hidden": 32, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 64, "moe_hidden": 16,
                      "n_experts": 8, "top_k": 2, "seq_len": 32},
            "balancer": {"kind": "eplb", "interval": 2, "window": 2},
            "train": {"steps": 4, "micro_batch_size": 2, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1, "lr_schedule_steps": 4},
            "log": {"dir": str(log_dir), "progress": False},
            "checkpoint": {"every": 2, "keep": 2},
        }
    ).to_dict()


def _read_metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _train_interrupt_resume(backend, config_dict: dict) -> dict:
    """Train 4 steps (checkpoints at 2 and 4); then lose the step-4 checkpoint and resume from 2."""
    from portapipe.train import train_rank

    log_dir = Path(config_dict["log"]["dir"])
    full = train_rank(backend, config_dict)
    out: dict = {"full": full}
    if backend.parallel_groups(2, 1, 2).rank == 0:
        out["full_metrics"] = _read_metrics(log_dir)
        out["files"] = sorted(p.name for p in (log_dir / "checkpoints" / "step_00000004").iterdir())
        out["loads"] = json.loads((log_dir / "expert_loads.json").read_text())
        # An interruption between steps 2 and 4: only the step-2 checkpoint survives.
        for f in (log_dir / "checkpoints" / "step_00000004").iterdir():
            f.unlink()
    backend.barrier()
    out["resumed"] = train_rank(backend, config_dict)
    if backend.parallel_groups(2, 1, 2).rank == 0:
        out["resumed_metrics"] = _read_metrics(log_dir)
    return out


@pytest.mark.multiproc
def test_training_on_4_ranks_learns_logs_checkpoints_and_resumes_exactly(tmp_path):
    from portapipe.ranks.launch import run_ranks

    results = run_ranks(_train_interrupt_resume, 4, _tiny_config(tmp_path), wall_timeout_s=240)
    r0 = results[0]
    full, resumed = r0["full"], r0["resumed"]
    for r in results:  # every rank reports the same run
        assert [r["full"][k] for k in ("first_loss", "final_loss", "val_loss", "tokens")] == [full[k] for k in ("first_loss", "final_loss", "val_loss", "tokens")]

    # the loss falls, and the metrics file holds one line per step plus the summary
    train_lines = [m for m in r0["full_metrics"] if m["kind"] == "train"]
    assert [m["step"] for m in train_lines] == [1, 2, 3, 4]
    losses = [m["loss"] for m in train_lines]
    assert full["first_loss"] == losses[0] and full["final_loss"] == losses[-1]
    assert losses[-1] < losses[0] - 0.3, losses
    assert math.log(256) - 0.2 < losses[0] < math.log(256) + 0.2  # starts near uniform over bytes
    for m in train_lines:
        assert m["tokens"] == 4 * 2 * 32 * 2 and m["tokens_per_s"] > 0 and m["step_s"] > 0
        assert 0 <= m["bubble_pct"] <= 100 and 0 <= m["a2a_hidden_pct"] <= 100
        # DualPipeV at ep 2: the steady pairs, the edges and the routing's row counts each exchanged
        assert all(0 <= m[k] <= 100 for k in ("a2a_hidden_steady_pct", "a2a_hidden_edges_pct", "counts_a2a_hidden_pct"))
        assert m["grad_norm"] > 0
    assert [m["lr"] for m in train_lines] == pytest.approx([1e-2, 1e-2, 5.5e-3, 1e-3])
    assert r0["full_metrics"][-1]["kind"] == "summary" and full["val_loss"] is not None
    assert full["val_loss"] < losses[0]

    # checkpoint: DCP's index, one file per rank and the manifest
    assert r0["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "manifest.json"]

    # resuming from step 2 gives the same steps 3 and 4 as the uninterrupted run
    assert resumed["resumed_from"] == 2
    again = [m for m in r0["resumed_metrics"] if m["kind"] == "train"]
    assert [m["step"] for m in again] == [1, 2, 3, 4]
    assert again[:2] == train_lines[:2]  # kept from before the interruption
    assert [m["loss"] for m in again[2:]] == pytest.approx(losses[2:], rel=1e-6, abs=0)
    assert resumed["final_loss"] == pytest.approx(full["final_loss"], rel=1e-6, abs=0)
    assert resumed["val_loss"] == pytest.approx(full["val_loss"], rel=1e-6, abs=0)

    # eplb: the recorded expert loads of the last 2 steps, every routed (token, k) counted once
    loads = r0["loads"]
    assert loads["step"] == 4 and loads["layers"] == [1, 2, 3] and loads["window"] == 2
    tokens_per_step = 4 * 2 * 32 * 2  # micro-batches x batch x seq x EP ranks
    assert [sum(row) for row in loads["loads"]] == [2 * tokens_per_step * 2] * 3  # x top_k
    # ... and the placement in force, one row of slots per layer, which `portapipe balance --current` reads
    assert [sorted(row) for row in loads["phy2log"]] == [list(range(8))] * 3
