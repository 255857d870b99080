"""oneDNN is kept below AMX where the CPU advertises it but a process dies using it: probed once
per boot in a child process, only where the CPU lists AMX and the variable is unset."""

from __future__ import annotations

from pathlib import Path

import pytest

from portapipe.ranks import cpu_isa

DIES = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"
RUNS = "pass"


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A CPU listing AMX, no variable set, a verdict cache of its own."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")
    monkeypatch.setattr(cpu_isa, "CPUINFO", cpuinfo)
    monkeypatch.setattr(cpu_isa, "cache_file", lambda: tmp_path / "verdict")
    # set, then deleted: monkeypatch records the variable either way, so a cap a test sets is undone
    # (a delenv of an absent variable records nothing, and the cap would reach every later launch's ranks)
    monkeypatch.setenv(cpu_isa.ENV, "")
    monkeypatch.delenv(cpu_isa.ENV)
    return tmp_path


def test_a_probe_that_dies_of_sigill_caps_onednn_and_says_so_once(machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "PROBE", DIES)
    said: list[str] = []
    assert cpu_isa.cap_if_amx_traps(said.append) is True
    assert cpu_isa.os.environ[cpu_isa.ENV] == "AVX512_CORE_BF16"
    assert said == [
        "this CPU advertises AMX but a process that uses it dies (SIGILL); ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 is set "
        "to keep oneDNN below it (set the variable yourself to choose)"
    ]
    assert cpu_isa.cap_if_amx_traps(said.append) is False and len(said) == 1  # set already: nothing more to do
    assert (machine / "verdict").read_text() == "traps\n"


def test_the_verdict_is_cached_so_the_probe_runs_once(machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "PROBE", DIES)
    assert cpu_isa.amx_traps() is True
    monkeypatch.setattr(cpu_isa, "PROBE", RUNS)  # a second probe would say otherwise: it is not run
    assert cpu_isa.amx_traps() is True
    (machine / "verdict").unlink()
    assert cpu_isa.amx_traps() is False and (machine / "verdict").read_text() == "ok\n"


def test_a_cpu_where_amx_works_or_is_not_listed_is_left_alone(machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "PROBE", RUNS)
    assert cpu_isa.cap_if_amx_traps() is False and cpu_isa.ENV not in cpu_isa.os.environ
    (machine / "verdict").unlink()
    (machine / "cpuinfo").write_text("flags\t\t: fpu avx512f avx512_bf16\n")
    monkeypatch.setattr(cpu_isa, "PROBE", DIES)
    assert cpu_isa.cap_if_amx_traps() is False and not (machine / "verdict").exists()  # no AMX listed: no probe


def test_a_variable_the_user_set_is_kept_and_no_probe_runs(machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "PROBE", DIES)
    monkeypatch.setenv(cpu_isa.ENV, "AVX2")
    assert cpu_isa.cap_if_amx_traps() is False
    assert cpu_isa.os.environ[cpu_isa.ENV] == "AVX2" and not (machine / "verdict").exists()
    assert cpu_isa.sigill_hint().endswith("ONEDNN_MAX_CPU_ISA is AVX2 here: set it lower")


def test_the_cap_comes_at_launch_so_bad_input_is_still_one_line(machine: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from portapipe.cli import main

    (machine / "verdict").write_text("traps\n")
    example = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"
    assert main(["train", str(example), "--set", f"log.dir={machine / 'run'}", "--set", f"data.path={machine / 'missing.txt'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"portapipe: config error: data.path: {str(machine / 'missing.txt')!r} does not exist or is not a file"]
    assert cpu_isa.ENV not in cpu_isa.os.environ
