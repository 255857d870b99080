"""Restarts after a fault (``launch.max_restarts``): how many within the window, how soon, what is
not retried, and what a restarted run starts from. The fault-injection suite (tests/test_faults.py)
shows whole runs restarted; these check the rules one at a time, mostly without ranks."""

from __future__ import annotations

import io
import json
import shutil
import signal
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

import portapipe.ranks.stop
from portapipe.checkpoint.files import CheckpointError, CheckpointFormatError, CheckpointWriteError, format_line
from portapipe.checkpoint.run import RunPlan, restart_plan
from portapipe.cli import main
from portapipe.config import ConfigError, load_config
from portapipe.data.sources import DataReadError
from portapipe.ranks.launch import run_ranks
from portapipe.ranks.local_job import LaunchError, error_types
from portapipe.ranks.restart import BACKOFF_CAP_S, Fault, Restart, Restarts
from portapipe.train import TrainingRestarts

from . import dist_checks

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"


class Clock:
    """Time that passes only when slept through or moved on."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


class Steps(Restarts):
    """A job whose restart ``i`` resumes from ``steps[i]``; its arguments count the launches."""

    def __init__(self, steps: list[int], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps, self.seen = steps, []

    def resume(self, restart: Restart) -> tuple[tuple[Any, ...], int]:
        self.seen.append(restart)
        return (restart.number,), self.steps[restart.number - 1]


def failing(times: int, clock: Clock, every_s: float = 0.0) -> Any:
    """A launch that fails its first ``times`` launches (``every_s`` apart), then returns its argument."""

    def launch(args: tuple[Any, ...]) -> list[Any]:
        clock.now += every_s
        if args[0] < times:
            raise LaunchError(f"rank 1 was killed by SIGKILL in launch {args[0]}", rank=1, traceback=f"rank 1 was killed by SIGKILL in launch {args[0]}")
        return [args[0]]

    return launch


def test_each_restart_is_one_line_with_the_cause_the_step_and_the_restarts_left(capsys) -> None:
    clock = Clock()
    job = Steps([5, 15], max_restarts=3, backoff_s=0.0, clock=clock, sleep=clock.sleep)
    assert job.run(failing(2, clock), (0,)) == [2]
    assert capsys.readouterr().err.splitlines() == [
        "portapipe: restart 1 (2 left): rank 1 was killed by SIGKILL in launch 0; resuming from step 5",
        "portapipe: restart 2 (1 left): rank 1 was killed by SIGKILL in launch 1; resuming from step 15",
    ]
    assert [(r.number, r.left, r.fault.line) for r in job.seen] == [(1, 2, "rank 1 was killed by SIGKILL in launch 0"),
                                                                    (2, 1, "rank 1 was killed by SIGKILL in launch 1")]


def test_past_max_restarts_the_last_cause_ends_the_job_saying_so(capsys) -> None:
    clock = Clock()
    job = Steps([5, 10], max_restarts=2, clock=clock, sleep=clock.sleep)
    with pytest.raises(LaunchError) as info:
        job.run(failing(3, clock), (0,))
    assert str(info.value) == "rank 1 was killed by SIGKILL in launch 2; not restarted: the 2 restarts of launch.max_restarts were used"
    assert info.value.rank == 1 and info.value.traceback == str(info.value)  # nothing more to show with log.level: debug
    assert len(capsys.readouterr().err.splitlines()) == 2


def test_the_window_counts_only_its_own_restarts() -> None:
    """Two restarts within any 100 s: faults 60 s apart go on for good, a burst of three stops."""
    clock = Clock()
    job = Steps(list(range(5, 100, 5)), max_restarts=2, window_s=100.0, clock=clock, sleep=clock.sleep)
    assert job.run(failing(6, clock, every_s=60.0), (0,)) == [6]
    clock = Clock()
    burst = Steps(list(range(5, 100, 5)), max_restarts=2, window_s=100.0, clock=clock, sleep=clock.sleep)
    with pytest.raises(LaunchError, match="not restarted: the 2 restarts of launch.max_restarts were used within launch.restart_window_s 100 s"):
        burst.run(failing(6, clock, every_s=10.0), (0,))


def test_the_backoff_doubles_while_restarts_resume_from_no_later_step_and_starts_over_on_progress(capsys) -> None:
    clock = Clock()
    job = Steps([5, 5, 5, 10, 10, 0], max_restarts=10, backoff_s=2.0, clock=clock, sleep=clock.sleep)
    job.run(failing(6, clock), (0,))
    waits = [float(line.rsplit(" in ", 1)[1].removesuffix(" s")) for line in capsys.readouterr().err.splitlines()]
    assert waits == [2, 4, 8, 2, 4, 8] and sum(clock.slept) == sum(waits)
    capped = Steps([5] * 12, max_restarts=12, backoff_s=2.0, clock=clock, sleep=clock.sleep)
    capped.run(failing(12, clock), (0,))
    assert max(float(line.rsplit(" in ", 1)[1].removesuffix(" s")) for line in capsys.readouterr().err.splitlines()) == BACKOFF_CAP_S


def test_a_stop_signal_while_waiting_to_restart_ends_the_job(monkeypatch, capsys) -> None:
    clock = Clock()
    monkeypatch.setattr(portapipe.ranks.stop, "installed", lambda: True)
    monkeypatch.setattr(portapipe.ranks.stop, "received", lambda: signal.SIGTERM if clock.now > 1.0 else None)
    job = Steps([5], max_restarts=3, backoff_s=10.0, clock=clock, sleep=clock.sleep)
    with pytest.raises(LaunchError) as info:
        job.run(failing(1, clock), (0,))
    assert str(info.value) == "stopped by SIGTERM while waiting to restart after: rank 1 was killed by SIGKILL in launch 0"
    assert info.value.stop_signal == signal.SIGTERM and clock.now < 2.0


def test_a_stop_signal_is_never_a_fault_to_restart() -> None:
    def stopped(args: tuple[Any, ...]) -> list[Any]:
        raise LaunchError("stopped by SIGINT before the ranks could stop gracefully", stop_signal=signal.SIGINT)

    with pytest.raises(LaunchError, match="^stopped by SIGINT before the ranks could stop gracefully$"):
        Steps([5], max_restarts=3).run(stopped, (0,))


# ------------------------------------------------------------------------- a training run's rules
@pytest.fixture
def training(tmp_path) -> TrainingRestarts:
    config = load_config(EXAMPLE, [f"log.dir={tmp_path}", "launch.max_restarts=2"])
    return TrainingRestarts(config, RunPlan(run_id="r", root=str(tmp_path / "checkpoints"), mode="new"))


@pytest.mark.parametrize("exc, why", [
    (ConfigError(["model.hidden: bad"]), "a config error fails every launch alike"),
    (CheckpointError("manifest.json lacks 'step'"), "the checkpoint cannot be read"),
    (CheckpointFormatError("written by a newer portapipe"), "the checkpoint cannot be read"),
    (DataReadError("data.path: cannot read 'x.txt'"), "the data cannot be read"),
    (FileNotFoundError(2, "No such file or directory", "/data/shard_07.bin"), "a file the run reads is gone"),
    (CheckpointWriteError("checkpoint x could not be written: no space left on device"), None),  # the disk may have room next time
    (RuntimeError("Connection closed by peer"), None),
])
def test_what_a_restart_cannot_fix_is_named_by_the_errors_class(training, exc, why) -> None:
    err = LaunchError(f"rank 0 failed: {exc}", rank=0, error_types=error_types(exc))
    assert training.unrecoverable(err) == why


def test_an_unrecoverable_error_ends_the_job_at_once_saying_why(training) -> None:
    def gone(args: tuple[Any, ...]) -> list[Any]:
        exc = FileNotFoundError(2, "No such file or directory", "/data/shard_07.bin")
        raise LaunchError(f"rank 3 failed: FileNotFoundError: {exc}", rank=3, error_types=error_types(exc))

    with pytest.raises(LaunchError) as info:
        training.run(gone, (0,))
    assert str(info.value) == ("rank 3 failed: FileNotFoundError: [Errno 2] No such file or directory: '/data/shard_07.bin'; "
                               "not restarted: a file the run reads is gone")


def test_a_divergence_is_restarted_once_and_marked_deterministic_when_it_recurs_at_the_same_step(training) -> None:
    first = [{"diverged": {"step": 7, "loss": None, "grad_norm": None}}]
    assert training.fault_in(first) == Fault("the run diverged at step 7: loss not finite, grad norm not finite")
    later = [{"diverged": {"step": 9, "reason": "the validation loss is nan"}}]
    assert training.fault_in(later) == Fault("the run diverged at step 9: the validation loss is nan")
    again = [{"diverged": {"step": 7, "loss": None, "grad_norm": 3.0}}]
    assert training.fault_in(again) is None and again[0]["diverged"]["deterministic"] is True
    assert training.fault_in([{"final_loss": 2.0}]) is None


@pytest.mark.multiproc
def test_a_rank_error_is_restarted_and_its_class_reaches_the_launcher(tmp_path, capsys) -> None:
    class Named(Restarts):
        def resume(self, restart: Restart) -> tuple[tuple[Any, ...], int]:
            return (str(tmp_path), ["RuntimeError", "FileNotFoundError"]), 0

        def unrecoverable(self, error: LaunchError) -> str | None:
            return "gone" if "FileNotFoundError" in error.error_types else None

    with pytest.raises(LaunchError) as info:
        run_ranks(dist_checks.fail_by_launch, 2, str(tmp_path), ["RuntimeError", "FileNotFoundError"], restarts=Named(3))
    assert str(info.value) == "rank 1 failed: FileNotFoundError: launch 1 fails; not restarted: gone"
    assert info.value.error_types[:3] == ("FileNotFoundError", "OSError", "Exception")
    assert capsys.readouterr().err.splitlines() == ["portapipe: restart 1 (2 left): rank 1 failed: RuntimeError: launch 0 fails; resuming from step 0"]
    (tmp_path / "next").mkdir()
    assert run_ranks(dist_checks.fail_by_launch, 2, str(tmp_path / "next"), [], restarts=Named(3)) == [0, 0]


# --------------------------------------------------------------------------- what a restart reads
MODEL = {"hidden": 16, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2, "seq_len": 16}


def one_rank(log_dir: Path, **train: Any) -> dict[str, Any]:
    return {"backend": "cpu", "parallel": {"pp": 1, "ep": 1, "dp": 1}, "schedule": {"name": "1f1b", "microbatches": 2},
            "model": {**MODEL, "dtype": "float32"}, "train": {"steps": 8, "micro_batch_size": 2, **train}, "data": {"val_fraction": 0.0},
            "log": {"dir": str(log_dir), "progress": False}, "checkpoint": {"every": 1, "keep": 8},
            "launch": {"max_restarts": 2, "restart_backoff_s": 0.0}}


@pytest.fixture(scope="module")
def diverging(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run whose learning rate makes it diverge, the same way in every launch."""
    folder = tmp_path_factory.mktemp("diverging")
    path = folder / "config.json"
    path.write_text(json.dumps(one_rank(folder / "run", lr=1e30, warmup_steps=0, grad_clip=0.0)))
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(out), redirect_stderr(err):
        mp.delenv("PORTAPIPE_DEBUG", raising=False)
        code = main(["train", str(path)])
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"code": code, "lines": err.getvalue().splitlines(), "summary": json.loads(out.getvalue()), "rows": rows, "dir": folder / "run"}


