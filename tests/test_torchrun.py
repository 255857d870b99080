"""portapipe under torchrun: two "machines" (two torchrun agents on localhost, 2 ranks each, a
c10d rendezvous on 127.0.0.1) train as the local launcher does, and rank 0 alone prints the
summary; with a rank killed, torchrun's --max-restarts starts the workers again and they resume
from the last checkpoint; under mpirun the same rank detection decides who speaks."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from portapipe.ranks.launch import launching_rank
from portapipe.testing.faults import fired

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cpu.yaml"
pytestmark = pytest.mark.multiproc

#: 4 ranks (pp 2 x ep 2) of a small model, 3 steps, no progress bar, no periodic checkpoint.
SMALL = ["model.hidden=32", "model.seq_len=16", "train.micro_batch_size=2", "train.steps=3", "log.progress=false", "checkpoint.every=0"]


def _sets(run: Path) -> list[str]:
    return [x for s in [*SMALL, f"log.dir={run}"] for x in ("--set", s)]


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("kind") == "train"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The local launcher's run of the config: its folder and summary."""
    folder = tmp_path_factory.mktemp("local")
    done = subprocess.run([sys.executable, "-m", "portapipe.cli", "train", str(EXAMPLE), *_sets(folder)],
                          cwd=folder, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return folder, json.loads(done.stdout)


def _two_agents(folder: Path, run: Path, max_restarts: int, entry: list[str], *sets: str) -> list[tuple[int, str, str]]:
    """Two torchrun agents of 2 ranks each on this machine (a c10d rendezvous on 127.0.0.1), each
    running ``entry`` + ``train`` of the config in ``run``: (exit code, stdout, stderr) of each."""
    port, env = _free_port(), _env()
    if max_restarts:
        # torchrun keeps one store for every round of its rendezvous: a restarted rank may read a
        # peer's address of the round before (pytorch/pytorch#135712); this opts out, as the README says.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(node),
             "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes", "--max_restarts", str(max_restarts),
             "-m", *entry, "train", str(EXAMPLE), *_sets(run), *[x for s in sets for x in ("--set", s)]],
            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in (0, 1)
    ]
    try:
        outs = [a.communicate(timeout=300) for a in agents]
    finally:
        for a in agents:
            a.kill() if a.poll() is None else None
    return [(a.returncode, out, err) for a, (out, err) in zip(agents, outs)]


def test_two_nodes_of_two_ranks_under_torchrun_train_as_the_local_launcher_and_print_one_summary(tmp_path: Path, local) -> None:
    run = tmp_path / "torchrun"
    agents = _two_agents(tmp_path, run, 0, ["portapipe.cli"])
    assert [code for code, _, _ in agents] == [0, 0], [err[-2000:] for _, _, err in agents]
    summaries = [line for _, out, _ in agents for line in out.splitlines() if line.startswith("{")]
    assert len(summaries) == 1, summaries  # rank 0's, not one per rank
    summary = json.loads(summaries[0])
    assert (summary["pp"], summary["ep"], summary["steps"]) == (2, 2, 3)
    assert _losses(run) == _losses(local[0]) and len(_losses(run)) == 3
    assert summary["final_loss"] == local[1]["final_loss"]


def test_a_rank_killed_under_torchrun_max_restarts_resumes_from_the_last_checkpoint_as_the_uninterrupted_run(tmp_path: Path, local) -> None:
    """Rank 1 is killed (SIGKILL) before step 3; torchrun (--max-restarts 1) restarts the worker group and
    its rank 0 resumes the run from its newest complete checkpoint: the losses are the local run's."""
    run, marks = tmp_path / "torchrun", tmp_path / "marks"
    kill = json.dumps([{"rank": 1, "point": "step", "step": 3}])
    agents = _two_agents(tmp_path, run, 1, ["portapipe.testing.faults", kill, str(marks)], "checkpoint.every=1")
    assert [code for code, _, _ in agents] == [0, 0], [err[-3000:] for _, _, err in agents]
    assert [f["rank"] for f in fired(marks)] == [1]
    assert _losses(run) == _losses(local[0]) and len(_losses(run)) == 3  # each step once: the file cut back to the resumed step
    resumed = [line for _, _, err in agents for line in err.splitlines() if line.startswith("portapipe: resuming run ")]
    assert len(resumed) == 1 and re.search(r"from \S+/step_0000000[12] \(step [12] of 3\)$", resumed[0]), resumed
    summary = json.loads(next(line for _, out, _ in agents for line in out.splitlines() if line.startswith("{")))
    assert summary["final_loss"] == local[1]["final_loss"] and summary["resumed_from"] in (1, 2)


@pytest.mark.parametrize("key", ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"])
def test_the_rank_that_speaks_is_read_from_torchruns_and_each_mpis_variable(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    for k in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert launching_rank() == 0  # the local launcher's own process speaks
    monkeypatch.setenv(key, "3")
    assert launching_rank() == 3


@pytest.mark.parametrize("rank, lines", [(0, 1), (1, 0)])
def test_under_mpirun_only_rank_0_prints_the_summary(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path, rank: int, lines: int) -> None:
    """mpirun is not installed here: its ranks are this process with Open MPI's variables set and
    the ranks' training replaced by its result (each rank returns the same summary)."""
    import portapipe.ranks.launch
    from portapipe.cli import main

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", str(rank))
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setattr(portapipe.ranks.launch, "run_ranks", lambda *a, **k: [{"final_loss": 2.5, "stopped": {"signal": "SIGTERM", "step": 2, "checkpoint": "c"}}])
    assert main(["train", str(EXAMPLE), *_sets(tmp_path / "run")]) == 143
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == lines and captured.err.count("stopped by SIGTERM after step 2") == lines
