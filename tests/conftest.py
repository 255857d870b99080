"""Test-suite wiring: device markers skip themselves where the device is absent, saying which."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from portapipe.ranks.cpu_isa import cap_if_amx_traps  # imports no torch

# Before torch's first matmul: this session and every rank it starts (they inherit the
# environment) stay below an instruction set the CPU advertises but a process dies using.
cap_if_amx_traps()

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


@pytest.fixture(autouse=True)
def isa_cap_kept() -> Iterator[None]:
    """A test that leaves ``ONEDNN_MAX_CPU_ISA`` otherwise than it found it fails: this process's
    oneDNN read the variable once, every later launch passes it to its ranks, and a pipelined step
    computed with other kernels than its one-process reference is not what a check compares."""
    from portapipe.ranks.cpu_isa import ENV

    before = os.environ.get(ENV)
    yield
    after = os.environ.get(ENV)
    if after != before:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before
        pytest.fail(f"the test left {ENV}={after!r} (it was {before!r} before it): restored; undo it in the test")


@pytest.fixture
def bench_module() -> Callable[[str], ModuleType]:
    """Import a script of benchmarks/ by name (they are scripts beside each other, not a package)."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")

    def load(name: str) -> ModuleType:
        sys.path.insert(0, folder)
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(folder)

    return load
