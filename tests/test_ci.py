"""The device matrix as GitHub reads it: .github/workflows/devices.yml runs ci/test.sh per leg."""

from __future__ import annotations

from pathlib import Path

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
