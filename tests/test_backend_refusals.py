"""A backend's limits refused when the config loads, exit 2, one line naming the key: a reduce
dtype the backend does not reduce (a float32-only plug-in, npu) and a plug-in whose module does
not import. The example plug-in of tests/plugin_example is also run as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import yaml

from portapipe.backends import registry
from portapipe.backends.cpu import CPUBackend
from portapipe.config import ConfigError, load_config

from . import plugin_env
from .test_attacks_input import cli, no_ranks  # noqa: F401  (no_ranks: a fixture)
from .test_backend_plugin import CONFIG
from .plugin_example.portapipe_example_backend import Float32Backend

GONE = EntryPoint(name="gone", value="no_such_module_xyz:Backend", group=registry.ENTRY_POINT_GROUP)
GONE_LINE = (
    "backend: 'gone': the plug-in entry point gone = no_such_module_xyz:Backend (group portapipe.backends) fails to import: "
    "ModuleNotFoundError: No module named 'no_such_module_xyz'; reinstall the package that provides it, or choose another backend"
)


class _EntryPoint:
    def __init__(self, obj: object) -> None:
        self.value, self._obj = f"tests:{getattr(obj, '__name__', '?')}", obj

    def load(self) -> object:
        return self._obj


@pytest.fixture()
def plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """example32 (the example plug-in's class: no float64 compute nor reduction) and a plug-in whose module is gone."""
    monkeypatch.setattr(registry, "_plugins", lambda: {"example32": _EntryPoint(Float32Backend), "gone": GONE})


def _config(tmp_path: Path, **sections: dict) -> Path:
    raw = {**CONFIG, "log": {"progress": False, "dir": str(tmp_path / "run")}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _line(key: str, value: str, replicas: int, backend: str, fix: str) -> str:
    return (f"{key}: {value}: the gradients of the {replicas} replicas (dp x ep) are summed in float64, which backend {backend!r} "
            f"does not reduce (capabilities.reduce_dtypes: float32, bfloat16, float16); {fix}")


# ------------------------------------------------------------------- B9: the reduce dtype
@pytest.mark.parametrize(
    "train, line",
    [
        ({"master_dtype": "float64"}, _line("train.master_dtype", "float64", 2, "example32", "set train.grad_reduce_dtype to one of those")),
        ({"grad_reduce_dtype": "float64"}, _line("train.grad_reduce_dtype", "float64", 2, "example32", "use one of those")),
    ],
)
def test_a_reduce_dtype_the_plugin_does_not_reduce_exits_2_naming_the_key(tmp_path, capsys, no_ranks, plugins, train, line) -> None:
    code, lines = cli(capsys, "train", str(_config(tmp_path, train=train)))
    assert code == 2 and lines == [f"portapipe: config error: {line}"], lines


def test_what_the_plugin_reduces_still_loads(tmp_path, plugins) -> None:
    """float64 master weights summed in float32; float64 asked for where nothing is summed (dp = ep = 1)."""
    load_config(_config(tmp_path, train={"master_dtype": "float64", "grad_reduce_dtype": "float32"}))
    load_config(_config(tmp_path, train={"master_dtype": "float64"}, parallel={"pp": 2, "ep": 1, "dp": 1}))


def test_npu_refuses_a_float64_reduction_as_the_plugin_does(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_config(tmp_path, backend="npu", parallel={"pp": 1, "ep": 2, "dp": 2}, train={"grad_reduce_dtype": "float64"}))
    assert info.value.problems == [_line("train.grad_reduce_dtype", "float64", 4, "npu", "use one of those")]


def test_auto_is_checked_again_once_its_device_is_found(tmp_path, capsys, no_ranks, monkeypatch) -> None:
    """backend auto on an Ascend machine: refused before launch, as backend npu is."""
    monkeypatch.setattr(registry, "get_backend", lambda name, options=None: CPUBackend(options))
    monkeypatch.setattr(registry, "resolve_name", lambda name: "npu" if name == "auto" else name)
    code, lines = cli(capsys, "train", str(_config(tmp_path, backend="auto", train={"master_dtype": "float64"})))
    assert code == 2 and lines == [f"portapipe: config error: {_line('train.master_dtype', 'float64', 2, 'npu', 'set train.grad_reduce_dtype to one of those')}"]


# ------------------------------------------------------------ B13: a plug-in that does not import
def test_a_plugin_whose_module_does_not_import_exits_2_naming_backend_and_the_entry_point(tmp_path, capsys, no_ranks, plugins) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"backend": "gone"})
    assert info.value.problems == [GONE_LINE]
    code, lines = cli(capsys, "train", str(_config(tmp_path, backend="gone")))
    assert code == 2 and lines == [f"portapipe: config error: {GONE_LINE}"], lines


# ------------------------------------------------------- both, with the plug-in installed for real
def _portapipe(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "portapipe.cli", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_installed_plugin_is_refused_before_launch_in_one_line(tmp_path: Path) -> None:
    """The issue's runs: exit 1 from a rank (TypeError: all_reduce in float64) and exit 1 with a
    bare ModuleNotFoundError; now exit 2 and one line each, before any rank starts."""
    path = _config(tmp_path)
    proc = _portapipe(plugin_env.install(tmp_path / "site"), tmp_path, "train", str(path), "--set", "train.master_dtype=float64")
    line = _line("train.master_dtype", "float64", 2, "example32", "set train.grad_reduce_dtype to one of those")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [f"portapipe: config error: {line}"], proc.stderr[-2000:]
    proc = _portapipe(plugin_env.install(tmp_path / "gone", entry="portapipe_no_such_backend:Backend"), tmp_path, "train", str(path))
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith(
        "portapipe: config error: backend: 'example32': the plug-in entry point example32 = portapipe_no_such_backend:Backend "
        "(group portapipe.backends) fails to import: ModuleNotFoundError: No module named 'portapipe_no_such_backend'"
    ), proc.stderr
