"""Communication costs for ``portapipe profile``: all-to-all and all-reduce over groups of 2, 4,
... ranks, point-to-point between two ranks, each at two sizes (latency and bytes per second
from the least disturbed call); for the all-to-all and point-to-point also the processor time
the process's other threads (gloo's) spend on them, which competes with the compute of ranks
sharing a host's processors, and what a transfer adds while the other ranks compute."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ..models.expert_parallel import ExpertParallel
from ..scheduling.exchange import exchange
from .measure_clock import cpu, least_time, mean_over, rounds, spin
from .profile import Linear

#: round trips between two ranks cost well under a millisecond each here: the least of this many,
#: whatever ``reps`` says, so that a loaded host's delays do not bend the latency's line (from a
#: few, the largest size's delay could outweigh the one-row message's whole latency)
P2P_REPS = 20


def communication(
    backend: Any, world: int, hidden: int, dtype: torch.dtype, rows: int, reps: int, ep: int, span: float, processors: float | None
) -> dict[str, Any]:
    """All-to-all and all-reduce over the first n ranks (n = 2, 4, ..., world, and ``ep``), p2p
    between ranks 0 and 1: latency and bytes per second from the least disturbed of ``reps``
    calls; what the communication threads spend, with ``span`` seconds of compute between calls;
    on a host with fewer processors than ranks, what a transfer adds while the others compute."""
    rank = dist.get_rank()
    sizes = sorted({n for n in (2, 4, 8, 16, 32, 64, world, ep) if 2 <= n <= world})
    groups = {n: backend.new_group(list(range(n))) for n in sizes}
    a2a: dict[str, Linear] = {}
    issue: dict[str, float] = {}  # issuing an all-to-all: what the caller's thread pays before it can go on
    background: dict[str, Linear] = {}  # what the communication threads pay per all-to-all
    allreduce: dict[str, Linear] = {}
    for n, group in groups.items():
        if rank < n:
            ep = ExpertParallel(backend, n, rank, group)
            pts, ar, bg = [], [], []
            for r in (max(2, rows // 16), rows):
                per = max(1, r // n)
                x = torch.randn(per * n, hidden, dtype=dtype)
                splits = [per] * n
                exchange(ep, x, splits, splits).wait()  # warm up
                t = least_time(lambda: exchange(ep, x, splits, splits).wait(), reps)
                issued = []
                for _ in range(reps):
                    t0 = cpu()
                    pending = exchange(ep, x, splits, splits)
                    issued.append(cpu() - t0)
                    pending.wait()
                issue[str(n)] = statistics.median(issued)
                sent = per * (n - 1) * hidden * x.element_size()
                pts.append((sent, t))
                bg.append((sent, rounds(lambda: exchange(ep, x, splits, splits).wait(), [span], 12 * reps)[1]))
                flat = torch.zeros(r * hidden, dtype=dtype)
                backend.all_reduce(flat, group=group)
                ar.append((flat.numel() * flat.element_size(), least_time(lambda: backend.all_reduce(flat, group=group), reps)))
            spent = mean_over(backend, [b for _, b in bg], group, n)
            a2a[str(n)], allreduce[str(n)] = Linear.fit(pts), Linear.fit(ar)
            background[str(n)] = Linear.fit([(sent, b) for (sent, _), b in zip(bg, spent)])
        dist.barrier()
    p2p, p2p_bg = Linear(), Linear()
    posts: list[float] = []
    if world >= 2:
        pts, bg_pts = [], []
        # a one-row message anchors the latency: from two large sizes alone the intercept is a
        # small difference of noisy times and can come out negative (then clamped to 0)
        for r in (1, max(2, rows // 16), rows):
            buf, got = torch.zeros(r * hidden, dtype=dtype), torch.zeros(r * hidden, dtype=dtype)

            def round_trip(buf: torch.Tensor = buf) -> None:
                if rank == 0:
                    t0 = cpu()
                    works = backend.batch_isend_irecv([dist.P2POp(dist.isend, buf, 1)])
                    posts.append(cpu() - t0)  # posting alone: what the sender's thread pays
                    for w in works:
                        w.wait()
                    for w in backend.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 1)]):
                        w.wait()
                elif rank == 1:
                    for w in backend.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 0)]):
                        w.wait()
                    for w in backend.batch_isend_irecv([dist.P2POp(dist.isend, buf, 0)]):
                        w.wait()

            def both_ways() -> None:  # as a stage does: post, compute, then wait
                peer = 1 - rank
                works = backend.batch_isend_irecv([dist.P2POp(dist.isend, buf, peer), dist.P2POp(dist.irecv, got, peer)])
                spin(span)
                for w in works:
                    w.wait()

            if rank < 2:
                round_trip()
                nbytes = buf.numel() * buf.element_size()
                pts.append((nbytes, least_time(round_trip, max(reps, P2P_REPS)) / 2))
                # a round both ways is one send and one receive at each end
                bg_pts.append((nbytes, mean_over(backend, [rounds(both_ways, [0.0], 12 * reps)[1] / 2], groups[2], 2)[0]))
            dist.barrier()
        p2p = Linear.fit(pts) if rank == 0 else p2p
        p2p_bg = Linear.fit(bg_pts) if rank == 0 else p2p_bg
    crowded: dict[str, float] = {}
    if processors is not None and world > processors:
        # the same transfers while every other rank computes: the communication threads wait
        # for a processor
        n, posted = 12 * reps, len(posts)
        if rank < 2:
            t0 = time.perf_counter()
            for _ in range(n):
                round_trip()
            crowded[str(world)] = max(0.0, (time.perf_counter() - t0) / n / 2 - p2p(buf.numel() * buf.element_size()))
            del posts[posted:]
        else:
            spin(n * 4 * max(p2p.fixed, 1e-3))  # longer than the transfers take
        dist.barrier()
    return {
        "a2a": a2a, "issue_s": issue, "a2a_cpu": background, "allreduce": allreduce, "p2p": p2p, "p2p_cpu": p2p_bg,
        "p2p_crowded": crowded, "post_s": statistics.median(posts) if posts else 0.0,
    }
