"""checkpoint.load from a folder whose run is still pruning: the checkpoint is read under a shared
lock on its folder, which pruning honours (it passes over it until the loading run ends); one
removed between its check and the hold is looked for again."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from portapipe.checkpoint import files
from portapipe.checkpoint.run import prepare_run
from portapipe.config import load_config

from .test_checkpoint_files import config

pytestmark = pytest.mark.multiproc


def _train(backend: Any, raw: dict[str, Any]) -> str:
    from portapipe.train import train_rank

    return train_rank(backend, raw)["run_id"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A finished one-rank run with checkpoints at steps 1, 2 and 3; its folder and run id."""
    from portapipe.ranks.launch import run_ranks

    run = tmp_path_factory.mktemp("hold") / "A"
    raw = config(run, steps=3, parallel__pp=1, schedule__name="1f1b")
    return run, run_ranks(_train, 1, raw, wall_timeout_s=300)[0]


@pytest.fixture
def source(trained: tuple[Path, str], tmp_path: Path) -> tuple[Path, str]:
    """A private copy of that run's folder, for its checkpoints to be pruned."""
    copy = tmp_path / "A"
    shutil.copytree(trained[0], copy, ignore=shutil.ignore_patterns(".portapipe.lock"))
    return copy, trained[1]


def _step(run: Path, step: int) -> Path:
    return files.step_dir(run / "checkpoints", step)


def _prepare(tmp_path: Path, load: Path) -> tuple[Any, Any, list[str]]:
    said: list[str] = []
    plan, locks = prepare_run(load_config(config(tmp_path / "B", steps=6, checkpoint__load=str(load))), "cpu", said.append)
    return plan, locks, said


def test_a_checkpoint_being_loaded_is_passed_over_by_pruning_until_the_loading_run_ends(source, tmp_path: Path) -> None:
    run, run_id = source
    plan, locks, _ = _prepare(tmp_path, _step(run, 2))
    assert plan.source == str(_step(run, 2))
    files.prune(run / "checkpoints", run_id, keep=1, newest=3)  # the source run moves on, keeping one
    assert not _step(run, 1).exists() and files.verify(_step(run, 2)).complete  # held: still whole
    locks.release()
    files.prune(run / "checkpoints", run_id, keep=1, newest=3)
    assert not _step(run, 2).exists() and _step(run, 3).is_dir()


def test_a_checkpoint_pruned_between_its_check_and_the_hold_is_looked_for_again(source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, run_id = source
    checked = files.resolve
    calls: list[Path] = []

    def resolve_then_prune(path: Path, warn: Any = None) -> files.Entry:
        entry = checked(path, warn)
        calls.append(entry.path)
        if len(calls) == 1:
            files.remove(entry.path)  # the source run pruned it right after it was checked
        return entry

    monkeypatch.setattr(files, "resolve", resolve_then_prune)
    plan, locks, said = _prepare(tmp_path, run)
    locks.release()
    assert calls == [_step(run, 3), _step(run, 2)] and plan.source == str(_step(run, 2))
    assert said[0] == f"checkpoint.load: {_step(run, 3)} was removed while it was checked (its run pruned it); looking again"
