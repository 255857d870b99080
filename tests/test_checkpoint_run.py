"""One run per folder, what a run starts from, the LR schedule on resume, stops and divergence.

Small float64 runs on 1 or 2 gloo ranks through ``portapipe train`` (the CLI, in this process) or
``train_rank``; what is decided before any rank starts is checked without starting ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import portapipe.ranks.launch
from portapipe.checkpoint import list_checkpoints
from portapipe.checkpoint.folders import FolderLock
from portapipe.checkpoint.run import prepare_run
from portapipe.cli import main
from portapipe.config import ConfigError, load_config

MODEL = {"hidden": 16, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2,
         "seq_len": 16, "dtype": "float64"}


def raw(log_dir: Path, steps: int = 4, pp: int = 1, **over: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "backend": "cpu",
        "parallel": {"pp": pp, "ep": 1, "dp": 1},
        "schedule": {"name": "1f1b", "microbatches": 2},
        "model": dict(MODEL),
        "train": {"steps": steps, "micro_batch_size": 2, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2},
        "data": {"val_fraction": 0.0},
        "log": {"dir": str(log_dir), "progress": False},
        "checkpoint": {"every": 2, "keep": 2},
    }
    for key, value in over.items():
        section, _, name = key.partition("__")
        out[section][name] = value
    return out


def write_config(path: Path, config: dict[str, Any]) -> str:
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


def rows(log_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def train_rows(log_dir: Path) -> list[dict[str, Any]]:
    return [r for r in rows(log_dir) if r["kind"] == "train"]


def same_steps(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """Rows of two runs agree bit for bit in what training computes."""
    keys = ("step", "loss", "lr", "grad_norm", "clipped")
    assert [tuple(r[k] for k in keys) for r in a] == [tuple(r[k] for k in keys) for r in b]


@pytest.fixture
def no_ranks(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started although the run must not start")

    monkeypatch.setattr(portapipe.ranks.launch, "run_ranks", refuse)


def _one_rank_runs(backend: Any, root: str) -> dict[str, Any]:
    """Every single-rank run the tests below read, in one launch (each its own folder)."""
    from portapipe.train import train_rank

    base = Path(root)
    once = {"checkpoint__every": 0}  # the final checkpoint is the one resumed
    diverging = raw(base / "diverged", steps=8, train__lr=1e30, train__warmup_steps=0, train__grad_clip=0.0, checkpoint__every=1)
    diverging["model"]["dtype"] = "float32"
    # train.lr_schedule's second phase diverges where train.lr would not: the hint names the phase
    phased = raw(base / "phase_diverged", steps=8, train__grad_clip=0.0, train__lr_schedule=[
        {"kind": "constant", "steps": 2, "lr": 1e-3}, {"kind": "constant", "steps": 6, "lr": 1e30}])
    phased["model"]["dtype"] = "float32"
    del phased["train"]["warmup_steps"], phased["train"]["min_lr"]  # the phases say it all
    # float16, one step whose update leaves float32 master weights of 1e5, which the parameters cannot hold (inf);
    # one that leaves weights of 3e4, finite, on which the validation's forward overflows
    weights_inf = raw(base / "weights_inf", steps=1, train__lr=1e5, train__warmup_steps=0, train__grad_clip=0.0, data__val_fraction=0.05)
    val_nan = raw(base / "val_nan", steps=1, train__lr=3e4, train__warmup_steps=0, train__grad_clip=0.0, data__val_fraction=0.05)
    # the same update before a periodic checkpoint (step 1 of 2): checked there too
    weights_inf_every = raw(base / "weights_inf_every", steps=2, train__lr=1e5, train__warmup_steps=0, train__grad_clip=0.0, checkpoint__every=1)
    for c in (weights_inf, val_nan, weights_inf_every):
        c["model"]["dtype"] = "float16"
    runs = {
        "first": raw(base / "first"),  # a finished run: 4 steps, checkpoints at 2 and 4
        "straight": raw(base / "straight", steps=40, **once),  # the default schedule: no decay
        "default": raw(base / "default", steps=20, **once),
        "default_40": raw(base / "default", steps=40, **once),
        "cosine": raw(base / "cosine", steps=40, train__lr_schedule_steps=40, **once),
        "planned": raw(base / "planned", steps=20, train__lr_schedule_steps=40, **once),
        "planned_40": raw(base / "planned", steps=40, **once),
        "short": raw(base / "short", steps=20, train__lr_schedule_steps=20, **once),
        "asked": raw(base / "asked", steps=40, train__lr_schedule_steps=40, checkpoint__load=str(base / "short" / "checkpoints" / "step_00000020"), **once),
        "short_40": raw(base / "short", steps=40, **once),
        "diverged": diverging,
        "phase_diverged": phased,
        "weights_inf": weights_inf,
        "weights_inf_every": weights_inf_every,
        "val_nan": val_nan,
        "no_end": raw(base / "no_end", steps=3, checkpoint__at_end=False),  # every 2: step 2's only
        "none": raw(base / "none", steps=1, checkpoint__every=0, checkpoint__at_end=False),
    }
    return {name: train_rank(type(backend)(backend.options), config) for name, config in runs.items()}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from portapipe.ranks.launch import run_ranks

    root = tmp_path_factory.mktemp("one_rank")
    out = run_ranks(_one_rank_runs, 1, str(root), wall_timeout_s=300)[0]
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def first_run(one_rank: dict[str, Any]) -> Path:
    return one_rank["root"] / "first"


@pytest.fixture(scope="module")
def horizons(one_rank: dict[str, Any]) -> Path:
    return one_rank["root"]


@pytest.fixture
def used(first_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(first_run, copy, ignore=shutil.ignore_patterns(".portapipe.lock"))
    return copy


def _errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("portapipe:")]


# ---------------------------------------------------------------------- one run per folder
@pytest.mark.multiproc
def test_a_new_run_in_a_used_folder_is_refused_then_moves_the_old_run_aside(used, tmp_path, capsys):
    """The README path: a finished run in the folder, then a shorter run asked for in the same folder."""
    old = json.loads((used / "run.json").read_text())["run_id"]
    config = write_config(tmp_path / "c.yaml", raw(used))
    assert main(["train", config, "--steps", "2"]) == 2
    (line,) = _errors(capsys)
    assert "train.steps: 2 is below step 4 of" in line and "checkpoint.overwrite: true" in line

    assert main(["train", config, "--steps", "2", "--set", "checkpoint.resume=false"]) == 2
    (line,) = _errors(capsys)
    assert f"checkpoint.resume: false, but {used / 'checkpoints'} holds run {old}'s checkpoints (newest step_00000004)" in line
    assert "use another log.dir, or checkpoint.overwrite: true" in line

    assert main(["train", config, "--steps", "2", "--set", "checkpoint.resume=false", "--set", "checkpoint.overwrite=true"]) == 0
    summary = json.loads(capsys.readouterr().out)
    new = summary["run_id"]
    assert new != old and Path(summary["checkpoint"]) == used / "checkpoints" / "step_00000002"
    listed = list_checkpoints(used)
    assert [(e["step"], e["run_id"], e["complete"]) for e in listed] == [(2, new, True)]  # the new run's final checkpoint kept
    assert [r["step"] for r in train_rows(used)] == [1, 2] and rows(used)[-1]["run_id"] == new  # metrics of one run
    aside = used / "previous" / old
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert [r["step"] for r in train_rows(aside)] == [1, 2, 3, 4]

    said: list[str] = []
    plan, locks = prepare_run(load_config(raw(used, steps=2)), "cpu", said.append)  # the next run resumes the new run
    locks.release()
    assert (plan.mode, plan.run_id, plan.step) == ("resume", new, 2) and "nothing left to train" in said[0]


def test_leftovers_of_a_run_without_checkpoints_are_moved_aside_with_a_note(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')
    (tmp_path / "run.json").write_text('{"run_id": "crashed-early"}')
    said: list[str] = []
    plan, locks = prepare_run(load_config(raw(tmp_path)), "cpu", said.append)
    locks.release()
    assert plan.mode == "new" and plan.run_id != "crashed-early"
    assert (tmp_path / "previous" / "crashed-early" / "metrics.jsonl").is_file() and not (tmp_path / "metrics.jsonl").exists()
    assert len(said) == 1 and "wrote no checkpoint" in said[0]
    assert json.loads((tmp_path / "run.json").read_text())["run_id"] == plan.run_id


@pytest.mark.multiproc
def test_a_checkpoint_of_another_model_or_data_stream_is_refused_naming_the_key(used, tmp_path, capsys, no_ranks):
    config = write_config(tmp_path / "c.yaml", raw(used, steps=8))
    assert main(["train", config, "--set", "model.hidden=32"]) == 2
    (line,) = _errors(capsys)
    assert line.startswith("portapipe: config error: model.hidden: 32 (the checkpoint has 16); ") and "was written for another model" in line
    assert main(["train", config, "--set", "model.hidden=32", "--set", "model.n_layers=3"]) == 2
    (line,) = _errors(capsys)
    assert "model.hidden: 32 (the checkpoint has 16), model.n_layers: 3 (the checkpoint has 2); " in line
    assert main(["train", config, "--set", "model.arch=qwen3_moe"]) == 2  # another architecture: named alone
    (line,) = _errors(capsys)
    assert line.startswith("portapipe: config error: model.arch: 'qwen3_moe' (the checkpoint has 'portapipe'); ") and "model.n_" not in line
    assert main(["train", config, "--set", "train.micro_batch_size=4"]) == 2
    (line,) = _errors(capsys)
    assert "the global batch is 8 sequences (dp 1 x ep 1 x 2 micro-batches x 4)" in line and "trained with 4; keep 4" in line
    assert main(["train", config, "--set", "train.seed=7"]) == 2
    (line,) = _errors(capsys)
    assert "train.seed: 7, but" in line and "seed 1234" in line


@pytest.mark.multiproc
def test_a_resume_on_other_training_text_is_refused_unless_allowed(used, tmp_path, capsys, no_ranks):
    """The checkpoint records its sources; other data would silently continue on other batches."""
    from portapipe.data.shipped import DEFAULT_CORPUS

    text = tmp_path / "other.txt"
    text.write_text("Another text, long enough for a few windows of sixteen bytes. " * 20)
    config = write_config(tmp_path / "c.yaml", raw(used, steps=8, data__path=str(text)))
    assert main(["train", config]) == 2
    (line,) = _errors(capsys)
    assert line == (f"portapipe: config error: data.sources[0]: {text} is not the data the checkpoint was trained on ({DEFAULT_CORPUS}, "
                    f"{_tokens(used)} tokens; its files differ); {used / 'checkpoints' / 'step_00000004'}'s run would go on with other "
                    "batches than it would have seen: restore its data, or set data.allow_changed_sources: true")
    said: list[str] = []
    plan, locks = prepare_run(load_config(raw(used, steps=8, data__path=str(text), data__allow_changed_sources=True)), "cpu", said.append)
    locks.release()
    assert plan.mode == "resume" and [line for line in said if line.startswith("data:")] == [
        f"data: data.sources[0]: {text} is not the data the checkpoint was trained on ({DEFAULT_CORPUS}, {_tokens(used)} tokens; "
        "its files differ); data.allow_changed_sources: true, so the batches from here differ from an uninterrupted run's"
    ]
    plan, locks = prepare_run(load_config(raw(used, steps=8)), "cpu", said.append)  # the same data: no word of it
    locks.release()
    assert plan.mode == "resume" and len([line for line in said if line.startswith("data:")]) == 1


def _tokens(run: Path) -> int:
    manifest = json.loads((run / "checkpoints" / "step_00000004" / "manifest.json").read_text())
    return manifest["trainer"]["data"]["sources"][0]["tokens"]


def test_a_second_run_on_a_locked_folder_exits_2_naming_the_holder(tmp_path, capsys, no_ranks):
    lock = FolderLock(tmp_path, "log.dir")
    lock.acquire(lambda line: None)
    try:
        assert main(["train", write_config(tmp_path / "c.yaml", raw(tmp_path))]) == 2
    finally:
        lock.release()
    (line,) = _errors(capsys)
    assert line == f"portapipe: config error: log.dir: {tmp_path} is in use by another run (pid {os.getpid()}); wait for it to end or use another log.dir"


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for folder in (tmp_path, tmp_path / "checkpoints"):  # a run locks its log.dir and its checkpoint folder
        folder.mkdir(exist_ok=True)
        (folder / ".portapipe.lock").write_text(f"{dead.pid}\n")
    said: list[str] = []
    plan, locks = prepare_run(load_config(raw(tmp_path)), "cpu", said.append)
    assert (tmp_path / ".portapipe.lock").read_text().strip() == str(os.getpid())
    assert (tmp_path / "checkpoints" / ".portapipe.lock").read_text().strip() == str(os.getpid())
    locks.release()
    assert said == [f"log.dir: taking over the lock of {tmp_path} left by pid {dead.pid}, which no longer holds it (a run that was killed)"]
    assert (tmp_path / ".portapipe.lock").read_text() == ""  # released on exit


def test_a_run_whose_checkpoint_dir_is_a_running_runs_checkpoints_is_refused(tmp_path):
    """Another log.dir, but checkpoint.dir pointing into a live run's folder: it would read, prune
    or move aside what the live run is writing."""
    plan, locks = prepare_run(load_config(raw(tmp_path / "live")), "cpu", lambda line: None)
    try:
        with pytest.raises(ConfigError) as err:
            prepare_run(load_config(raw(tmp_path / "other", checkpoint__dir=str(tmp_path / "live" / "checkpoints"))), "cpu", print)
    finally:
        locks.release()
    assert err.value.problems == [
        f"checkpoint.dir: {tmp_path / 'live' / 'checkpoints'} is in use by another run (pid {os.getpid()}); wait for it to end or use another checkpoint.dir"
    ]
    assert not (tmp_path / "other" / ".portapipe.lock").read_text()  # the log.dir lock taken first was given back


def test_checkpoints_kept_in_the_log_dir_itself_take_one_lock(tmp_path):
    plan, locks = prepare_run(load_config(raw(tmp_path, checkpoint__dir=str(tmp_path) + "/")), "cpu", print)
    locks.release()
    assert plan.mode == "new" and len(locks.locks) == 1


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_unwritable_log_or_checkpoint_folders_exit_2_before_ranks_start(tmp_path, capsys, no_ranks, where):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    bad = str(blocker / "runs") if where == "under_a_file" else "/proc/portapipe-x"
    config = write_config(tmp_path / "c.yaml", raw(tmp_path / "ok"))
    assert main(["train", config, "--set", f"log.dir={bad}"]) == 2
    (line,) = _errors(capsys)
    assert line.startswith(f"portapipe: config error: log.dir: {bad!r} ")
    assert ("which is a file, not a folder" in line) if where == "under_a_file" else ("cannot be written" in line)
    assert main(["train", config, "--set", f"checkpoint.dir={bad}"]) == 2
    (line,) = _errors(capsys)
    assert line.startswith(f"portapipe: config error: checkpoint.dir: {bad!r} ")


# ------------------------------------------------------------------------------ LR schedule
@pytest.mark.multiproc
def test_20_steps_then_resumed_to_40_equal_40_straight_bit_for_bit(horizons):
    """The default schedule (no train.lr_schedule_steps: no decay after the warm-up) does not
    depend on train.steps: 20 steps, then the same command with train.steps: 40, is 40 straight steps."""
    default = train_rows(horizons / "default")
    assert [r["step"] for r in default] == list(range(1, 41))
    same_steps(default, train_rows(horizons / "straight"))


@pytest.mark.multiproc
def test_a_run_planned_for_40_stopped_at_20_and_resumed_equals_40_straight_bit_for_bit(horizons):
    """train.lr_schedule_steps: 40 on a run of 20; the resume (not setting it) keeps the checkpoint's horizon."""
    same_steps(train_rows(horizons / "planned"), train_rows(horizons / "cosine"))


