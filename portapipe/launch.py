"""Start ranks: locally through torch's elastic launcher, or join torchrun / mpirun's ranks.

:func:`run_ranks` is the one way portapipe starts a distributed function, for the CLI, the
tests and the benchmarks. Each rank gets a ready backend (process group initialised, threads
pinned) and calls ``fn(backend, *args)``; the return values come back in rank order.

Bounded failure: a rank that raises ends every rank (the elastic agent stops the others) and
its traceback is raised here as :class:`LaunchError`; every collective has a timeout and every
rank a wall-clock watchdog, so nothing hangs.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("portapipe.launch")


class LaunchError(RuntimeError):
    """A rank failed; ``rank`` and ``traceback`` say which and why."""

    def __init__(self, message: str, rank: int | None = None, traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def under_mpirun() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"))


def _env_from_mpi() -> None:
    """Take rank / world / master address from MPI (needs the ``mpi`` extra)."""
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise LaunchError("running under mpirun needs mpi4py: pip install 'portapipe[mpi]'") from exc
    comm = MPI.COMM_WORLD
    addr_port = (socket.gethostbyname(socket.gethostname()), _free_port()) if comm.Get_rank() == 0 else None
    addr, port = comm.bcast(addr_port, root=0)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    os.environ.update(
        RANK=str(comm.Get_rank()),
        WORLD_SIZE=str(comm.Get_size()),
        LOCAL_RANK=str(local.Get_rank()),
        LOCAL_WORLD_SIZE=str(local.Get_size()),
        MASTER_ADDR=os.environ.get("MASTER_ADDR", addr),
        MASTER_PORT=os.environ.get("MASTER_PORT", str(port)),
    )


def _rank_main(
    fn: Callable[..., Any],
    backend_name: str,
    backend_options: dict[str, Any] | None,
    threads: int,
    pg_timeout_s: float,
    wall_timeout_s: float,
    args: tuple[Any, ...],
    error_dir: str | None = None,
) -> Any:
    """Body of every rank: pin threads, arm the watchdog, init the backend, run ``fn``."""
    from .backends import get_backend

    torch.set_num_threads(max(1, threads))
    if wall_timeout_s > 0:
        # A rank stuck past its budget dumps its stacks and exits; the agent then stops the rest.
        faulthandler.dump_traceback_later(wall_timeout_s, exit=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = None
    try:
        backend = get_backend(backend_name, backend_options)
        backend.init_process_group(rank, world, timeout_s=pg_timeout_s)
        return fn(backend, *args)
    except BaseException:
        if error_dir:
            # The first rank to fail is the cause; the others fail because it is gone. Record
            # when each failed, to the nanosecond and before its connections close, so the
            # launcher can show the cause.
            with open(os.path.join(error_dir, f"rank{rank}.json"), "w") as f:
                json.dump({"rank": rank, "time_ns": time.time_ns(), "traceback": traceback.format_exc()}, f)
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        if backend is not None:
            backend.destroy_process_group()


def _first_failure(error_dir: str) -> tuple[int, str] | None:
    records = []
    for name in os.listdir(error_dir):
        with open(os.path.join(error_dir, name)) as f:
            records.append(json.load(f))
    if not records:
        return None
    first = min(records, key=lambda r: r["time_ns"])
    return int(first["rank"]), str(first["traceback"])


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "cpu",
    backend_options: dict[str, Any] | None = None,
    threads: int = 1,
    pg_timeout_s: float = 60.0,
    wall_timeout_s: float = 600.0,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(backend, *args)`` on ``world_size`` ranks; return the results in rank order.

    Under torchrun or mpirun this process is one rank already: ``fn`` runs here and the list
    holds this rank's result only. ``fn`` and ``args`` must be picklable (module-level).
    ``start_method`` is multiprocessing's; ``fork`` starts faster but can hang a rank in its
    first parallel torch operation when this process already ran threads (their locks are
    copied held), so the default starts ranks from a clean server process.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if under_mpirun() and not under_torchrun():
        _env_from_mpi()
    if under_torchrun() or under_mpirun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise LaunchError(f"the config asks for {world_size} ranks but the launcher started {os.environ['WORLD_SIZE']}")
        return [_rank_main(fn, backend, backend_options, threads, pg_timeout_s, wall_timeout_s, args)]

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"portapipe-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method=start_method,
    )
    # The agent's own chatter (warnings about OMP threads, stack dumps of healthy ranks being
    # stopped) would drown the one traceback that matters; it is raised below instead.
    quiet = ["torch.distributed.elastic", "torch.distributed.launcher"]
    saved = {name: logging.getLogger(name).level for name in quiet}
    for name in quiet:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    saved_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(max(1, threads))
    error_dir = tempfile.mkdtemp(prefix="portapipe-errors-")
    try:
        results = elastic_launch(config, _rank_main)(
            fn, backend, backend_options, threads, pg_timeout_s, wall_timeout_s, args, error_dir
        )
    except ChildFailedError as err:
        found = _first_failure(error_dir)
        if found is None:
            rank, failure = err.get_first_failure()
            tb = f"rank {rank} exited with code {failure.exitcode} (killed, timed out or crashed without a Python traceback)"
        else:
            rank, tb = found
        raise LaunchError(f"rank {rank} failed:\n{tb}", rank=rank, traceback=tb) from None
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
        if saved_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_omp
    return [results[r] for r in range(world_size)]


def print_launch_error(err: LaunchError) -> None:
    print(f"portapipe: {err}", file=sys.stderr)
