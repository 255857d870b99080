"""What a new user met when resuming runs, each case through ``portapipe train`` only.

Every case runs the CLI in this process and reads only what a user sees: exit codes, stderr
lines, the summary and ``metrics.jsonl``, and the run folder's files (damaged without knowing
their format: a checkpoint is a ``step_NNNNNNNN`` folder of parts and a ``.json`` manifest). The
expected losses are those the same runs printed before the interruption, so a resume must give
them back: bit for bit on the same layout, within 1e-9 (float64) on another.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from portapipe.cli import main
from tests.test_checkpoint_run import raw as run_config


def raw(log_dir: Path, steps: int, **over: Any) -> dict[str, Any]:
    """test_checkpoint_run's run on 2 pipeline ranks, a checkpoint every step, four kept."""
    return run_config(log_dir, steps, pp=2, **{"checkpoint__every": 1, "checkpoint__keep": 4, **over})


def train(capsys: pytest.CaptureFixture[str], config: dict[str, Any], *args: str) -> tuple[int, list[str], dict[str, Any] | None]:
    """``portapipe train`` on ``config``: exit code, its ``portapipe:`` lines (no traceback allowed), summary."""
    path = Path(config["log"]["dir"]).parent / f"{Path(config['log']['dir']).name}.json"
    path.write_text(json.dumps(config))  # JSON is YAML
    code = main(["train", str(path), *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("portapipe:")]
    summary = json.loads(out.splitlines()[-1]) if out.strip() else None
    return code, lines, summary


def losses(log_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}


def train_rows(log_dir: Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == "train"]


def step_dir(log_dir: Path, step: int) -> Path:
    return log_dir / "checkpoints" / f"step_{step:08d}"


def parts(d: Path) -> list[Path]:
    """A checkpoint's data files (everything but its JSON manifest), by name."""
    return sorted(p for p in d.iterdir() if p.is_file() and p.suffix != ".json")


def copy_run(src: Path, dst: Path, drop_after: int | None = None) -> Path:
    """A copy of a run folder, without its checkpoints after step ``drop_after``."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".portapipe.lock"))
    if drop_after is not None:
        for d in (dst / "checkpoints").iterdir():
            if d.name.startswith("step_") and int(d.name[5:]) > drop_after:
                shutil.rmtree(d)
    return dst


def retarget(config: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    return {**config, "log": {**config["log"], "dir": str(log_dir)}}


# ---------------------------------------------------------------------------- shared runs
@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A finished run on pp 2: 4 steps, a checkpoint after each."""
    root = tmp_path_factory.mktemp("tried")
    config = raw(root / "run", steps=4)
    assert main(["train", _write(root / "run.json", config)]) == 0
    return {"config": config, "dir": root / "run", "losses": losses(root / "run")}


def _write(path: Path, config: dict[str, Any]) -> str:
    path.write_text(json.dumps(config))
    return str(path)


# ----------------------------------------------------------------------- one run per folder
@pytest.mark.multiproc
def test_a_shorter_run_in_a_finished_runs_folder_is_refused_then_moved_aside_never_mixed(finished, tmp_path, capsys):
    """`portapipe train ... --steps 2` after a finished 4-step run in the same folder, then the
    old README's way out (`checkpoint.resume=false`), then the new one (`checkpoint.overwrite`)."""
    run = copy_run(finished["dir"], tmp_path / "run")
    config = retarget(finished["config"], run)
    code, lines, _ = train(capsys, config, "--steps", "2")
    assert code == 2 and len(lines) == 1, lines

    code, lines, _ = train(capsys, config, "--steps", "2", "--set", "checkpoint.resume=false")
    assert code == 2 and len(lines) == 1, lines  # would drop the new run's checkpoints and mix the metrics
    assert str(run / "checkpoints") in lines[0] and "checkpoint.overwrite: true" in lines[0]

    code, lines, summary = train(capsys, config, "--steps", "2", "--set", "checkpoint.resume=false", "--set", "checkpoint.overwrite=true")
    assert code == 0 and summary is not None, lines
    assert Path(summary["checkpoint"]).is_dir() and Path(summary["checkpoint"]).name == "step_00000002"
    assert sorted(d.name for d in (run / "checkpoints").iterdir() if d.name.startswith("step_")) == ["step_00000001", "step_00000002"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2] and [r["kind"] for r in rows].count("summary") == 1

    code, lines, again = train(capsys, config, "--steps", "3")  # the next run continues the new run, not the old one
    assert code == 0 and again is not None and again["resumed_from"] == 2 and again["run_id"] == summary["run_id"]


# ------------------------------------------------------------------------------------ damage
def _truncate(d: Path) -> None:
    f = max(parts(d), key=lambda p: p.stat().st_size)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage_part(d: Path) -> None:
    f = max(parts(d), key=lambda p: p.stat().st_size)
    size = f.stat().st_size
    f.write_bytes((b"\x00garbage" * size)[:size])


def _garbage_manifest(d: Path) -> None:
    for f in d.glob("*.json"):
        f.write_bytes(b"{not json\xff")


def _missing_part(d: Path) -> None:
    max(parts(d), key=lambda p: p.stat().st_size).unlink()


@pytest.mark.multiproc
@pytest.mark.parametrize("damage", [_truncate, _garbage_part, _garbage_manifest, _missing_part], ids=lambda f: f.__name__[1:])
def test_a_damaged_newest_checkpoint_is_named_in_one_line_and_the_previous_one_resumed(finished, tmp_path, capsys, damage):
    run = copy_run(finished["dir"], tmp_path / "run")
    damage(step_dir(run, 4))
    code, lines, summary = train(capsys, retarget(finished["config"], run), "--steps", "5")
    assert code == 0 and summary is not None and summary["resumed_from"] == 3, lines
    named = [line for line in lines if "step_00000004" in line]
    assert len(named) == 1, lines
    assert losses(run)[4] == finished["losses"][4]  # step 4 trained again from step 3: as the first time


def _old_and_new_parts(old: Path, new: Path) -> None:
    """A save of step 4 over an older run's step 4, killed after all parts but the last: the old
    manifest stays, beside the new run's parts and one old part."""
    for f in parts(new)[:-1]:
        shutil.copy(f, old / f.name)


@pytest.mark.multiproc
def test_a_save_over_an_older_runs_checkpoint_killed_half_way_is_not_resumed(finished, tmp_path, capsys):
    other = tmp_path / "other"
    code, lines, _ = train(capsys, raw(other, steps=4, train__lr=2e-2))
    assert code == 0, lines
    run = copy_run(finished["dir"], tmp_path / "run")
    _old_and_new_parts(step_dir(run, 4), step_dir(other, 4))
    code, lines, summary = train(capsys, retarget(finished["config"], run), "--steps", "5")
    assert code == 0 and summary is not None and summary["resumed_from"] == 3, lines
    assert len([line for line in lines if "step_00000004" in line]) == 1, lines
    assert losses(run)[4] == finished["losses"][4]


# ------------------------------------------------------------------------ another layout
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "change",
    [
        ("parallel.pp=1", "parallel.dp=2", "schedule.microbatches=1"),  # the same 4 sequences a step
        ("schedule.name=zb1p",),
    ],
    ids=["pp2-to-dp2", "1f1b-to-zb1p"],
)
def test_a_resume_on_another_pp_dp_or_schedule_continues_with_the_same_losses(finished, tmp_path, capsys, change):
    run = copy_run(finished["dir"], tmp_path / "run", drop_after=2)
    sets = [arg for item in change for arg in ("--set", item)]
    code, lines, summary = train(capsys, retarget(finished["config"], run), *sets)
    assert code == 0 and summary is not None and summary["resumed_from"] == 2, lines
    got = losses(run)
    assert max(abs(got[s] - finished["losses"][s]) for s in (3, 4)) <= 1e-9