@pytest.mark.multiproc
def test_a_divergence_that_recurs_at_its_step_after_a_restart_ends_the_run_as_diverged(diverging) -> None:
    summary, step = diverging["summary"], diverging["summary"]["diverged"]["step"]
    assert diverging["code"] == 3 and summary["diverged"]["deterministic"] is True and summary["restarts"] == 1
    restarts = [r for r in diverging["rows"] if r.get("kind") == "restart"]
    assert [(r["step"], r["restart"], r["restarts_left"]) for r in restarts] == [(step - 1, 1, 1)]
    lines = diverging["lines"]
    assert len(lines) == 2 and lines[0].startswith(f"portapipe: restart 1 (1 left): the run diverged at step {step}: ")
    assert lines[0].endswith(f"; resuming from step {step - 1}")
    assert lines[1].startswith(f"portapipe: training stopped at step {step}: ") and lines[1].endswith(
        "; it recurred at that step after a restart from the last checkpoint: the divergence is deterministic, not a fault "
        f"(last checkpoint: {diverging['dir'] / 'checkpoints' / f'step_{step - 1:08d}'}); lower train.lr or turn train.grad_clip on (it is 0: off)")


@pytest.mark.multiproc
def test_a_restart_resumes_the_runs_newest_complete_checkpoint_and_clears_the_saves_cut_short(diverging, tmp_path, capsys) -> None:
    root, config = diverging["dir"] / "checkpoints", load_config(diverging["dir"].parent / "config.json")
    run_id = json.loads((diverging["dir"] / "run.json").read_text())["run_id"]
    first = RunPlan(run_id=run_id, root=str(root), mode="new", lr_schedule_steps=None)
    newest = int(sorted(p.name for p in root.glob("step_*"))[-1][5:])
    cut_short = root / f".step_{newest + 1:08d}.{run_id}.tmp"
    cut_short.mkdir()
    plan = restart_plan(config, first, 2)
    assert (plan.mode, plan.step, plan.source, plan.restarts, plan.run_id) == ("resume", newest, str(root / f"step_{newest:08d}"), 2, run_id)
    assert plan.first == {"mode": "new", "source": None, "step": 0} and not cut_short.exists()
    assert capsys.readouterr().err == ""  # the launcher's restart line says it all
    elsewhere = RunPlan(run_id="another-run", root=str(tmp_path), mode="load", source="/elsewhere/step_00000004", step=4)
    assert restart_plan(config, elsewhere, 1) == RunPlan(**{**elsewhere.to_dict(), "restarts": 1})  # none of its own yet: as it began


