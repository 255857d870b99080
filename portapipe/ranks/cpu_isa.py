"""Keep oneDNN below an instruction set the CPU advertises but a process may not use.

Some virtual machines advertise AMX in cpuid without letting a process use it: oneDNN, which
torch calls for bfloat16 matmuls on the CPU, then picks AMX and the process dies of SIGILL.
:func:`cap_if_amx_traps` finds out once per boot (a tiny bfloat16 matmul in a child process,
only where /proc/cpuinfo lists ``amx_bf16`` and ``ONEDNN_MAX_CPU_ISA`` is unset) and, if the
child dies so, sets ``ONEDNN_MAX_CPU_ISA`` for this process and every process it starts.
It must run before this process's first bfloat16 matmul: oneDNN reads the variable once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

ENV = "ONEDNN_MAX_CPU_ISA"
#: The highest oneDNN level below AMX (AVX-512 with bfloat16 instructions).
BELOW_AMX = "AVX512_CORE_BF16"
CPUINFO = Path("/proc/cpuinfo")
PROBE = "import torch; x = torch.ones(32, 32, dtype=torch.bfloat16); x @ x"


def sigill_hint() -> str:
    """Why a process can die of SIGILL on a CPU that runs everything else, and the way out."""
    cause = "a CPU can advertise an instruction set that a process may not use (e.g. AMX in some virtual machines)"
    if os.environ.get(ENV):
        return f"{cause}; {ENV} is {os.environ[ENV]} here: set it lower"
    return f"{cause}; {ENV}={BELOW_AMX} keeps oneDNN below AMX"


def cache_file() -> Path | None:
    """One verdict per boot, user and torch release (oneDNN's choice of kernel comes with torch)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        torch_version = metadata.version("torch")
    except (OSError, metadata.PackageNotFoundError):
        return None
    return Path(tempfile.gettempdir()) / f"portapipe-amx-{os.getuid()}-{boot}-{torch_version}"


def amx_traps() -> bool:
    """True when this CPU lists AMX but a bfloat16 matmul kills the process that runs it."""
    try:
        if "amx_bf16" not in CPUINFO.read_text():
            return False
    except OSError:
        return False
    cache = cache_file()
    if cache is not None and cache.is_file():
        return cache.read_text().strip() == "traps"
    env = {k: v for k, v in os.environ.items() if k != ENV}
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False  # no verdict (a machine this loaded is no evidence either way); ask again next time
    traps = proc.returncode == -signal.SIGILL
    if cache is not None:
        try:
            tmp = cache.with_name(f"{cache.name}.{os.getpid()}")
            tmp.write_text("traps\n" if traps else "ok\n")
            os.replace(tmp, cache)
        except OSError:
            pass  # no cache: the probe runs again next time
    return traps


def cap_if_amx_traps(say: Callable[[str], None] | None = None) -> bool:
    """Set ``ONEDNN_MAX_CPU_ISA`` below AMX when AMX traps here and the variable is unset;
    True when it was set now (``say`` gets one line saying so)."""
    if ENV in os.environ or not amx_traps():
        return False
    os.environ[ENV] = BELOW_AMX
    if say is not None:
        say(
            f"this CPU advertises AMX but a process that uses it dies (SIGILL); {ENV}={BELOW_AMX} is set "
            "to keep oneDNN below it (set the variable yourself to choose)"
        )
    return True
