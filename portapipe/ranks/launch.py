"""Start ranks: locally (:mod:`portapipe.ranks.local_job`), or join torchrun / mpirun's ranks.

:func:`run_ranks` is the one way portapipe starts a distributed function, for the CLI, the
tests and the benchmarks. Each rank gets a ready backend (process group initialised, intra-op
threads set, bound to cores of its own with ``pin_cores`` (:mod:`portapipe.ranks.pinning`), SIGINT /
SIGTERM recorded for a graceful stop) and calls ``fn(backend, *args)``; the return values come
back in rank order.

Bounded failure: a rank that raises, dies or stalls ends every rank and is named in one line
(:class:`LaunchError`, its traceback attached); every collective has a timeout and every rank a
wall-clock watchdog, so nothing hangs; a launcher that dies takes its ranks with it. A local job
whose ranks failed while their process groups connected (gloo's full mesh: "Connection closed by
peer") is started again, at most :data:`CONNECT_RETRIES` times, with a line saying so; one that
failed otherwise, as its ``restarts`` say (:mod:`portapipe.ranks.restart`).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import pinning
from .local_job import LaunchError, LocalJob, error_line, error_types, write_record
from .restart import Restarts

__all__ = ["LaunchError", "run_ranks", "rank_threads", "local_ranks", "local_rank", "under_torchrun", "under_mpirun", "launching_rank",
           "print_launch_error", "debug_enabled"]

DEBUG_HINT = "rerun with log.level: debug (or PORTAPIPE_DEBUG=1) for the traceback"


def debug_enabled() -> bool:
    """True when tracebacks and the launcher's internals should be shown (PORTAPIPE_DEBUG=1)."""
    return os.environ.get("PORTAPIPE_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def under_mpirun() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"))


def launching_rank() -> int:
    """This process's rank when a launcher (torchrun, mpirun) made it one rank of the job, else 0.

    Read from the environment each launcher sets (torchrun's ``RANK``; Open MPI's, MPICH's and
    PMIx's own variables), so it is known before any process group exists.
    """
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


#: what each launcher calls the count of its ranks on this machine: torchrun, Open MPI, MPICH / Intel MPI (Hydra)
_LOCAL_SIZE_KEYS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
#: ... and this process's place among them (the local launcher sets LOCAL_RANK too), then SLURM's
_LOCAL_RANK_KEYS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


def local_rank() -> int:
    """This process's rank among the job's ranks on this machine (0 when no launcher says)."""
    for key in _LOCAL_RANK_KEYS:
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 0


def _slurm_tasks_here() -> int | None:
    """This node's task count from SLURM's ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE``
    (``4(x2),3``: four tasks on each of two nodes, then three) at ``SLURM_NODEID``, or
    ``SLURM_NTASKS_PER_NODE``; None when SLURM says nothing."""
    node = os.environ.get("SLURM_NODEID", "0")
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        text = os.environ.get(key)
        if not text or not node.isdigit():
            continue
        counts: list[int] = []
        for part in text.split(","):
            count, _, times = part.partition("(x")
            if not count.isdigit() or (times and not times.rstrip(")").isdigit()):
                counts = []
                break
            counts += [int(count)] * (int(times.rstrip(")")) if times else 1)
        if int(node) < len(counts):
            return counts[int(node)]
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "")
    return int(per_node) if per_node.isdigit() else None


def local_ranks(world_size: int) -> int:
    """The job's ranks on this machine: all ``world_size`` under the local launcher; under torchrun,
    mpirun or srun the count the launcher gives (``world_size`` when it gives none)."""
    if not (under_torchrun() or under_mpirun()):
        return world_size
    for key in _LOCAL_SIZE_KEYS:
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    here = _slurm_tasks_here()
    return here if here else world_size