# ------------------------------------------------------------------------------ balancer
@pytest.fixture(scope="module")
def rebalanced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An EPLB run on ep 2 whose placement is rebalanced after step 2: 6 steps, checkpoints at 3 and 6."""
    root = tmp_path_factory.mktemp("eplb")
    config = raw(root / "run", steps=6, parallel__pp=1, parallel__ep=2, checkpoint__every=3)
    config["model"]["n_experts"] = 8
    config["balancer"] = {"kind": "eplb", "interval": 2, "window": 2}
    assert main(["train", _write(root / "run.json", config)]) == 0
    return {"config": config, "dir": root / "run", "losses": losses(root / "run")}


@pytest.mark.multiproc
@pytest.mark.parametrize("balancer", [{"kind": "none"}, {"kind": "eplb", "interval": 2, "window": 2, "redundant": 1}], ids=["none", "redundant"])
def test_a_rebalanced_eplb_run_resumes_under_another_balancer_with_the_same_losses(rebalanced, tmp_path, capsys, balancer):
    run = copy_run(rebalanced["dir"], tmp_path / "run", drop_after=3)
    config = {**retarget(rebalanced["config"], run), "balancer": balancer}
    code, lines, summary = train(capsys, config)
    assert code == 0 and summary is not None and summary["resumed_from"] == 3, lines
    got = losses(run)
    assert max(abs(got[s] - rebalanced["losses"][s]) for s in (4, 5, 6)) <= 1e-9


# ----------------------------------------------------------------------------- LR schedule
@pytest.mark.multiproc
def test_20_steps_then_the_same_command_to_40_trains_as_40_straight_and_says_its_lr_schedule(tmp_path, capsys):
    once = {"parallel__pp": 1, "checkpoint__every": 0}
    code, _, _ = train(capsys, raw(tmp_path / "straight", steps=40, **once))
    assert code == 0
    code, _, _ = train(capsys, raw(tmp_path / "run", steps=20, **once))
    assert code == 0
    code, lines, summary = train(capsys, raw(tmp_path / "run", steps=40, **once))
    assert code == 0 and summary is not None and summary["resumed_from"] == 20, lines
    assert len([line for line in lines if "LR schedule" in line]) == 1, lines
    keys = ("step", "loss", "lr", "grad_norm")
    got, want = train_rows(tmp_path / "run"), train_rows(tmp_path / "straight")
    assert [tuple(r[k] for k in keys) for r in got] == [tuple(r[k] for k in keys) for r in want]
