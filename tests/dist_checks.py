"""Functions run on gloo ranks by the backend tests (module-level so they can be pickled)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from portapipe.backends.base import Backend


def ring_p2p(backend: Backend) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    send = torch.arange(5, dtype=torch.float64) + 100 * rank
    recv = torch.empty(5, dtype=torch.float64)
    ops = [
        dist.P2POp(dist.isend, send, (rank + 1) % world),
        dist.P2POp(dist.irecv, recv, (rank - 1) % world),
    ]
    for work in backend.batch_isend_irecv(ops):
        work.wait()
    return recv.tolist()


def uneven_all_to_all(backend: Backend) -> dict[str, Any]:
    """Rank r sends r+j+1 rows to rank j; each row says (src, dst, row index)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    in_splits = [rank + j + 1 for j in range(world)]
    out_splits = [j + rank + 1 for j in range(world)]
    rows = [torch.tensor([rank, j, i], dtype=torch.float32) for j in range(world) for i in range(in_splits[j])]
    inp = torch.stack(rows)
    out = torch.empty(sum(out_splits), 3)
    work = backend.all_to_all_single(out, inp, out_splits, in_splits, async_op=True)
    work.wait()
    return {"out": out.tolist(), "out_splits": out_splits}


def reductions(backend: Backend) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((3,), float(rank + 1))
    backend.all_reduce(t)
    parts = [torch.empty(2) for _ in range(world)]
    backend.all_gather(parts, torch.tensor([rank, rank * rank], dtype=torch.float32))
    b = torch.tensor([float(rank)])
    backend.broadcast(b, src=world - 1)
    backend.barrier()
    return {"sum": t.tolist(), "gather": [p.tolist() for p in parts], "bcast": b.item()}


def mesh_groups(backend: Backend, pp: int, dp: int, ep: int) -> dict[str, Any]:
    g = backend.parallel_groups(pp, dp, ep)
    out: dict[str, Any] = {"coords": (g.pp_rank, g.dp_rank, g.ep_rank)}
    for name in ("pp", "dp", "ep", "replica"):
        t = torch.tensor([float(dist.get_rank())])
        backend.all_reduce(t, group=getattr(g, f"{name}_group"))
        out[name] = (sorted(getattr(g, f"{name}_ranks")), t.item())
    return out


def all_to_all_overlap(backend: Backend, numel: int, matmul_n: int, repeats: int) -> dict[str, Any]:
    """Rank 0 times an async all-to-all alone, a compute alone, and both together.

    Only rank 0 computes: the other rank's CPU serves the transfer, so on a 2-core machine the
    figure shows the overlap itself rather than two ranks competing for the cores.
    """
    rank = dist.get_rank()
    inp = torch.randn(numel)
    out = torch.empty(numel)
    a = torch.randn(matmul_n, matmul_n)
    computes = rank == 0

    def comm() -> Any:
        return backend.all_to_all_single(out, inp, async_op=True)

    reps = [1]

    def compute() -> None:
        if computes:
            for _ in range(reps[0]):
                a @ a

    def median(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            backend.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    comm().wait()  # warm the connections
    t_comm = median(lambda: comm().wait())
    # Size the compute to about twice the transfer, so a full overlap would halve the sum.
    t_one = median(compute)
    reps[0] = max(1, round(2 * t_comm / max(t_one, 1e-6)))
    t_compute = median(compute)
    done_during_compute = []

    def both() -> None:
        work = comm()
        t_issue = time.perf_counter()
        compute()
        done_during_compute.append(work.is_completed())
        work.wait()
        issue_times.append(t_issue)

    issue_times: list[float] = []
    t_both = median(both)
    return {
        "comm": t_comm,
        "compute": t_compute,
        "both": t_both,
        "completed_during_compute": sum(done_during_compute) / len(done_during_compute),
    }


def raise_at_start(backend: Backend, bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        raise RuntimeError(f"rank {bad_rank} refuses to start")
    # The healthy ranks block in a collective the failed rank never joins.
    backend.barrier()
    backend.barrier()


def hang_forever(backend: Backend) -> None:
    while True:
        time.sleep(0.1)


def stepping(backend: Backend, pid_dir: str, steps: int, poll_stop: bool, step_s: float = 0.05) -> dict[str, Any]:
    """Steps of a sleep and an all-reduce, as a training loop has; with ``poll_stop`` each step
    ends by agreeing on a stop (portapipe.stop) and returns early on one.

    Each rank writes ``rank{r}.pid`` once its process group is up, so a test can signal it.
    """
    import os

    from portapipe import stop

    rank = dist.get_rank()
    with open(os.path.join(pid_dir, f"rank{rank}.pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(pid_dir, f"rank{rank}.pid.tmp"), os.path.join(pid_dir, f"rank{rank}.pid"))
    flag = torch.ones(1)
    for step in range(steps):
        time.sleep(step_s)
        backend.all_reduce(flag)
        if poll_stop:
            sig = stop.agree(backend)
            if sig:
                return {"rank": rank, "stopped": sig, "steps": step + 1}
    return {"rank": rank, "stopped": None, "steps": steps}
