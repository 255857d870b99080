"""`portapipe train` says at start what `portapipe plan` notes about the user's config, for the
keys the user set away from their defaults; a default that does nothing here stays quiet."""

from __future__ import annotations

import pytest

import portapipe.train

from .test_attacks_input import cli, train


@pytest.fixture()
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job is not started: the notes come before it."""
    monkeypatch.setattr(portapipe.train, "train", lambda config, **kw: {"steps": 0})


@pytest.mark.parametrize(
    "sets, note",
    [
        (["schedule.overlap=false", "schedule.pair_forwards=true"], "schedule.pair_forwards: schedule.overlap is false, so no forwards are paired"),
        (["parallel.ep=1", "parallel.pp=2", "balancer.kind=eplb"],
         "balancer.kind: eplb with ep = 1 keeps every expert on the one EP rank: there is no load between ranks to balance"),
        (["parallel.ep=1", "train.zero_stage=1"],
         "train.zero_stage: 1 shards over each weight's replicas, and with dp = ep = 1 every weight has one: nothing is sharded"),
    ],
)
def test_train_prints_the_notes_on_keys_the_user_set(tmp_path, capsys, no_training, sets: list[str], note: str) -> None:
    code, lines = cli(capsys, *train(tmp_path, *sets))
    assert code == 0 and lines == [f"portapipe: note: {note}"], lines


def test_a_default_that_does_nothing_stays_quiet(tmp_path, capsys, no_training) -> None:
    """examples/cpu.yaml writes `overlap: true`, the default: with one EP rank the plan notes it, train does not."""
    from portapipe.config import load_config
    from portapipe.config.rules import violations
    from portapipe.config.setup import Setup

    from .test_attacks_input import EXAMPLE

    assert any(n.startswith("schedule.overlap:") for n in violations(Setup.from_config(load_config(EXAMPLE, ["parallel.ep=1"])), severity="note"))
    code, lines = cli(capsys, *train(tmp_path, "parallel.ep=1"))
    assert code == 0 and lines == [], lines


def test_a_rank_of_torchrun_other_than_0_stays_quiet(tmp_path, capsys, no_training, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    code, lines = cli(capsys, *train(tmp_path, "schedule.overlap=false", "schedule.pair_forwards=true"))
    assert code == 0 and lines == []
