"""Second round of attacks on launching a run: the oneDNN line only where it changes something,
a symbolic link loop as log.dir named as one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import portapipe.launch
from portapipe import cpu_isa
from portapipe.checkpoint.run import writable_problems
from portapipe.cli import main
from portapipe.config import config_from_dict

from .test_cpu_isa import machine  # noqa: F401  (a CPU listing AMX, a verdict cache of its own)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"
AMX_LINE = "this CPU advertises AMX but a process that uses it dies (SIGILL)"


class _NoRanks:
    """The local launcher with the ranks' training replaced by a summary (the cap comes before it)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def run(self) -> list[dict[str, float]]:
        return [{"final_loss": 2.5}]


@pytest.mark.parametrize("dtype, said", [("float32", False), ("float64", False), ("bfloat16", True)])
def test_the_onednn_cap_is_said_only_for_a_run_that_computes_in_bfloat16(
    machine: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], dtype: str, said: bool  # noqa: F811
) -> None:
    (machine / "verdict").write_text("traps\n")
    monkeypatch.setenv(cpu_isa.ENV, "")
    monkeypatch.delenv(cpu_isa.ENV)  # recorded, so the cap set below is undone after the test
    monkeypatch.setattr(portapipe.launch, "LocalJob", _NoRanks)
    assert main(["train", str(EXAMPLE), "--set", f"log.dir={machine / 'run'}", "--set", f"model.dtype={dtype}"]) == 0
    err = capsys.readouterr().err
    assert (AMX_LINE in err) is said, err
    assert cpu_isa.os.environ[cpu_isa.ENV] == cpu_isa.BELOW_AMX  # set either way: harmless where it changes nothing


def _config(log_dir: Path):
    return config_from_dict({"log": {"dir": str(log_dir)}})


def test_a_symbolic_link_loop_as_log_dir_is_named_as_a_loop(tmp_path: Path) -> None:
    os.symlink("b", tmp_path / "a")
    os.symlink("a", tmp_path / "b")
    a, b = tmp_path / "a", tmp_path / "b"
    assert writable_problems(_config(a)) == [f"log.dir: {str(a)!r} is a loop of symbolic links ({a} -> {b} -> {a}); point it at a folder"]
    assert writable_problems(_config(a / "run")) == [
        f"log.dir: {str(a / 'run')!r} lies under {str(a)!r}, which is a loop of symbolic links ({a} -> {b} -> {a}); point it at a folder"
    ]


def test_a_symbolic_link_to_nothing_is_named_and_one_to_a_folder_is_followed(tmp_path: Path) -> None:
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    assert writable_problems(_config(tmp_path / "dangling")) == [
        f"log.dir: {str(tmp_path / 'dangling')!r} is a symbolic link to {str(tmp_path / 'gone')!r}, which does not exist; "
        "create that folder or point it elsewhere"
    ]
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "link")
    assert writable_problems(_config(tmp_path / "link" / "run")) == []
    assert (tmp_path / "real" / "run" / "checkpoints").is_dir()
