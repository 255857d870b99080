"""Faults injected into training runs (portapipe.testing.faults), each run compared with the
uninterrupted run of the same config: with ``launch.max_restarts`` a run that loses a rank (killed,
stopped, a disk that fills) ends as if nothing happened, every logged loss and the final weights
bit for bit; one that has more faults than restarts ends non-zero with one line.

40 steps of small float64 models, a checkpoint every 5: DualPipeV pp 2 x ep 2 with EPLB moving
experts every 5 steps, and 1F1B pp 2 x dp 2 with ZeRO-2. Each reference runs once per module.
"""

from __future__ import annotations

import io
import json
import random
import re
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import portapipe.train
from portapipe.checkpoint import load_model_state
from portapipe.cli import main
from portapipe.testing.faults import Fault, faulty, fired

pytestmark = pytest.mark.multiproc

MODEL = {"vocab_size": 128, "hidden": 16, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 8,
         "n_shared": 1, "top_k": 2, "seq_len": 16, "dtype": "float64"}
COMMON = {"backend": "cpu", "model": MODEL, "train": {"steps": 40, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 2},
          "data": {"val_fraction": 0.0}, "log": {"progress": False}, "checkpoint": {"every": 5},
          "launch": {"max_restarts": 3, "restart_backoff_s": 0.0}}
#: DualPipeV with EPLB: a new placement after every 5 steps, half a layer's slots allowed to move
DUALPIPEV = {**COMMON, "parallel": {"pp": 2, "ep": 2, "dp": 1}, "schedule": {"name": "dualpipev", "microbatches": 4},
             "balancer": {"kind": "eplb", "interval": 5, "window": 5, "max_moved": 0.5}}
ONE_F_ONE_B = {**COMMON, "parallel": {"pp": 2, "ep": 1, "dp": 2}, "schedule": {"name": "1f1b", "microbatches": 2},
               "train": {**COMMON["train"], "zero_stage": 2}}


