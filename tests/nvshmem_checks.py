"""The NVSHMEM transport on gloo ranks, with the strict symmetric-memory double (module-level
functions so the launcher can start them in fresh processes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from portapipe.backends.base import Backend

from . import standin_nvshmem


def pipeline_exchanges(backend: Backend, widths: list[int], repeats: int, collective_timeout_s: float) -> dict[str, Any]:
    """pp 2 x ep 2 with ``ep_transport: nvshmem`` on the doubles, shaped like a pipeline step:
    stage 1 receives from stage 0 before each of its expert exchanges, stage 0 sends after its own.

    Float32 rows of ``width`` columns (20 and 40 bytes for 5 and 10), uneven splits, each
    exchange compared with gloo's ``all_to_all_single``; ``repeats`` exchanges per width back to
    back on the same buffers. Returns what setup allocated and whether each exchange was right.
    """
    from portapipe.backends.cuda import CUDABackend

    double = standin_nvshmem.SymmMemDouble(world_group=standin_nvshmem.world_group(collective_timeout_s))
    standin_nvshmem.install(setattr, double)
    be = CUDABackend({"ep_transport": "nvshmem", "dist_backend": "gloo", "nvshmem_buffer_mb": 1})
    groups = be.parallel_groups(2, 1, 2)
    at_setup = {
        "allocs": [(tuple(t.shape), str(t.dtype)) for t in double.allocs],
        "rendezvous": len(double.rendezvoused),
        "teams": len(double.teams),
        "world_collectives": list(double.world_collectives),
        "ep_ranks": groups.ep_ranks,
    }
    rank, ep = groups.rank, groups.ep
    peer_stage = groups.global_rank(1 - groups.pp_rank)
    same: list[bool] = []
    for width in widths:
        for step in range(repeats):
            token = torch.zeros(1)
            if groups.pp_rank == 1:
                dist.recv(token, src=peer_stage)  # the stage's input arrives first
            in_splits = [(rank * 3 + j * 5 + step + width) % 4 + 1 for j in range(ep)]
            counts = torch.tensor(in_splits)
            got_counts = torch.empty_like(counts)
            dist.all_to_all_single(got_counts, counts, group=groups.ep_group)
            out_splits = got_counts.tolist()
            g = torch.Generator().manual_seed(1000 * rank + 10 * width + step)
            x = torch.randn(sum(in_splits), width, generator=g) + token
            got = torch.empty(sum(out_splits), width)
            work = be.expert_all_to_all(got, x, out_splits, in_splits, group=groups.ep_group, async_op=True)
            work.wait()
            want = torch.empty_like(got)
            dist.all_to_all_single(want, x, out_splits, in_splits, group=groups.ep_group)
            same.append(bool(torch.equal(got, want)))
            if groups.pp_rank == 0:
                dist.send(got.sum().reshape(1), dst=peer_stage)
    return {
        **at_setup,
        "same": same,
        "allocs_after": len(double.allocs),
        "world_collectives_after": list(double.world_collectives),
        "op_calls": len(double.op_calls),
    }
