"""ci/installed_package.py (the wheel in a fresh venv, run from an empty folder) judges stderr
strictly and runs in .ci/run, not in `make test`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("installed_package", ROOT / "ci" / "installed_package.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_only_portapipes_own_stderr_lines_pass() -> None:
    s = _script()
    bar = "\rtrain:   0%|          | 0/5 [00:00<?, ?step/s]\rtrain:  20%|##        | 1/5 [00:00<00:01, 4.5step/s, loss=5.577]\n"
    assert s.foreign_lines(bar + "portapipe: stopped by SIGTERM after step 1\n") == []
    warning = "/venv/lib/torch/_subclasses/functional_tensor.py:276: UserWarning: Failed to initialize NumPy: No module named 'numpy'\n"
    assert s.foreign_lines(warning + bar) == [warning.strip()]
    traceback = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: Numpy is not available\n"
    assert len(s.foreign_lines(traceback)) == 3
    ok = s.Step("portapipe train c.yaml")
    assert s.problem(ok, 0, bar) == ""
    assert s.problem(ok, 1, "portapipe: rank 2 failed: RuntimeError: Numpy is not available\n") == "exit code 1, expected 0"
    assert "did not write" in s.problem(ok, 0, warning)
    refused = s.Step("portapipe simulate --plot s.png", 2, "pip install 'portapipe[viz]'")
    assert s.problem(refused, 2, "portapipe simulate: a chart needs matplotlib: pip install 'portapipe[viz]'\n") == ""
    assert "does not say" in s.problem(refused, 2, "portapipe simulate: something else\n")


def test_the_steps_cover_the_issue_and_ci_runs_them_outside_make_test() -> None:
    s = _script()
    words = [step.command.split()[1] for step in s.STEPS if step.exit_code == 0]
    for command in ("info", "init", "train", "timeline", "verify", "simulate", "plan", "bench"):
        assert command in words, command
    commands = [step.command for step in s.STEPS]
    # the timeline's command reads the step the 5-step run recorded, from the installed wheel
    assert commands.index("portapipe train c.yaml --set train.steps=5 --set 'log.timeline.steps=[5]'") < commands.index("portapipe timeline runs/cpu --step 5")
    run = (ROOT / ".ci" / "run").read_text().splitlines()
    assert run.index("make test") < run.index(".venv/bin/python ci/installed_package.py")
    assert "installed_package" not in (ROOT / "Makefile").read_text()