@dataclass
class Run:
    code: int
    lines: list[str]  # the launcher's stderr (the ranks' own lines go to the terminal)
    summary: dict[str, Any] | None
    dir: Path
    fired: list[dict[str, Any]]

    def rows(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in map(json.loads, (self.dir / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == kind]

    def trained(self) -> list[tuple[Any, ...]]:
        """Every train row's figures that training computes."""
        return [(r["step"], r["loss"], r["lr"], r["grad_norm"], r["clipped"]) for r in self.rows("train")]

    def weights(self) -> dict[str, torch.Tensor]:
        return load_model_state(self.dir / "checkpoints")[0]


def train(folder: Path, config: dict[str, Any], faults: list[Fault] = (), **launch: Any) -> Run:
    """``portapipe train`` of ``config`` in ``folder``, its ranks with ``faults`` installed."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {**config, "log": {**config["log"], "dir": str(folder / "run")}, "launch": {**config["launch"], **launch}}
    (folder / "config.json").write_text(json.dumps(config))
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(out), redirect_stderr(err):
        mp.delenv("PORTAPIPE_DEBUG", raising=False)  # the one-line failures, not the tracebacks
        if faults:
            mp.setattr(portapipe.train, "train_rank", faulty(list(faults), folder / "marks"))
        code = main(["train", str(folder / "config.json")])
    summary = json.loads(out.getvalue()) if out.getvalue().strip() else None
    return Run(code, err.getvalue().splitlines(), summary, folder / "run", fired(folder / "marks"))


def restart_line(n: int, left: int, cause: str, step: int) -> str:
    return f"portapipe: restart {n} ({left} left): {cause}; resuming from step {step}"


def same_run(run: Run, reference: Run) -> None:
    """Exit 0, every logged step's loss and the final weights bit for bit the reference's."""
    assert run.code == 0 and reference.code == 0, run.lines
    assert run.trained() == reference.trained() and len(run.trained()) == 40
    mine, theirs = run.weights(), reference.weights()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)


def random_kills(seed: int, ranks: int) -> list[Fault]:
    """kill -9 of a random rank after the update of each of three random steps (before their
    checkpoint and metrics row), one per launch."""
    rng = random.Random(seed)
    return [Fault(rng.randrange(ranks), "update", step) for step in sorted(rng.sample(range(1, 41), 3))]


def checkpoint_before(step: int, every: int = 5) -> int:
    return step // every * every


# ------------------------------------------------------------------------------- the references
@pytest.fixture(scope="module")
def dualpipev(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return train(tmp_path_factory.mktemp("dualpipev"), DUALPIPEV)


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return train(tmp_path_factory.mktemp("1f1b"), ONE_F_ONE_B)


# ------------------------------------------------------------------------- three random kills
@pytest.mark.parametrize("name, seed", [("dualpipev", 53), ("one_f_one_b", 54)])
def test_three_kills_at_random_steps_end_as_the_uninterrupted_run_bit_for_bit(request, tmp_path, name, seed) -> None:
    reference: Run = request.getfixturevalue(name)
    kills = random_kills(seed, 4)
    run = train(tmp_path, DUALPIPEV if name == "dualpipev" else ONE_F_ONE_B, kills)
    same_run(run, reference)
    assert [(f["rank"], f["step"]) for f in run.fired] == [(k.rank, k.step) for k in kills]
    causes = [f"rank {k.rank} was killed by SIGKILL" for k in kills]
    rows = run.rows("restart")
    assert [(r["restart"], r["cause"], r["restarts_left"]) for r in rows] == [(i + 1, cause, 2 - i) for i, cause in enumerate(causes)]
    assert run.lines == [restart_line(r["restart"], r["restarts_left"], r["cause"], r["step"]) for r in rows]
    for kill, row in zip(kills, rows):  # the newest complete checkpoint: step N's own was not begun, the one before may be unfinished
        newest = checkpoint_before(kill.step - 1)
        assert row["step"] in (newest, max(newest - 5, 0)), (kill, row)
    assert run.summary["restarts"] == 3 and run.summary["resumed_from"] is None
    assert run.rows("summary")[-1]["restarts"] == 3  # the file's summary: the last launch's, one for the run


# --------------------------------------------------------------- faults at the awkward points
#: One run of DualPipeV meets each in turn (fault i in launch i): a rank stopped (SIGSTOP) before any
#: checkpoint, killed while checkpoint 10 is written, inside the migration after step 15, at the
#: first step after that restart, and a disk that fills while checkpoint 20 is written.
AWKWARD = [Fault(1, "step", 3, action="stop"), Fault(0, "checkpoint", 10), Fault(2, "migration", 15), Fault(3, "first"),
           Fault(1, "write", 20, at_byte=4096)]


@pytest.fixture(scope="module")
def awkward(tmp_path_factory: pytest.TempPathFactory) -> Run:
    # One restart more than faults: a rank starved past the stall limit by a loaded machine costs one, not the test.
    return train(tmp_path_factory.mktemp("awkward"), DUALPIPEV, AWKWARD, max_restarts=len(AWKWARD) + 1, stall_timeout_s=10.0)


def test_each_awkward_fault_fired_where_asked_and_was_restarted_from_the_checkpoint_before_it(awkward: Run) -> None:
    assert [(f["rank"], f["point"], f["step"]) for f in awkward.fired] == [(f.rank, f.point, f.step) for f in AWKWARD]
    running = [f["step_running"] for f in awkward.fired]  # checkpoints are written in the background, while the next steps run
    assert running[0] == 3 and running[1] > 10 and running[2:4] == [15, 11] and running[4] > 20, running
    # (the disk's error fails the save on every rank at once: the first rank to report it is named)
    restarts = {(r["step"], re.sub(r"rank \d failed", "rank N failed", r["cause"].split(":")[0])) for r in awkward.rows("restart")}
    assert {(0, "rank 1 stalled"), (5, "rank 0 was killed by SIGKILL"), (10, "rank 2 was killed by SIGKILL"),
            (10, "rank 3 was killed by SIGKILL"), (15, "rank N failed")} <= restarts, restarts


def test_a_stopped_rank_is_named_by_the_watchdog_and_restarted(awkward: Run) -> None:
    stall = next(line for line in awkward.lines if "rank 1 stalled" in line)
    assert re.fullmatch(r"portapipe: restart \d \(\d left\): rank 1 stalled: no heartbeat for [\d.]+ s .*and its process is stopped "
                        r"\(SIGSTOP or a debugger\); every rank was ended; resuming from step 0", stall), stall


def test_a_disk_full_while_a_checkpoint_is_written_is_one_line_and_the_previous_checkpoint_is_resumed(awkward: Run) -> None:
    root = re.escape(str(awkward.dir / "checkpoints"))
    line = next(line for line in awkward.lines if "could not be written" in line)
    # (torch's writer may report the full disk as a short write only: then the free bytes are said)
    assert re.fullmatch(rf"portapipe: restart \d \(\d left\): rank \d failed: CheckpointWriteError: checkpoint {root}/step_00000020 "
                        rf"could not be written: no space left on device( \(0 bytes free\))?; the previous complete checkpoint is "
                        rf"{root}/step_00000015; resuming from step 15", line), line


def test_after_the_awkward_faults_the_run_is_the_uninterrupted_one(awkward: Run, dualpipev: Run) -> None:
    same_run(awkward, dualpipev)
    kept = sorted(p.name for p in (awkward.dir / "checkpoints").iterdir() if p.name != ".portapipe.lock")
    assert kept == ["step_00000035", "step_00000040"]  # no save a fault cut short is left
    assert awkward.summary["restarts"] >= len(AWKWARD)


# ------------------------------------------------------------------------------ out of restarts
def test_more_faults_than_restarts_end_the_run_non_zero_after_the_last_with_one_line(tmp_path) -> None:
    faults = [Fault(0, "first"), Fault(1, "first"), Fault(2, "first")]
    run = train(tmp_path, ONE_F_ONE_B, faults, max_restarts=2)
    assert run.code == 1 and len(run.fired) == 3
    assert run.lines == [restart_line(1, 1, "rank 0 was killed by SIGKILL", 0), restart_line(2, 0, "rank 1 was killed by SIGKILL", 0),
                         "portapipe: rank 2 was killed by SIGKILL; not restarted: the 2 restarts of launch.max_restarts were used"]
    assert [r["cause"] for r in run.rows("restart")] == ["rank 0 was killed by SIGKILL", "rank 1 was killed by SIGKILL"]
