"""Graceful stop of a running job: SIGINT / SIGTERM ask every rank to finish its step and stop.

A rank calls :func:`install` once (the launcher does, before the rank's function runs). The
first SIGINT or SIGTERM is only recorded; the training loop asks :func:`agree` at the end of each
step, and all ranks see the same answer (one small all-reduce), so they stop after the same step,
write a checkpoint and return. A second signal of the same kind means "now": the default action
is restored and the signal re-raised, so an impatient user is never stuck.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_received: int | None = None


def _handler(signum: int, frame: Any) -> None:
    global _received
    if _received is None:
        _received = signum
        return
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


def install() -> None:
    """Record SIGINT / SIGTERM instead of dying at once (main thread only; elsewhere a no-op).

    Where the handlers are in force already (``portapipe train`` installs them first thing, then
    the same process becomes a rank under torchrun / mpirun), a signal recorded meanwhile is kept.
    """
    global _received
    if not installed():
        _received = None
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handler)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """:func:`install` for the duration of a ``with`` block, the previous handlers restored after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    install()
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def installed() -> bool:
    """True while this module's handlers are the process's handlers of both stop signals."""
    return all(signal.getsignal(sig) is _handler for sig in STOP_SIGNALS)


def received() -> int | None:
    """The stop signal this process received since :func:`install`, or None."""
    return _received


def agree(backend: Any, group: Any = None) -> int | None:
    """The stop signal any rank of ``group`` (default: the world) received, the same on every rank.

    Collective: every rank of the group must call it at the same point of the step.
    """
    import torch  # here, not on import: the CLI records stop signals before torch loads

    dtype = getattr(torch, backend.capabilities.widest_reduce_dtype)  # a signal number is exact in either
    flag = torch.tensor([float(_received or 0)], dtype=dtype, device=backend.device())
    backend.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    sig = int(flag.item())
    return sig or None


def exit_code(signum: int) -> int:
    """The shell's exit status for a process ended by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)
