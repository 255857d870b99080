"""launch.pin_cores: each rank of a machine on a disjoint set of the usable cores, one intra-op
thread per core; refused in one line before any rank starts where ranks outnumber the cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from portapipe.ranks import pinning
from portapipe.config import ConfigError, load_config
from portapipe.ranks.launch import local_rank, local_ranks, rank_threads, run_ranks

ROOT = Path(__file__).resolve().parents[1]
_LAUNCHER_KEYS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK",
                  "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMIX_RANK", "MPI_LOCALNRANKS", "MPI_LOCALRANKID",
                  "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in _LAUNCHER_KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def where_am_i(backend: Any) -> dict[str, Any]:
    return {"cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
            "placement": pinning.placement()}


# ------------------------------------------------------------------------------ arithmetic
@pytest.mark.parametrize("ranks, size", [(4, 4), (8, 2), (16, 1), (1, 16)])
def test_sixteen_cores_are_dealt_in_equal_disjoint_runs(no_launcher: pytest.MonkeyPatch, ranks: int, size: int) -> None:
    no_launcher.setattr(pinning, "usable_cores", lambda: list(range(16)))
    sets = pinning.plan(True, local_ranks(ranks))
    assert sets is not None and [len(s) for s in sets] == [size] * ranks
    assert sorted(c for s in sets for c in s) == list(range(16))  # disjoint, and every core used
    assert sets[-1] == list(range(16 - size, 16))  # contiguous runs in rank order
    assert pinning.plan("auto", ranks) == sets


def test_an_uneven_split_differs_by_at_most_one_core_and_keeps_the_usable_cores_only() -> None:
    usable = [1, 2, 3, 5, 8, 9, 10, 11, 12, 13, 14]  # a container's affinity: 11 of the machine's cores
    sets = pinning.plan(True, 4, usable)
    assert [len(s) for s in sets] == [3, 3, 3, 2] and [c for s in sets for c in s] == usable
    assert pinning.describe(sets[0] + sets[3]) == "1-3,13-14"


def test_true_with_more_ranks_than_cores_is_refused_in_one_line_and_auto_leaves_them_unpinned(no_launcher: pytest.MonkeyPatch) -> None:
    no_launcher.setattr(pinning, "usable_cores", lambda: [0, 1])
    with pytest.raises(ConfigError) as info:
        pinning.plan(True, 3)
    (line,) = info.value.problems
    assert line.startswith("launch.pin_cores: true") and "3 ranks" in line and "2 cores (0-1)" in line and "auto" in line
    assert pinning.plan("auto", 3) is None and pinning.plan(False, 2) is None
    with pytest.raises(ConfigError, match="launch.pin_cores"):
        pinning.plan("sometimes", 2)  # type: ignore[arg-type]


def test_under_torchrun_a_rank_takes_its_local_ranks_share(no_launcher: pytest.MonkeyPatch) -> None:
    """16 ranks on two machines of 16 cores: 8 here, local rank 3 gets cores 6 and 7."""
    for key, value in {"RANK": "11", "WORLD_SIZE": "16", "MASTER_ADDR": "n0", "LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "3"}.items():
        no_launcher.setenv(key, value)
    no_launcher.setattr(pinning, "usable_cores", lambda: list(range(16)))
    sets = pinning.plan(True, local_ranks(16))
    assert sets is not None and len(sets) == 8 and sets[local_rank()] == [6, 7]
    no_launcher.delenv("LOCAL_RANK")
    no_launcher.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "5")  # mpirun's name
    assert local_rank() == 5


def test_hardware_threads_of_a_physical_core_stay_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two packages of 4 cores with 2 hardware threads each, numbered the usual way (cpu c and c + 8
    are siblings): 4 ranks get whole physical cores of one package each."""
    for cpu in range(16):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{(cpu % 8) // 4}\n")
        (topo / "core_id").write_text(f"{cpu % 4}\n")
    monkeypatch.setattr(pinning, "_CPU_SYS", tmp_path)
    sets = pinning.split(pinning.topology_order(list(range(16))), 4)
    assert sets == [[0, 8, 1, 9], [2, 10, 3, 11], [4, 12, 5, 13], [6, 14, 7, 15]]
    (tmp_path / "cpu5" / "topology" / "core_id").unlink()  # the kernel does not say: by number
    assert pinning.topology_order([3, 1, 5, 0]) == [0, 1, 3, 5]


@pytest.mark.parametrize(
    "files, quota",
    [
        ({"cpu.max": "400000 100000"}, 4),  # cgroup v2: 4 CPUs
        ({"cpu.max": "150000 100000"}, 1),  # 1.5 CPUs pay for one busy thread
        ({"cpu.max": "max 100000"}, None),
        ({"cpu/cpu.cfs_quota_us": "800000", "cpu/cpu.cfs_period_us": "100000"}, 8),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        ({}, None),
    ],
)
def test_a_cgroup_cpu_quota_caps_the_usable_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str], quota: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    monkeypatch.setattr(pinning, "_CGROUP", tmp_path)
    monkeypatch.setattr(pinning, "topology_order", sorted)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert pinning.cpu_quota() == quota
    assert pinning.usable_cores() == list(range(quota or 16))