@pytest.mark.multiproc
def test_a_resume_keeps_the_checkpoints_schedule_unless_asked(horizons):
    cosine = train_rows(horizons / "cosine")
    kept = train_rows(horizons / "short")  # cosine ending at 20, resumed to 40: min_lr after 20
    assert [r["lr"] for r in kept[20:]] == [1e-3] * 20 and kept[19]["lr"] == 1e-3
    assert [r["lr"] for r in kept[:20]] != [r["lr"] for r in cosine[:20]]
    asked = train_rows(horizons / "asked")  # the same, continued with train.lr_schedule_steps: 40
    assert [r["step"] for r in asked] == list(range(21, 41)) and [r["lr"] for r in asked] == [r["lr"] for r in cosine[20:]]


@pytest.mark.multiproc
def test_one_line_says_what_the_lr_schedule_is_after_a_resume(horizons, tmp_path):
    for run, over, want in (
        ("straight", {}, "LR schedule after step 40: warm-up 2 steps to 0.01, then constant, no decay "
                         "(kept from the checkpoint; train.lr_schedule_steps sets a cosine decay)"),
        ("cosine", {}, "LR schedule after step 40: warm-up 2 steps to 0.01, then cosine to 0.001 at step 40 "
                       "(kept from the checkpoint; train.lr_schedule_steps changes it); steps 41..60 run at 0.001"),
        ("cosine", {"train__lr_schedule_steps": 60},
         "LR schedule after step 40: warm-up 2 steps to 0.01, then cosine to 0.001 at step 60 (train.lr_schedule_steps)"),
    ):
        folder = tmp_path / f"{run}{len(over)}"
        shutil.copytree(horizons / run, folder, ignore=shutil.ignore_patterns(".portapipe.lock"))
        said: list[str] = []
        plan, locks = prepare_run(load_config(raw(folder, steps=60, **over)), "cpu", said.append)
        locks.release()
        assert [line for line in said if line.startswith("LR schedule")] == [want]