# -------------------------------------------------------------------------------- configuration
def test_the_restart_keys_are_refused_where_nothing_restarts() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, ["launch.restart_window_s=3600", "launch.restart_backoff_s=5"])
    assert info.value.problems == [
        "launch.restart_window_s: 3600 has no effect: launch.max_restarts is 0 (a fault ends the run); set launch.max_restarts, or remove it",
        "launch.restart_backoff_s: 5 has no effect: launch.max_restarts is 0 (a fault ends the run); set launch.max_restarts, or remove it",
    ]
    c = load_config(EXAMPLE, ["launch.max_restarts=3", "launch.restart_window_s=3600"]).launch
    assert (c.max_restarts, c.restart_window_s, c.restart_backoff_s) == (3, 3600.0, 1.0)
    with pytest.raises(ConfigError, match="launch.max_restarts"):
        load_config(EXAMPLE, ["launch.max_restarts=-1"])


# ------------------------------------------------------------------ checkpoints of other versions
@pytest.mark.parametrize("found, line", [
    ("portapipe-dcp/2", "written by a newer portapipe (manifest format 'portapipe-dcp/2'; this version reads 'portapipe-dcp/1'): read it with that version"),
    ("portapipe-dcp/0", "written by an older portapipe (manifest format 'portapipe-dcp/0'; this version reads 'portapipe-dcp/1'): read it with that version"),
    (None, "written by an older portapipe (a manifest without a format: one pickle per rank, bound to its layout; this version reads "
           "'portapipe-dcp/1'): read it with that version"),
    ("safetensors", "manifest.json is not a portapipe-dcp/1 manifest (format 'safetensors')"),
])
def test_a_manifest_of_another_format_says_which_portapipe_wrote_it(found, line) -> None:
    assert format_line(found) == line


