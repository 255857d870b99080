"""The device matrix as GitHub reads it: .github/workflows/devices.yml runs ci/test.sh per leg."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_workflow_runs_every_leg_on_its_runner() -> None:
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "devices.yml").read_text())
    jobs = wf["jobs"]
    assert set(jobs) == {"cpu", "cuda", "npu"}
    assert jobs["cpu"]["runs-on"] == "ubuntu-latest"
    assert jobs["cuda"]["runs-on"] == ["self-hosted", "linux", "cuda"]
    assert jobs["npu"]["runs-on"] == ["self-hosted", "linux", "ascend"]
    for leg, job in jobs.items():
        runs = [step["run"] for step in job["steps"] if "run" in step]
        assert runs[-1] == f"bash ci/test.sh {leg}", leg
    script = (ROOT / "ci" / "test.sh").read_text()
    for leg in ("cuda", "npu"):
        assert f"PORTAPIPE_REQUIRE_DEVICES={leg}" in script  # device tests required, not skipped
    assert not (ROOT / "ci" / "workflow.yml").exists()  # one copy of the matrix, where GitHub reads it


def test_make_run_through_links_installs_into_the_checkout(tmp_path) -> None:
    """ci/readme_commands.py runs `make train` from a folder of links to the checkout: a reinstall
    from there must still name the checkout, or the venv's scripts would point at a folder that
    is deleted afterwards."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    for entry in ("Makefile", "pyproject.toml", "portapipe"):
        (tmp_path / entry).symlink_to(ROOT / entry)
    # Under `make test` the outer make's variables make this one print its directory: not a path
    # the install would use.
    env = {k: v for k, v in os.environ.items() if k not in ("VENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    plan = subprocess.run(["make", "--no-print-directory", "-n", "-B", "install"], cwd=tmp_path, capture_output=True, text=True, env=env, check=True).stdout
    real = str(ROOT.resolve())
    assert f'-e "{real}[test]"' in plan
    assert f"touch {real}/.venv/.installed" in plan
    assert str(tmp_path) not in plan