def test_a_new_run_whose_horizon_ends_before_its_last_step_says_so(tmp_path):
    said: list[str] = []
    plan, locks = prepare_run(load_config(raw(tmp_path, steps=30, train__lr_schedule_steps=20)), "cpu", said.append)
    locks.release()
    assert said == ["LR schedule: warm-up 2 steps to 0.01, then cosine to 0.001 at step 20 (train.lr_schedule_steps); steps 21..30 run at 0.001"]


# ------------------------------------------------------------------------------- divergence
@pytest.mark.multiproc
def test_a_non_finite_loss_stops_the_run_at_that_step_with_no_checkpoint_of_it(one_rank):
    summary, folder = one_rank["diverged"], one_rank["root"] / "diverged"
    bad = summary["diverged"]["step"]
    assert 1 < bad <= 8 and summary["val_loss"] is None and summary["final_loss"] is not None
    json.dumps(summary, allow_nan=False)  # strict JSON
    assert max(e["step"] for e in list_checkpoints(folder)) == bad - 1  # the last good step; nothing of the broken one
    lines = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "train"] == list(range(1, bad))
    assert [r["kind"] for r in lines[-2:]] == ["diverged", "summary"] and lines[-2]["step"] == bad
    # numbers, null where not finite (as in the summary): never strings
    for row in (lines[-2], summary["diverged"]):
        assert set(row) >= {"step", "loss", "grad_norm"} and all(row[k] is None or isinstance(row[k], float) for k in ("loss", "grad_norm")), row
        assert row["loss"] is None or row["grad_norm"] is None, row  # what stopped it


