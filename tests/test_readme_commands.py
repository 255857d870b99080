"""ci/readme_commands.py reads the README's shell commands in order and runs them in a mirror of
the checkout, so their outputs never land in the checkout."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / "ci" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_commands_come_from_shell_blocks_in_order_without_comments() -> None:
    rc = _script()
    text = "intro\n```bash\nmake a   # first\n\n# a comment\n$ portapipe info\n```\n```\nnot a command\n```\n```sh\necho b\n```\n"
    assert rc.commands(text) == ["make a   # first", "portapipe info", "echo b"]
    assert rc.bare("make a   # first") == "make a"
    continued = "```bash\nportapipe train a.yaml \\\n    --set x=1 \\\n    --set y=2   # note\nportapipe info\n```\n"
    assert rc.commands(continued) == ["portapipe train a.yaml --set x=1 --set y=2   # note", "portapipe info"]


def test_the_readme_commands_name_real_subcommands_and_shipped_files() -> None:
    from portapipe.cli import COMMANDS

    cmds = _script().commands((ROOT / "README.md").read_text())
    assert cmds[:2] == ["make train   # builds .venv if missing, installs, trains examples/cpu.yaml on 4 CPU ranks",
                        "make test    # builds .venv if missing, installs portapipe[test], runs the test suite"]
    for cmd in cmds:
        words = shlex.split(cmd, comments=True)
        if words[0] == "portapipe":
            assert words[1] in COMMANDS, cmd
        for word in words:
            if word.startswith("examples/"):
                assert (ROOT / word).exists(), cmd


def test_outputs_land_in_the_mirror_not_the_checkout(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    (checkout / "examples").mkdir(parents=True)
    (checkout / "examples" / "x.txt").write_text("x")
    (checkout / "README.md").write_text("```bash\nmkdir -p runs && cp examples/x.txt runs/y.txt\ntest -f runs/y.txt\n```\n")
    rc = _script()
    assert rc.run(rc.commands((checkout / "README.md").read_text()), checkout, keep=False) == 0
    assert not (checkout / "runs").exists()
    (checkout / "README.md").write_text("```bash\npython -c 'raise SystemExit(3)'\n```\n")
    assert rc.run(rc.commands((checkout / "README.md").read_text()), checkout, keep=False) == 1


def test_skipping_a_command_the_readme_does_not_have_is_refused() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "ci" / "readme_commands.py"), "--skip", "make tests", "--list"], capture_output=True, text=True)
    assert out.returncode == 2 and "--skip names commands the README does not have: ['make tests']" in out.stderr


def test_ci_runs_the_test_command_then_every_other_readme_command() -> None:
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    # between the two, the wheel in a fresh venv (tests/test_install_script.py); last, the short leg on the oldest torch
    assert steps[-4:] == ["make test", ".venv/bin/python ci/installed_package.py", '.venv/bin/python ci/readme_commands.py --skip "make test"',
                          "bash ci/oldest_torch.sh"]
    assert "make test" in map(_script().bare, _script().commands((ROOT / "README.md").read_text()))
