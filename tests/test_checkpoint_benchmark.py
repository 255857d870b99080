"""benchmarks/checkpoint.py: its JSON reports what it wrote, against torch.save of the same state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "checkpoint.py"
SMALL = ["--set", "model.hidden=32", "--set", "model.n_heads=2", "--set", "model.moe_hidden=16", "--set", "model.n_experts=4",
         "--set", "model.top_k=2", "--set", "model.seq_len=16"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def _files(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


@pytest.mark.multiproc
def test_the_benchmark_reports_the_bytes_it_wrote_and_times_against_torch_save(tmp_path):
    out = _run("--repeats", "2", "--dir", str(tmp_path), *SMALL)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["setup"]["hidden"] == 32 and report["setup"]["ranks"] == 2 and report["setup"]["repeats"] == 2
    newest = tmp_path / "dcp" / "step_00000003"  # repetition 2's waited-for save (4 was written in the background)
    assert report["ours"]["bytes"] == _files(newest) and (newest / "manifest.json").is_file()
    assert report["torch_save"]["bytes"] == _files(tmp_path / "torch_save")
    for part in ("ours", "torch_save"):
        for key, t in report[part].items():
            if key != "bytes":
                assert 0 < t["fastest"] <= t["median"], (part, key)
    r, ours, peer = report["ratio"], report["ours"], report["torch_save"]
    assert r["bytes"] == ours["bytes"] / peer["bytes"] and r["load_s"] == ours["load_s"]["median"] / peer["load_s"]["median"]


@pytest.mark.parametrize("args, want", [(("--repeats", "0"), "--repeats 0: at least 1"), (("--set", "model.hidden=-1"), "model.hidden")])
def test_bad_input_exits_2_with_one_line(args, want):
    out = _run(*args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert want in out.stderr.strip().splitlines()[-1]