@pytest.mark.multiproc
def test_a_divergence_names_the_lr_setting_in_force(one_rank):
    """A phase of train.lr_schedule set the step's learning rate, not train.lr: the record names it
    (train.lr here is 1e-2, the first phase's 1e-3 trains, the second's 1e30 diverges)."""
    record = one_rank["phase_diverged"]["diverged"]
    assert record["step"] >= 3 and record["lr_key"] == "train.lr_schedule[1].lr (constant to 1e+30)"
    assert one_rank["diverged"]["diverged"]["lr_key"] == "train.lr"  # the default schedule's
    diverged_row = rows(one_rank["root"] / "phase_diverged")[-2]
    assert diverged_row["kind"] == "diverged" and diverged_row["lr_key"] == record["lr_key"] and diverged_row["lr"] == 1e30


@pytest.mark.multiproc
def test_a_loaded_runs_summary_is_of_its_own_steps(one_rank):
    """checkpoint.load starts a new run from the checkpoint's step: its first loss, the average of
    its last five, its tokens and seconds are its own steps' (21 to 40), none of the parent's."""
    summary, own = one_rank["asked"], train_rows(one_rank["root"] / "asked")
    parent = train_rows(one_rank["root"] / "short")
    assert summary["loaded_from"].endswith("step_00000020") and [r["step"] for r in own] == list(range(21, 41))
    assert summary["first_loss"] == own[0]["loss"] != parent[0]["loss"]
    assert summary["final_loss_avg5"] == sum(r["loss"] for r in own[-5:]) / 5
    assert summary["tokens"] == sum(r["tokens"] for r in own)
    assert summary["train_s"] == pytest.approx(sum(r["iter_s"] for r in own))
    resumed = one_rank["short_40"]  # a resume, by contrast, covers the whole run
    assert resumed["first_loss"] == parent[0]["loss"] and resumed["tokens"] == sum(r["tokens"] for r in parent)


