"""The launcher: a failing rank ends every rank promptly with its traceback; no hangs."""

from __future__ import annotations

import time

import pytest

from portapipe.launch import LaunchError, run_ranks

from . import dist_checks


@pytest.mark.multiproc
def test_rank_raising_at_start_ends_the_launch_with_its_traceback() -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_ranks(dist_checks.raise_at_start, 4, 2)
    elapsed = time.monotonic() - t0
    assert info.value.rank == 2
    assert "rank 2 refuses to start" in info.value.traceback
    assert "raise_at_start" in info.value.traceback
    assert elapsed < 60, elapsed


@pytest.mark.multiproc
def test_a_hung_rank_is_stopped_by_its_watchdog() -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_ranks(dist_checks.hang_forever, 2, wall_timeout_s=3)
    assert time.monotonic() - t0 < 60
    assert info.value.rank in (0, 1)


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(dist_checks.ring_p2p, 0)
