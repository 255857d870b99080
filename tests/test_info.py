"""`portapipe info` prints JSON describing torch, the known backends and what auto picks."""

from __future__ import annotations

import json
import subprocess
import sys


def test_info_prints_valid_json_with_the_fields() -> None:
    proc = subprocess.run([sys.executable, "-m", "portapipe.cli", "info"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    for key in ("portapipe", "torch", "backends_known", "backends", "available", "auto", "device_counts"):
        assert key in info, key
    assert info["backends_known"][:4] == ["auto", "cpu", "cuda", "npu"]
    assert info["backends"]["cpu"]["available"] is True
    assert info["backends"]["cpu"]["dist_backend"] == "gloo"
    # every backend's declaration, read from its class (no device needed)
    from portapipe.backends.registry import backend_class

    for name in ("cpu", "cuda", "npu"):
        assert info["backends"][name]["capabilities"] == backend_class(name).capabilities.as_dict()
    assert "float64" not in info["backends"]["npu"]["capabilities"]["reduce_dtypes"]
    assert info["backends"]["cuda"]["capabilities"]["ep_transports"] == ["alltoall", "nvshmem"]
    assert "cpu" in info["available"]
    # auto picks a present device; this machine class (CI) has neither GPU nor NPU.
    present = [n for n in ("cuda", "npu") if info["backends"].get(n, {}).get("device_present")]
    assert info["auto"] == (present[0] if present else "cpu")


def test_cli_without_command_shows_help_and_exits_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "portapipe.cli"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "COMMAND" in proc.stdout