@pytest.mark.multiproc
@pytest.mark.parametrize("found, which", [("portapipe-dcp/2", "a newer"), (None, "an older")])
def test_resuming_or_loading_a_checkpoint_of_another_version_is_one_line_and_never_passed_over(diverging, tmp_path, capsys, found, which) -> None:
    run = tmp_path / "run"
    shutil.copytree(diverging["dir"], run)
    root = run / "checkpoints"
    newest = sorted(root.glob("step_*"))[-1]
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest.pop("format") if found is None else manifest.update(format=found)
    (newest / "manifest.json").write_text(json.dumps(manifest))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(one_rank(run)))
    capsys.readouterr()
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"portapipe: config error: checkpoint.resume: checkpoint {newest} was written by {which} portapipe " + err[0].split(f"{which} portapipe ", 1)[1]]
    assert err[0].endswith(f": read it with that version, or move it out of {root} to resume from the checkpoint before it")
    assert sorted(root.glob("step_*"))[-1] == newest and json.loads((newest / "manifest.json").read_text()) == manifest  # nothing written
    config.write_text(json.dumps({**one_rank(tmp_path / "other"), "checkpoint": {"load": str(newest)}}))
    assert main(["train", str(config)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"portapipe: config error: checkpoint.load: {newest} was written by {which} portapipe "
                                                    + err[0].split(f"{which} portapipe ", 1)[1].split(", or move it")[0]]
