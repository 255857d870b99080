"""Importing portapipe never imports torch_npu nor initialises CUDA; missing devices exit 2.

Each check runs in a fresh interpreter, since this test process may already hold either.
A decoy ``torch_npu`` package on the path records any import of it, so the first check fails
if any portapipe module imports torch_npu, whether or not the real one is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from portapipe.backends.ascend import AscendBackend
from portapipe.backends.cuda import CUDABackend

ROOT = Path(__file__).resolve().parents[1]

_IMPORT_ALL = textwrap.dedent(
    """
    import importlib, json, logging, os, pkgutil, sys
    import torch

    lazy_inits = []
    _real_lazy_init = torch.cuda._lazy_init
    def _spy():
        lazy_inits.append(1)
        return _real_lazy_init()
    torch.cuda._lazy_init = _spy  # anything that would create a CUDA context passes here

    import portapipe
    errors = {}
    names = []
    for info in pkgutil.walk_packages(portapipe.__path__, "portapipe."):
        if info.name.endswith("__main__"):
            continue
        names.append(info.name)
        try:
            importlib.import_module(info.name)
        except Exception as exc:
            errors[info.name] = f"{type(exc).__name__}: {exc}"
    after_import = "torch_npu" in sys.modules

    auto, log_lines = None, []
    if sys.argv[1] == "probe":
        # Presence checks and `auto` must not need device software either.
        class Keep(logging.Handler):
            def emit(self, record):
                log_lines.append(record.getMessage())
        logging.getLogger("portapipe").addHandler(Keep())
        logging.getLogger("portapipe").setLevel(logging.INFO)
        from portapipe.backends import registry
        registry.info()
        auto = registry.resolve_name("auto")
    print(json.dumps({
        "modules": names, "errors": errors, "torch_npu_after_import": after_import,
        "torch_npu_at_end": "torch_npu" in sys.modules,
        "decoy_imported": os.path.exists(os.environ["DECOY_MARK"]),
        "lazy_inits": len(lazy_inits), "cuda_initialized": torch.cuda.is_initialized(),
        "auto": auto, "log": log_lines,
    }))
    """
)


def _run(args: list[str], env_extra: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = os.environ.copy()
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_importing_every_module_imports_no_torch_npu_and_initialises_no_cuda(tmp_path) -> None:
    decoy = tmp_path / "decoy" / "torch_npu"
    decoy.mkdir(parents=True)
    mark = tmp_path / "decoy_imported"
    (decoy / "__init__.py").write_text(
        f"open({str(mark)!r}, 'w').write('imported')\nraise ImportError('decoy torch_npu imported')\n"
    )
    # Presence probes may import torch_npu where an NPU is present: that is their job there.
    mode = "probe" if not AscendBackend.device_present() else "import-only"
    proc = _run(
        ["-c", _IMPORT_ALL, mode],
        {
            "PYTHONPATH": f"{tmp_path / 'decoy'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "DECOY_MARK": str(mark),
            # torch's own device-backend autoload would import a real torch_npu (here: the decoy)
            # during `import torch`; that is torch's doing, not portapipe's, so it is switched off.
            "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "portapipe.backends.cuda" in out["modules"] and "portapipe.backends.ascend" in out["modules"]
    assert out["errors"] == {}, out["errors"]
    assert out["torch_npu_after_import"] is False
    assert out["decoy_imported"] is False
    assert out["torch_npu_at_end"] is False
    assert out["lazy_inits"] == 0 and out["cuda_initialized"] is False
    if mode == "probe" and not CUDABackend.device_present():
        # Acceptance: `auto` with neither device picks cpu and says so.
        assert out["auto"] == "cpu"
        assert any("using backend 'cpu'" in line for line in out["log"]), out["log"]


# The CLI checks share one interpreter (each start costs seconds): `portapipe.cli.main` is
# what the console script runs, so its return value is the exit code. Every GPU is hidden, so
# the cuda check holds on any machine, a GPU runner included.
_CLI_CHECKS = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from portapipe.cli import main

    def cli(*argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(argv))
        return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}

    examples = sys.argv[1]
    print(json.dumps({
        "train_cuda": cli("train", examples + "/cuda.yaml", "--steps", "1"),
        "train_npu": cli("train", examples + "/npu.yaml", "--steps", "1") if sys.argv[2] == "npu" else None,
        "info": cli("info", "--compact"),
    }))
    """
)


@pytest.fixture(scope="module")
def cli_checks() -> dict:
    npu_here = AscendBackend.is_available()
    proc = _run(["-c", _CLI_CHECKS, str(ROOT / "examples"), "skip" if npu_here else "npu"], {"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_backend_cuda_without_a_visible_gpu_exits_2_naming_it(cli_checks) -> None:
    res = cli_checks["train_cuda"]
    assert res["rc"] == 2, res
    assert "backend 'cuda' is not available" in res["stderr"]
    assert "NVIDIA GPU" in res["stderr"] or "without CUDA" in res["stderr"]


def test_backend_npu_without_an_npu_exits_2_naming_it(cli_checks) -> None:
    res = cli_checks["train_npu"]
    if res is None:
        pytest.skip("this machine has a usable NPU: backend npu runs here")
    assert res["rc"] == 2, res
    assert "backend 'npu' is not available" in res["stderr"]
    assert "torch_npu" in res["stderr"] and "CANN" in res["stderr"]


def test_info_reports_missing_devices_as_json(cli_checks) -> None:
    assert cli_checks["info"]["rc"] == 0, cli_checks["info"]
    info = json.loads(cli_checks["info"]["stdout"])
    cuda = info["backends"]["cuda"]
    assert cuda["available"] is False and "backend 'cuda' is not available" in cuda["missing"]
    assert info["backends"]["cuda"]["dist_backend"] == "nccl"
    assert info["backends"]["npu"]["dist_backend"] == "hccl"
    if not AscendBackend.is_available():
        assert "portapipe[npu]" in info["backends"]["npu"]["missing"]
