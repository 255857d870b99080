"""`portapipe train`: bad input exits 2 before any rank starts; arguments reach the ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import portapipe.ranks.launch
from portapipe.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if anything tries to start ranks."""

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started although the input was bad")

    monkeypatch.setattr(portapipe.ranks.launch, "run_ranks", refuse)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.world_size=6"], "parallel.world_size: 6 != pp*ep*dp = 2*2*1 = 4"),
        (["schedule.microbatches=3"], "schedule.microbatches: 3 < 2*pp = 4, the minimum for dualpipev"),
        (["model.n_layers=3"], "model.n_layers: 3 < 4 model blocks"),
        (["data.path=/nonexistent/corpus.txt"], "data.path: '/nonexistent/corpus.txt' does not exist"),
        (["train.lr=-1"], "train.lr: -1: Input should be greater than 0"),
    ],
)
def test_bad_input_exits_2_before_ranks_start(no_ranks, capsys, tmp_path, overrides, expected):
    args = ["train", str(EXAMPLE), "--set", f"log.dir={tmp_path}"]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert expected in err, err


def test_steps_flag_and_overrides_reach_the_ranks_and_the_summary_is_one_json_line(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake_run_ranks(fn, world_size, config_dict, plan, **kwargs):
        seen.update(fn=fn.__name__, world_size=world_size, config=config_dict, plan=plan, kwargs=kwargs)
        return [{"first_loss": 5.5, "final_loss": 2.5, "rank": r} for r in range(world_size)]

    monkeypatch.setattr(portapipe.ranks.launch, "run_ranks", fake_run_ranks)
    code = main(["train", str(EXAMPLE), "--steps", "7", "--set", "train.lr=0.01", "--set", f"log.dir={tmp_path}"])
    assert code == 0
    assert seen["fn"] == "train_rank" and seen["world_size"] == 4
    assert seen["config"]["train"]["steps"] == 7 and seen["config"]["train"]["lr"] == 0.01
    assert seen["kwargs"]["backend"] == "cpu" and seen["kwargs"]["threads"] >= 1
    assert seen["plan"]["mode"] == "new" and seen["plan"]["root"] == str(tmp_path / "checkpoints")
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and json.loads(out[0]) == {"first_loss": 5.5, "final_loss": 2.5, "rank": 0}


def test_a_failing_rank_exits_1_with_its_traceback(monkeypatch, capsys, tmp_path):
    def failing_run_ranks(fn, world_size, *args, **kwargs):
        raise portapipe.ranks.launch.LaunchError("rank 2 failed:\nTraceback ...\nValueError: boom", rank=2, traceback="ValueError: boom")

    monkeypatch.setattr(portapipe.ranks.launch, "run_ranks", failing_run_ranks)
    assert main(["train", str(EXAMPLE), "--set", f"log.dir={tmp_path}"]) == 1
    captured = capsys.readouterr()
    assert "rank 2 failed" in captured.err and "ValueError: boom" in captured.err
    assert captured.out == ""