def test_unpinned_threads_count_the_usable_cores_not_the_machines(no_launcher: pytest.MonkeyPatch) -> None:
    """A container allowed 4 of a machine's 64 cores: 2 ranks run 2 threads each, not 32."""
    no_launcher.setattr(os, "cpu_count", lambda: 64)
    no_launcher.setattr(pinning, "usable_cores", lambda: [8, 9, 10, 11])
    assert rank_threads(2) == 2 and rank_threads(8) == 1


def test_the_key_takes_auto_true_false_and_nothing_else() -> None:
    cpu = ROOT / "examples" / "cpu.yaml"
    assert load_config(cpu).launch.pin_cores is False
    assert load_config(cpu, ["launch.pin_cores=auto"]).launch.pin_cores == "auto"
    assert load_config(cpu, ["launch.pin_cores=true"]).launch.pin_cores is True
    for bad in ("always", "1"):
        with pytest.raises(ConfigError, match="launch.pin_cores"):
            load_config(cpu, [f"launch.pin_cores={bad}"])


# ------------------------------------------------------------------------------ real ranks
@pytest.mark.multiproc
def test_pinned_ranks_run_on_disjoint_cores_with_one_thread_per_core(no_launcher: pytest.MonkeyPatch) -> None:
    usable = pinning.usable_cores()
    if len(usable) < 2:
        pytest.skip("needs 2 usable cores")
    ranks = 2
    got = run_ranks(where_am_i, ranks, threads=7, pin_cores=True)
    want = pinning.split(usable, ranks)
    assert [r["cores"] for r in got] == [sorted(s) for s in want]
    assert not set(got[0]["cores"]) & set(got[1]["cores"])
    assert [r["threads"] for r in got] == [len(s) for s in want] and [r["omp"] for r in got] == [str(len(s)) for s in want]
    assert all(r["placement"]["pinned"] for r in got) and got[0]["placement"]["cores"] == pinning.describe(want[0])


@pytest.mark.multiproc
def test_more_ranks_than_cores_are_refused_with_true_before_any_rank_starts_and_unpinned_with_auto(no_launcher: pytest.MonkeyPatch) -> None:
    usable = pinning.usable_cores()
    ranks = len(usable) + 1
    if ranks > 4:
        pytest.skip("keeps to a few ranks: this machine has more cores")
    with pytest.raises(ConfigError, match="launch.pin_cores: true"):
        run_ranks(where_am_i, ranks, pin_cores=True)
    got = run_ranks(where_am_i, ranks, threads=1, pin_cores="auto")
    assert all(r["cores"] == sorted(usable) and r["threads"] == 1 and not r["placement"]["pinned"] for r in got)


_TORCHRUN_JOB = """
import json, os, sys, torch
sys.path.insert(0, {root!r})
from portapipe.ranks.launch import run_ranks

def where(backend):
    return {{"local_rank": int(os.environ["LOCAL_RANK"]), "cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}}

if __name__ == "__main__":
    # one write per rank: two ranks share the pipe, and print's text and newline could interleave
    os.write(1, (json.dumps(run_ranks(where, 2, pin_cores=True)[0]) + os.linesep).encode())
"""


@pytest.mark.multiproc
def test_under_torchrun_each_rank_pins_itself_to_its_local_share(tmp_path: Path) -> None:
    usable = pinning.usable_cores()
    if len(usable) < 2:
        pytest.skip("needs 2 usable cores")
    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_JOB.format(root=str(ROOT)))
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_KEYS}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")), key=lambda r: r["local_rank"])
    want = pinning.split(usable, 2)
    assert [r["cores"] for r in got] == [sorted(c) for c in want] and [r["threads"] for r in got] == [len(c) for c in want]


@pytest.mark.multiproc
def test_a_pinned_training_run_records_each_ranks_cores_in_its_memory_row(tmp_path: Path) -> None:
    usable = pinning.usable_cores()
    if len(usable) < 2:
        pytest.skip("needs 2 usable cores")
    tiny = ["parallel.pp=1", "parallel.ep=2", "model.hidden=16", "model.n_layers=2", "model.n_heads=2", "model.ffn_hidden=32",
            "model.moe_hidden=16", "model.n_experts=4", "model.seq_len=16", "train.micro_batch_size=2", "train.steps=1",
            "checkpoint.every=0", "log.progress=false", f"log.dir={tmp_path / 'run'}", "launch.pin_cores=true"]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_KEYS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", "portapipe.cli", "train", str(ROOT / "examples" / "cpu.yaml"), *[a for s in tiny for a in ("--set", s)]],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    launch = next(r for r in rows if r["kind"] == "memory")["launch"]
    want = pinning.split(usable, 2)
    assert launch == {"pin_cores": True, "pinned": True, "cores_by_rank": [pinning.describe(s) for s in want],
                      "threads_by_rank": [len(s) for s in want]}
    assert f"portapipe: cores per rank (launch.pin_cores): {pinning.describe(want[0])} ({len(want[0])} thread" in proc.stderr


def test_train_refuses_true_on_too_few_cores_in_one_line_before_its_folder_is_made(no_launcher: pytest.MonkeyPatch, tmp_path: Path,
                                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from portapipe.cli import main

    no_launcher.setattr(pinning, "usable_cores", lambda: [0, 1])
    code = main(["train", str(ROOT / "examples" / "cpu.yaml"), "--set", "launch.pin_cores=true", "--set", f"log.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("portapipe: config error: launch.pin_cores: true") and "4 ranks" in err[0]
    assert not (tmp_path / "run").exists()