@pytest.mark.multiproc
def test_weights_that_stopped_being_finite_are_never_saved_and_a_non_finite_validation_loss_is_a_divergence(one_rank):
    """No run ends with a nan / inf model or a null validation loss and exit 0: the last update's
    weights are checked before every checkpoint, the validation loss after it."""
    for name in ("weights_inf", "weights_inf_every"):  # at the end, and before a periodic checkpoint
        inf = one_rank[name]
        assert inf["diverged"]["step"] == 1, (name, inf)
        assert inf["diverged"]["reason"].endswith(" is not finite after the update of step 1; no checkpoint was written of it"), inf
        assert inf["checkpoint"] is None and inf["val_loss"] is None and list_checkpoints(one_rank["root"] / name) == [], name
    nan = one_rank["val_nan"]
    assert nan["diverged"]["step"] == 1 and nan["diverged"]["reason"] in ("the validation loss is nan", "the validation loss is inf")
    assert nan["val_loss"] is None and nan["checkpoint"] is not None  # its weights are finite: saved
    for name in ("weights_inf", "val_nan"):
        lines = [json.loads(line) for line in (one_rank["root"] / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["kind"] for r in lines[-2:]] == ["diverged", "summary"], name


def test_what_a_checkpoint_saves_is_checked_finite_buffers_and_balancer_loads_too() -> None:
    """A router bias that became inf (a huge bias_update_speed) or a balancer's recorded loads
    are named as a weight would be: a checkpoint would save them."""
    from types import SimpleNamespace

    import torch

    from torch import nn

    from portapipe.checkpoint.state import first_nonfinite

    block = nn.Module()
    block.w = nn.Parameter(torch.ones(2))
    block.router = nn.Module()
    block.router.register_buffer("bias", torch.zeros(3))
    runtime = SimpleNamespace(blocks={0: block})
    finite = SimpleNamespace(finite=lambda: True)
    loads = {"kind": "eplb", "loads": {"steps": torch.ones(2, 1, 4)}, "phy2log": torch.zeros(1, 4, dtype=torch.int64)}
    balancer = SimpleNamespace(state_dict=lambda: loads)
    assert first_nonfinite(runtime, finite, balancer) is None
    block.router.bias[1] = float("inf")
    assert first_nonfinite(runtime, finite, balancer) == "router.bias"
    block.router.bias.zero_()
    loads["loads"]["steps"][0, 0, 2] = float("nan")
    assert first_nonfinite(runtime, finite, balancer) == "the balancer's loads.steps"
    assert first_nonfinite(runtime, SimpleNamespace(finite=lambda: False), None) == "the master weights or AdamW state"


def test_bias_update_speed_is_refused_above_one(tmp_path, capsys):
    """3e38 made every bias inf after a step (exit 0, the checkpoint holding them): refused at load."""
    assert main(["train", write_config(tmp_path / "c.yaml", raw(tmp_path)), "--set", "model.bias_update_speed=3e38"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.bias_update_speed: 3e+38" in err[0] and "less than or equal to 1" in err[0], err


def test_checkpoint_at_end_false_skips_only_the_last_steps_checkpoint(one_rank):
    """every 2 over 3 steps: step 2's checkpoint and no other, the summary names it; with every 0
    nothing is written and the summary says so."""
    no_end, none = one_rank["no_end"], one_rank["none"]
    assert [e["step"] for e in list_checkpoints(one_rank["root"] / "no_end")] == [2]
    assert no_end["checkpoint"].endswith("step_00000002") and no_end["final_loss"] is not None and len(train_rows(one_rank["root"] / "no_end")) == 3
    assert none["checkpoint"] is None and list_checkpoints(one_rank["root"] / "none") == []


def test_a_diverged_run_exits_3_with_one_line(monkeypatch, tmp_path, capsys):
    import portapipe.train

    def diverged(config: Any, wall_timeout_s: float = 0.0) -> dict[str, Any]:
        return {"run_id": "r", "checkpoint": "c7", "val_loss": None, "diverged": {"step": 8, "loss": 125851.18, "grad_norm": None}}

    monkeypatch.setattr(portapipe.train, "train", diverged)
    assert main(["train", write_config(tmp_path / "c.yaml", raw(tmp_path))]) == 3
    captured = capsys.readouterr()
    assert json.loads(captured.out)["diverged"]["step"] == 8
    assert captured.err.strip() == (
        "portapipe: training stopped at step 8: loss 125851, gradient norm not finite; that step was not applied and no checkpoint was "
        "written of it (last checkpoint: c7); lower train.lr"
    )

    def phased(config: Any, wall_timeout_s: float = 0.0) -> dict[str, Any]:
        return {"run_id": "r", "checkpoint": None, "val_loss": None,
                "diverged": {"step": 3, "loss": None, "grad_norm": None, "lr_key": "train.lr_schedule[1].lr (constant to 5)"}}

    monkeypatch.setattr(portapipe.train, "train", phased)
    assert main(["train", write_config(tmp_path / "c.yaml", raw(tmp_path))]) == 3
    assert capsys.readouterr().err.strip().endswith("(last checkpoint: none); lower train.lr_schedule[1].lr (constant to 5)")
    monkeypatch.setattr(portapipe.train, "train", diverged)
    # the hint names grad_clip only where it is off
    assert main(["train", write_config(tmp_path / "c.yaml", raw(tmp_path, train__grad_clip=0.0))]) == 3
    assert capsys.readouterr().err.strip().endswith("; lower train.lr or turn train.grad_clip on (it is 0: off)")

    def weights(config: Any, wall_timeout_s: float = 0.0) -> dict[str, Any]:
        return {"run_id": "r", "checkpoint": None, "val_loss": None, "diverged": {"step": 1, "reason": "the weights are not finite"}}

    monkeypatch.setattr(portapipe.train, "train", weights)
    assert main(["train", write_config(tmp_path / "c.yaml", raw(tmp_path))]) == 3
    assert capsys.readouterr().err.strip() == (
        "portapipe: training stopped at step 1: the weights are not finite (last checkpoint: none); lower train.lr"
    )


# ------------------------------------------------------------------------------- preemption
def _resume_and_reference(backend: Any, resume: dict[str, Any], reference: dict[str, Any]) -> None:
    from portapipe.train import train_rank

    for config in (resume, reference):
        train_rank(type(backend)(backend.options), config)


def _stop_launcher(tmp_path: Path, run: dict[str, Any], sig: signal.Signals, group: bool) -> tuple[int, list[str], dict[str, Any]]:
    """``portapipe train`` in a child process, stopped by ``sig`` to the launcher (``group``: to
    its process group, as Ctrl-C in a terminal) once two steps are logged."""
    config = write_config(tmp_path / f"{sig.name}.yaml", run)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "portapipe.cli", "train", config], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=group)
    metrics = Path(run["log"]["dir"]) / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().count('"kind": "train"') >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert "Traceback" not in err.decode(), err.decode()
    said = [line for line in err.decode().splitlines() if line.startswith("portapipe:") and not line.startswith("portapipe: memory per rank")]
    return proc.returncode, said, json.loads(out)


@pytest.mark.multiproc
@pytest.mark.parametrize("sig, code, group", [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, True)], ids=["SIGTERM", "SIGINT-ctrl-c"])
def test_a_stop_signal_to_the_launcher_stops_every_rank_after_a_step_with_a_checkpoint_and_resumes_bit_for_bit(tmp_path, sig, code, group):
    steps = 200  # more than run before the signal arrives
    run = raw(tmp_path / "run", steps=steps, pp=2, checkpoint__every=0)
    returncode, lines, summary = _stop_launcher(tmp_path, run, sig, group)
    k = summary["stopped"]["step"]
    assert returncode == code and summary["stopped"]["signal"] == sig.name and 2 <= k < steps
    ckpt = tmp_path / "run" / "checkpoints" / f"step_{k:08d}"
    assert lines == [f"portapipe: stopped by {sig.name} after step {k}; checkpoint {ckpt} (the same command resumes)"]
    assert [(e["step"], e["complete"]) for e in list_checkpoints(tmp_path / "run")] == [(k, True)]
    assert [r["step"] for r in train_rows(tmp_path / "run")] == list(range(1, k + 1))
    if sig != signal.SIGTERM:
        return
    # resumed for 3 more steps (the default LR schedule does not depend on train.steps) = k + 3 straight
    from portapipe.ranks.launch import run_ranks

    resume, reference = raw(tmp_path / "run", steps=k + 3, pp=2, checkpoint__every=0), raw(tmp_path / "straight", steps=k + 3, pp=2, checkpoint__every=0)
    run_ranks(_resume_and_reference, 2, load_config(resume).to_dict(), load_config(reference).to_dict(), wall_timeout_s=300)
    same_steps(train_rows(tmp_path / "run"), train_rows(tmp_path / "straight"))