def rank_threads(world_size: int) -> int:
    """Intra-op threads per unpinned rank: the cores this process may use (:func:`pinning.usable_cores`,
    not ``os.cpu_count()``: a container may allow fewer) shared out over this machine's ranks, at
    least one. A pinned rank runs one thread per core of its own set instead."""
    return max(1, len(pinning.usable_cores()) // local_ranks(world_size))


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


#: Messages of the errors a rank sees when a peer vanished (gloo raises a plain RuntimeError).
_PEER_GONE = (
    "gloo/transport",
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "remote process exited",
    "communicator was aborted",
)


#: torch's functions that make a process group and connect its ranks (gloo: a full mesh of pairs)
_CONNECTING = frozenset({"init_process_group", "new_group", "_new_group_with_tag", "_new_process_group_helper"})
#: times a local job whose ranks failed while connecting is started again
CONNECT_RETRIES = 2


def failed_connecting(exc: BaseException) -> bool:
    """True for a communication failure raised while torch made a process group and connected
    its ranks (read from the traceback): no rank's own work had begun."""
    if not is_comm_error(exc):
        return False
    return any(
        frame.f_code.co_name in _CONNECTING and frame.f_code.co_filename.endswith("distributed_c10d.py")
        for frame, _ in traceback.walk_tb(exc.__traceback__)
    )


def is_comm_error(exc: BaseException) -> bool:
    """True for a communication failure, the kind a rank sees when a peer died or stalled."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    text = str(exc)
    return isinstance(exc, (RuntimeError, ConnectionError)) and any(marker in text for marker in _PEER_GONE)


def _rank_main(
    fn: Callable[..., Any],
    backend_name: str,
    backend_options: dict[str, Any] | None,
    threads: int,
    pg_timeout_s: float,
    wall_timeout_s: float,
    args: tuple[Any, ...],
    cores: list[list[int]] | None = None,
    job_dir: str | None = None,
) -> Any:
    """Body of every rank: bind it to its cores (``cores``: each local rank's, or None), set its
    threads, arm the watchdog, init the backend, run ``fn``."""
    from . import stop

    stop.install()  # first: a stop asked for while this rank starts is not lost
    from ..backends import get_backend

    if cores is not None:
        here = local_rank()
        if here >= len(cores):
            raise LaunchError(f"local rank {here} of {len(cores)} ranks on this machine: the launcher's LOCAL_RANK and LOCAL_WORLD_SIZE disagree")
        mine = cores[here]
        pinning.pin(mine)  # before torch starts its thread pool, which then inherits the binding
        threads = len(mine)
    os.environ["OMP_NUM_THREADS"] = str(max(1, threads))  # for what this rank starts
    torch.set_num_threads(max(1, threads))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stacks = open(Path(job_dir) / f"rank{rank}.stacks", "w") if job_dir else None
    if wall_timeout_s > 0:
        # A rank stuck past its budget dumps its stacks and exits; the launcher then ends the rest.
        faulthandler.dump_traceback_later(wall_timeout_s, exit=True, file=stacks or sys.stderr)
    backend = None
    try:
        backend = get_backend(backend_name, backend_options)
        backend.init_process_group(rank, world, timeout_s=pg_timeout_s)
        return fn(backend, *args)
    except BaseException as exc:
        if job_dir:
            # The first rank to fail is the cause; its peers fail because it is gone (communication
            # errors). Record which kind this is, and when, before this rank's connections close.
            line = error_line(exc)
            comm = is_comm_error(exc)
            write_record(job_dir, rank, line, traceback.format_exc(), comm=comm, connecting=failed_connecting(exc), types=error_types(exc))
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        if stacks is not None:
            stacks.close()
            if os.path.getsize(stacks.name) == 0:
                os.remove(stacks.name)
        if backend is not None:
            backend.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "cpu",
    backend_options: dict[str, Any] | None = None,
    threads: int = 1,
    pg_timeout_s: float = 60.0,
    wall_timeout_s: float = 600.0,
    stall_timeout_s: float = 60.0,
    stop_grace_s: float = 60.0,
    start_method: str = "forkserver",
    low_precision: bool = True,
    pin_cores: pinning.PinMode = False,
    restarts: Restarts | None = None,
) -> list[Any]:
    """Run ``fn(backend, *args)`` on ``world_size`` ranks; return the results in rank order.

    Under torchrun or mpirun this process is one rank already: ``fn`` runs here and the list
    holds this rank's result only. ``fn`` and ``args`` must be picklable (module-level).
    ``stall_timeout_s``: a local rank silent this long is named and the job ended (0: never);
    ``stop_grace_s``: after SIGINT / SIGTERM, how long the ranks may take to finish their step
    before they are killed. On a graceful stop the ranks' results are returned as usual.
    ``start_method`` is multiprocessing's; ``fork`` can hang a rank in its first parallel torch
    operation when this process already ran threads (their locks are copied held), so the
    default starts ranks from a clean server process. ``low_precision``: the ranks may compute
    in bfloat16 (False for a float32 / float64 run, where capping oneDNN is not worth a line).
    ``pin_cores`` (``launch.pin_cores``: True, "auto" or False): each of this machine's ranks bound
    to cores of its own, with one intra-op thread per core instead of ``threads``; True with more
    ranks here than usable cores raises ConfigError before any rank starts. A local job whose ranks
    failed while their process groups connected is started again (at most ``CONNECT_RETRIES``
    times, one line on stderr each): ``fn`` must make its groups before work it cannot repeat.
    ``restarts`` (:class:`~portapipe.ranks.restart.Restarts`): a local job that fails is started
    again as it says, with the arguments it gives (under torchrun / mpirun their own options do that).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if under_mpirun() and not under_torchrun():
        _env_from_mpi()
    refuse_unlaunchable(backend, backend_options, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    cores = pinning.plan(pin_cores, local_ranks(world_size))
    if under_torchrun() or under_mpirun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise LaunchError(f"the config asks for {world_size} ranks but the launcher started {os.environ['WORLD_SIZE']}")
        return [_rank_main(fn, backend, backend_options, threads, pg_timeout_s, wall_timeout_s, args, cores)]
    cap_cpu_isa(say=low_precision)

    def launch(job_args: tuple[Any, ...]) -> list[Any]:
        body_args = (fn, backend, backend_options, threads, pg_timeout_s, wall_timeout_s, job_args, cores)
        return _connected(body_args, world_size, threads, stall_timeout_s, stop_grace_s, wall_timeout_s, pg_timeout_s, start_method)

    return launch(args) if restarts is None else restarts.run(launch, args)


def _connected(body_args: tuple[Any, ...], world_size: int, threads: int, stall_timeout_s: float, stop_grace_s: float,
               wall_timeout_s: float, pg_timeout_s: float, start_method: str) -> list[Any]:
    """One local launch; started again (at most ``CONNECT_RETRIES`` times) while its ranks fail connecting."""
    retries = 0
    while True:
        job = LocalJob(_rank_main, body_args, world_size, threads, stall_timeout_s, stop_grace_s, wall_timeout_s, pg_timeout_s, start_method)
        try:
            return job.run()
        except LaunchError as err:
            if not err.connecting:
                raise
            if retries == CONNECT_RETRIES:
                raise LaunchError(f"{err} (the ranks failed to connect {retries + 1} times)", err.rank, err.traceback) from None
            retries += 1
            print(f"portapipe: {' '.join(str(err).split())}, while the ranks connected; starting them again "
                  f"(retry {retries} of {CONNECT_RETRIES})", file=sys.stderr, flush=True)


def refuse_unlaunchable(backend: str, backend_options: dict[str, Any] | None, local_ranks: int) -> None:
    """Before any rank starts: BackendUnavailable (one line, exit 2 from the CLI) where the
    backend cannot run ``local_ranks`` ranks on this machine (NCCL: one rank per GPU)."""
    from ..backends.base import BackendUnavailable
    from ..backends.registry import backend_class, resolve_name

    problem = backend_class(resolve_name(backend)).launch_problem(local_ranks, backend_options)
    if problem:
        raise BackendUnavailable(problem)


def cap_cpu_isa(say: bool = True) -> None:
    """Before this process or its ranks run a bfloat16 matmul: keep oneDNN below an instruction
    set the CPU advertises but a process may not use (:mod:`portapipe.ranks.cpu_isa`), saying so once
    when ``say``. AMX serves only bfloat16 (and int8) matmuls, so the cap changes nothing for a
    run in float32 or float64: it is then set without a word."""
    from .cpu_isa import cap_if_amx_traps

    cap_if_amx_traps((lambda line: print(f"portapipe: {line}", file=sys.stderr, flush=True)) if say else None)


def print_launch_error(err: LaunchError) -> int:
    """Print one line naming the rank and the cause (the rank's traceback only when debugging);
    return the exit code: 130 / 143 for a job ended by SIGINT / SIGTERM, else 1."""
    from . import stop

    line = " ".join(str(err).split())
    details = bool(err.traceback.strip()) and err.traceback.strip() != str(err).strip()
    if details and debug_enabled():
        print(err.traceback.rstrip(), file=sys.stderr)
    print(f"portapipe: {line}" + (f"; {DEBUG_HINT}" if details and not debug_enabled() else ""), file=sys.stderr)
    return stop.exit_code(err.stop_signal) if err.stop_signal else 1
