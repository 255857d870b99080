"""A stop signal is recorded, agreed over ranks, and a second one ends the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from portapipe.ranks import stop


def test_first_signal_is_recorded_not_fatal() -> None:
    saved = {s: signal.getsignal(s) for s in stop.STOP_SIGNALS}
    try:
        stop.install()
        assert stop.received() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received() == signal.SIGTERM
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_a_second_signal_ends_the_process() -> None:
    code = "from portapipe.ranks import stop; import os, signal; stop.install(); os.kill(os.getpid(), signal.SIGTERM); print('first', flush=True); os.kill(os.getpid(), signal.SIGINT); print('alive')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGINT
    assert out.stdout.split() == ["first"]


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_exit_codes_follow_the_shell(signum: int, code: int) -> None:
    assert stop.exit_code(signum) == code