def test_a_stopped_run_exits_with_the_signals_code(monkeypatch, tmp_path, capsys):
    import portapipe.train

    def stopped(config: Any, wall_timeout_s: float = 0.0) -> dict[str, Any]:
        return {"run_id": "r", "checkpoint": "c", "stopped": {"signal": "SIGINT", "step": 3, "checkpoint": "c"}}

    monkeypatch.setattr(portapipe.train, "train", stopped)
    assert main(["train", write_config(tmp_path / "c.yaml", raw(tmp_path))]) == 130
    assert capsys.readouterr().err.strip() == "portapipe: stopped by SIGINT after step 3; checkpoint c (the same command resumes)"


@pytest.mark.multiproc
def test_checkpoint_load_into_a_folder_of_another_run_is_refused(used):
    source = used / "checkpoints" / "step_00000004"
    other = used.parent / "copy"
    shutil.copytree(used, other, ignore=shutil.ignore_patterns(".portapipe.lock"))
    with pytest.raises(ConfigError, match=r"checkpoint.load starts a new run, but .* holds 2 checkpoint\(s\) of run"):
        prepare_run(load_config(raw(other, checkpoint__load=str(source))), "cpu", print)
    # loading a folder's own checkpoint would move it aside under checkpoint.overwrite: refused, naming the way
    with pytest.raises(ConfigError, match="is one of this log.dir's own checkpoints; to continue its run leave checkpoint.load unset"):
        prepare_run(load_config(raw(used, checkpoint__load=str(source), checkpoint__overwrite=True)), "cpu", print)
    assert source.is_dir()
