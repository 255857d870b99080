"""log.tensorboard: the metrics of metrics.jsonl as TensorBoard scalars, equal to the JSONL across a resume."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from portapipe.config import ConfigError, load_config
from portapipe.metrics.tensorboard_sink import TB_DIR, log_problems, scalars
from portapipe.train import check_before_launch

event_file_loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
from tensorboard.util import tensor_util  # noqa: E402


def read_events(folder: Path) -> list[tuple[int, str, float]]:
    """Every scalar of every event file in ``folder``, as written (duplicates kept): (step, tag, value)."""
    out = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in event_file_loader.EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                out.append((event.step, value.tag, float(tensor_util.make_ndarray(value.tensor))))
    return out


def test_scalars_of_a_train_line_a_summary_and_the_rest() -> None:
    row = {"kind": "train", "step": 7, "loss": 2.5, "lr": 1e-3, "clipped": True, "tokens": 512, "a2a_hidden_pct": None,
           "balancer": {"rank_balancedness": 0.8, "rebalance": {"before": 0.7, "after": 0.9, "applied": True}, "layers": [1, 2]}}
    assert scalars(row) == (7, {"train/loss": 2.5, "train/lr": 1e-3, "train/tokens": 512.0, "balancer/rank_balancedness": 0.8,
                                "balancer/rebalance/before": 0.7, "balancer/rebalance/after": 0.9})
    assert scalars({"kind": "summary", "steps": 9, "val_loss": 2.25, "tokens": 10}) == (9, {"val/loss": 2.25})
    assert scalars({"kind": "summary", "steps": 9, "val_loss": None}) is None  # a stopped run has none
    assert scalars({"kind": "diverged", "step": 3, "loss": "nan", "lr": 0.1}) is None


def test_tensorboard_without_its_package_is_refused_before_launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert log_problems(False) == [] and log_problems(True) == []
    monkeypatch.setitem(__import__("sys").modules, "tensorboard", None)  # as if not installed
    assert log_problems(True) == ["log.tensorboard: true needs the tensorboard package: pip install 'portapipe[tensorboard]'"]
    with pytest.raises(ConfigError, match=r"portapipe\[tensorboard\]"):
        check_before_launch(load_config({"log": {"tensorboard": True, "dir": str(tmp_path)}}))


def _config(log_dir: Path, steps: int):
    return load_config(
        {
            "backend": "cpu",
            "parallel": {"pp": 1, "ep": 2, "dp": 1},
            "schedule": {"name": "1f1b", "microbatches": 2},
            "model": {"hidden": 16, "n_layers": 2, "n_dense": 0, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 8,
                      "n_experts": 4, "top_k": 2, "seq_len": 16},
            "balancer": {"kind": "eplb", "interval": 2, "window": 2},
            "train": {"steps": steps, "micro_batch_size": 2, "warmup_steps": 1},
            "log": {"dir": str(log_dir), "progress": False, "tensorboard": True},
            "checkpoint": {"every": 2},
        }
    )


def _interrupted_then_resumed(backend, four: dict, five: dict) -> tuple[dict, dict]:
    """Train 4 steps; lose the step-4 checkpoint (an interruption after the JSONL and the event
    file got steps 3 and 4); resume to step 5 from step 2, which writes steps 3 and 4 again."""
    from portapipe.train import train_rank

    first = train_rank(backend, four)
    if backend.parallel_groups(1, 1, 2).rank == 0:
        shutil.rmtree(Path(four["log"]["dir"]) / "checkpoints" / "step_00000004")
    backend.barrier()
    return first, train_rank(backend, five)


@pytest.mark.multiproc
def test_scalars_equal_the_jsonl_across_a_resume(tmp_path: Path) -> None:
    from portapipe.ranks.launch import run_ranks

    log_dir = tmp_path / "run"
    check_before_launch(_config(log_dir, 4))
    first, resumed = run_ranks(_interrupted_then_resumed, 2, _config(log_dir, 4).to_dict(), _config(log_dir, 5).to_dict(), wall_timeout_s=240)[0]
    assert resumed["run_id"] == first["run_id"] and resumed["resumed_from"] == 2

    lines = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    expected = []
    for record in lines:
        found = scalars(record)
        if found is not None:
            expected += [(found[0], tag, value) for tag, value in found[1].items()]
    events = read_events(log_dir / TB_DIR / first["run_id"])  # the run id names the run
    assert sorted(events) == sorted(expected)  # every value bit for bit, each (step, tag) once
    assert not [k for k, n in Counter((s, t) for s, t, _ in events).items() if n > 1]
    tags = {t for _, t, _ in events}
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/bubble_pct", "val/loss",
                "balancer/rank_balancedness", "balancer/rebalance/after"):
        assert tag in tags, tag
    assert (5, "val/loss", resumed["val_loss"]) in events
    assert sorted(p.name for p in (log_dir / TB_DIR).iterdir()) == [first["run_id"]]
