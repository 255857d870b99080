"""`portapipe init` writes the starter configs shipped in the package, which are examples/'s files."""

from __future__ import annotations

from pathlib import Path

import pytest

from portapipe.backends.registry import backend_class
from portapipe.cli import main
from portapipe.commands.init import starter_names
from portapipe.config import load_config
from portapipe.train import check_before_launch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PACKAGED = ROOT / "portapipe" / "configs"
NAMES = ["cpu", "cuda", "cuda_1gpu", "deepseek_v3", "npu", "qwen3_moe"]


def backend_available(name: str) -> bool:
    return backend_class(name).is_available()


def test_the_package_ships_examples_configs_as_links() -> None:
    """One source of truth: every top-level examples/*.yaml ships, as a link to it."""
    assert starter_names() == NAMES == sorted(p.stem for p in EXAMPLES.glob("*.yaml"))
    for name in NAMES:
        shipped = PACKAGED / f"{name}.yaml"
        assert shipped.is_symlink() and shipped.resolve() == (EXAMPLES / f"{name}.yaml").resolve(), name
    assert "configs/*.yaml" in (ROOT / "pyproject.toml").read_text()  # package data, so wheels carry them


def test_each_starter_logs_to_a_folder_of_its_own() -> None:
    """A GPU run started from the folder where `make train` ran must not resume the finished CPU
    run (and train nothing): every starter's log.dir is its own."""
    dirs = {name: load_config(EXAMPLES / f"{name}.yaml").log.dir for name in NAMES}
    assert len(set(dirs.values())) == len(NAMES), dirs
    assert all(d == f"runs/{name}" for name, d in dirs.items()), dirs


# ids name the files: a bare "cuda"/"npu" id would read as a device marker to tests/conftest.py.
@pytest.mark.parametrize("name", NAMES, ids=[f"{n}.yaml" for n in NAMES])
def test_init_writes_the_example_and_says_what_next(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["init", name, "--out", "mine.yaml"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (tmp_path / "mine.yaml").read_bytes() == (EXAMPLES / f"{name}.yaml").read_bytes()
    config = load_config(tmp_path / "mine.yaml")
    assert out[0].startswith(f"wrote mine.yaml: {config.model.arch} model on backend {config.backend}, 4 ranks")
    assert out[1].startswith("next") and "portapipe train mine.yaml" in out[1]
    if config.backend != "cpu" and not backend_available(config.backend):  # a device starter where the device is absent
        assert out[1].startswith(f"next, on a machine with backend {config.backend}: portapipe train mine.yaml   (not here: ")
    if config.data.format == "tokens":  # deepseek_v3: its token data must be written first, and init says so
        assert f"write its token data {config.data.path}" in out[1]
        with pytest.raises(Exception, match="data.path"):
            check_before_launch(config)
    else:
        check_before_launch(config)  # data, schedule and model all fit: `portapipe train` would start


def test_init_defaults_to_cpu_and_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["init"]) == 0
    assert (tmp_path / "cpu.yaml").read_bytes() == (EXAMPLES / "cpu.yaml").read_bytes()
    (tmp_path / "cpu.yaml").write_text("mine")
    capsys.readouterr()
    assert main(["init"]) == 2
    assert "cpu.yaml exists; pass --force" in capsys.readouterr().err
    assert (tmp_path / "cpu.yaml").read_text() == "mine"
    assert main(["init", "--force"]) == 0
    assert (tmp_path / "cpu.yaml").read_bytes() == (EXAMPLES / "cpu.yaml").read_bytes()


def test_init_refuses_unknown_names_and_missing_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init", "gpt", "--out", str(tmp_path / "g.yaml")]) == 2
    assert "no starter config 'gpt'; choose one of: cpu, cuda, cuda_1gpu, deepseek_v3, npu, qwen3_moe" in capsys.readouterr().err
    assert main(["init", "cpu", "--out", str(tmp_path / "no" / "c.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "g.yaml").exists()


def test_init_list_names_every_starter(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == NAMES
    assert "qwen3_moe model on backend cpu" in lines[-1]


def test_train_without_a_config_points_at_init(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert "train needs a config file" in err and "portapipe init" in err
