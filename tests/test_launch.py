"""The launcher: a failing rank ends every rank promptly with its traceback; no hangs."""

from __future__ import annotations

import time

import pytest

from portapipe.ranks.launch import LaunchError, run_ranks

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
def test_a_failed_rank_is_named_with_the_exceptions_own_name_not_its_module_path() -> None:
    with pytest.raises(LaunchError) as info:
        run_ranks(dist_checks.raise_checkpoint_error, 2, 1)
    assert str(info.value) == "rank 1 failed: CheckpointWriteError: cannot write step_00000002 in /nowhere: No space left on device"
    assert "portapipe.checkpoint.files.CheckpointWriteError" in info.value.traceback  # the details keep the full path


def test_an_exception_is_said_by_its_name_and_its_message_on_one_line() -> None:
    from portapipe.checkpoint.files import CheckpointWriteError
    from portapipe.ranks.local_job import error_line

    assert error_line(CheckpointWriteError("no space\n  on /x")) == "CheckpointWriteError: no space on /x"
    assert error_line(KeyboardInterrupt()) == "KeyboardInterrupt"


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


_LAUNCHER_KEYS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                  "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMIX_RANK", "MPI_LOCALNRANKS", "SLURM_NODEID",
                  "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")


@pytest.mark.parametrize(
    "env, world, threads",
    [
        ({}, 4, 4),  # the local launcher: every rank on this machine
        ({"RANK": "5", "WORLD_SIZE": "16", "MASTER_ADDR": "n0", "LOCAL_WORLD_SIZE": "4"}, 16, 4),  # torchrun, 4 machines
        ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 8, 8),  # mpirun, 2 per machine
        ({"PMI_RANK": "1", "MPI_LOCALNRANKS": "8"}, 32, 2),  # MPICH / Intel MPI
        ({"PMIX_RANK": "9", "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "4(x2),2"}, 10, 8),  # srun: the third node holds 2
        ({"PMIX_RANK": "0", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "4(x2),2"}, 10, 4),
        ({"PMI_RANK": "0", "SLURM_NTASKS_PER_NODE": "16"}, 64, 1),
        ({"RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "n0"}, 8, 2),  # a launcher that says nothing: all ranks counted here
    ],
)
def test_rank_threads_share_this_machines_cores_over_this_machines_ranks(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], world: int, threads: int
) -> None:
    from portapipe.ranks import pinning
    from portapipe.ranks.launch import rank_threads

    for key in _LAUNCHER_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(pinning, "usable_cores", lambda: list(range(16)))  # the cores this process may use
    assert rank_threads(world) == threads


# ------------------------------------------------------------------ a rendezvous that fails to connect
@pytest.mark.multiproc
def test_a_job_whose_ranks_fail_to_connect_is_started_again_with_a_line_saying_so(tmp_path, capfd) -> None:
    """gloo's full-mesh connect failing ("Connection closed by peer") in a new group of rank 1,
    the first launch: the launcher starts the job again, says so in one line, and returns the
    second launch's results."""
    results = run_ranks(dist_checks.connect_failing, 2, str(tmp_path), 1)
    assert results[1] == 1  # rank 1's second launch
    err = capfd.readouterr().err.splitlines()
    retry = [line for line in err if "starting them again" in line]
    assert retry == [f"portapipe: rank 1 failed: RuntimeError: {dist_checks.CLOSED_BY_PEER}, while the ranks connected; "
                     "starting them again (retry 1 of 2)"], err


@pytest.mark.multiproc
def test_a_job_that_keeps_failing_to_connect_stops_after_the_bounded_retries(tmp_path, capfd) -> None:
    from portapipe.ranks.launch import CONNECT_RETRIES

    with pytest.raises(LaunchError) as info:
        run_ranks(dist_checks.connect_failing, 2, str(tmp_path), 100)
    assert len(list(tmp_path.glob("launch-*"))) == CONNECT_RETRIES + 1
    assert str(info.value) == f"rank 1 failed: RuntimeError: {dist_checks.CLOSED_BY_PEER} (the ranks failed to connect 3 times)"
    assert sum("starting them again" in line for line in capfd.readouterr().err.splitlines()) == CONNECT_RETRIES


@pytest.mark.multiproc
def test_the_same_error_once_the_groups_are_made_is_not_retried(tmp_path, capfd) -> None:
    """Only a failure while connecting is started again: the same message from a rank at work
    (a peer gone mid-run) ends the job at once."""
    with pytest.raises(LaunchError) as info:
        run_ranks(dist_checks.connect_failing, 2, str(tmp_path), 1, True)
    assert info.value.rank == 1 and not info.value.connecting
    assert len(list(tmp_path.glob("launch-*"))) == 1
    assert "starting them again" not in capfd.readouterr().err
