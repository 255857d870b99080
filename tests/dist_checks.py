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
    # the distributed optimizer's pair: rank r gets slice r of the sum, then the slices are joined
    full = torch.arange(2.0 * world) * (rank + 1)
    shard = torch.empty(2)
    backend.reduce_scatter_tensor(shard, full)
    joined = torch.empty(2 * world)
    backend.all_gather_into_tensor(joined, shard, async_op=True).wait()
    backend.barrier()
    return {"sum": t.tolist(), "gather": [p.tolist() for p in parts], "bcast": b.item(), "shard": shard.tolist(), "joined": joined.tolist()}


def mesh_groups(backend: Backend, pp: int, dp: int, ep: int) -> dict[str, Any]:
    g = backend.parallel_groups(pp, dp, ep)
    out: dict[str, Any] = {"coords": (g.pp_rank, g.dp_rank, g.ep_rank)}
    for name in ("pp", "dp", "ep", "replica"):
        t = torch.tensor([float(dist.get_rank())])
        backend.all_reduce(t, group=getattr(g, f"{name}_group"))
        out[name] = (sorted(getattr(g, f"{name}_ranks")), t.item())
    return out


def all_to_all_async_issue(backend: Backend, delay_s: float) -> dict[str, Any]:
    """Rank 0 issues an async all-to-all while rank 1 joins it ``delay_s`` late.

    What the overlap relies on, checked without timing ratios: the call returns a pending
    handle at once (before the peer has even joined), rank 0 computes with the exchange in
    flight, and ``wait()`` then delivers the right data.
    """
    rank = dist.get_rank()
    inp = torch.arange(4, dtype=torch.float64) + 10 * rank
    out = torch.empty(4, dtype=torch.float64)
    backend.barrier()
    if rank == 1:
        time.sleep(delay_s)
    t0 = time.perf_counter()
    work = backend.all_to_all_single(out, inp, async_op=True)
    issue_s = time.perf_counter() - t0
    pending_at_issue = not work.is_completed()
    a = torch.randn(64, 64)
    for _ in range(4):
        a = a @ a / 64  # compute while the exchange is in flight
    pending_after_compute = not work.is_completed()
    work.wait()
    return {"issue_s": issue_s, "pending_at_issue": pending_at_issue, "pending_after_compute": pending_after_compute, "out": out.tolist()}


def raise_checkpoint_error(backend: Backend, bad_rank: int) -> None:
    """Rank ``bad_rank`` fails as a checkpoint write does: an exception of portapipe's own (not built in)."""
    from portapipe.checkpoint.files import CheckpointWriteError

    if dist.get_rank() == bad_rank:
        raise CheckpointWriteError("cannot write step_00000002 in /nowhere: No space left on device")
    backend.barrier()


def raise_at_start(backend: Backend, bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        raise RuntimeError(f"rank {bad_rank} refuses to start")
    # The healthy ranks block in a collective the failed rank never joins.
    backend.barrier()
    backend.barrier()


#: what gloo raises when a peer closes a pair of the full mesh while connecting
CLOSED_BY_PEER = "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40013"


class _ClosedByPeer:
    """Stands in for torch's ProcessGroupGloo: its connect fails as a closed pair does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(CLOSED_BY_PEER)


def connect_failing(backend: Backend, folder: str, failures: int, after_groups: bool = False) -> int:
    """Rank 1's process groups fail to connect in the job's first ``failures`` launches (counted in
    ``folder``): its new groups' gloo connect raises (``after_groups``: the same error raised by
    plain code once the groups are made, not while connecting). Returns the launch's number."""
    from pathlib import Path

    import torch.distributed.distributed_c10d as c10d

    launch = 0
    if dist.get_rank() == 1:
        launch = len(list(Path(folder).glob("launch-*")))
        (Path(folder) / f"launch-{launch}").touch()
        if launch < failures and not after_groups:
            c10d.ProcessGroupGloo = _ClosedByPeer  # this rank's process only
    backend.parallel_groups(1, 1, dist.get_world_size())
    if dist.get_rank() == 1 and launch < failures and after_groups:
        raise RuntimeError(CLOSED_BY_PEER)
    backend.barrier()
    return launch


def fail_by_launch(backend: Backend, folder: str, errors: list[str]) -> int:
    """Rank 1 raises ``errors[i]`` (a built-in exception's name) in the job's launch ``i`` (counted in
    ``folder``), nothing once they run out; every rank returns the launch's number."""
    import builtins
    from pathlib import Path

    launch = len(list(Path(folder).glob(f"launch-{dist.get_rank()}-*")))
    (Path(folder) / f"launch-{dist.get_rank()}-{launch}").touch()
    if dist.get_rank() == 1 and launch < len(errors):
        raise getattr(builtins, errors[launch])(f"launch {launch} fails")
    backend.barrier()
    return launch


def hang_forever(backend: Backend) -> None:
    while True:
        time.sleep(0.1)


def stepping(backend: Backend, pid_dir: str, steps: int, poll_stop: bool, step_s: float = 0.05) -> dict[str, Any]:
    """Steps of a sleep and an all-reduce, as a training loop has; with ``poll_stop`` each step
    ends by agreeing on a stop (portapipe.ranks.stop) and returns early on one.

    Each rank writes ``rank{r}.pid`` once its process group is up, so a test can signal it.
    """
    import os

    from portapipe.ranks import stop

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
