"""Test-suite wiring: device markers skip themselves where the device is absent, saying which."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


def _cap_onednn_isa_if_amx_traps() -> None:
    """Some virtual machines advertise AMX in cpuid without letting a process use it: oneDNN then
    picks AMX for bfloat16 matmuls and the process dies of SIGILL. Probe once in a child process
    (only where the CPU claims AMX) and, if it dies so, keep oneDNN below AMX for this session and
    every rank it starts (they inherit the environment). Must run before torch's first matmul."""
    if "ONEDNN_MAX_CPU_ISA" in os.environ:
        return
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return
    if "amx_bf16" not in flags:
        return
    probe = "import torch; x = torch.ones(32, 32, dtype=torch.bfloat16); x @ x"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120)
    if proc.returncode == -signal.SIGILL:
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"


_cap_onednn_isa_if_amx_traps()

import torch  # noqa: E402  (after the ISA cap: oneDNN reads it at its first use)


def _present(name: str) -> bool:
    from portapipe.backends.registry import backend_class

    try:
        return bool(backend_class(name).is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Device tests run where the device is, or where ci/test.sh asked for them explicitly
    # (then a missing device fails loudly instead of skipping).
    required = set(filter(None, os.environ.get("PORTAPIPE_REQUIRE_DEVICES", "").split(",")))
    for device in ("cuda", "npu"):
        if device in required or _present(device):
            continue
        skip = pytest.mark.skip(reason=f"needs a {device.upper()} device ({device} backend not available on this machine)")
        for item in items:
            if item.get_closest_marker(device) is not None:
                item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def one_thread() -> Iterator[None]:
    """One intra-op thread for the whole session, as each rank has: the tensors are small, the
    cores shared, and results compared bit for bit must not depend on a thread count changing
    between a fixture and its test."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
