"""The NVSHMEM expert transport against the strict symmetric-memory double (tests/standin_nvshmem.py).

What hardware would do and the double enforces: allocation, and the op's NVSHMEM team made at
a group's first exchange, are collective over the whole job; each per-peer chunk must divide
evenly over the kernel's blocks per peer; and a buffer peers may still read is not rewritten by
the next exchange. ``test_nvshmem_expert_all_to_all_equals_nccl`` (tests/test_backend_cuda.py,
marked cuda) runs the real thing on two GPUs.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.distributed as dist

from portapipe.backends import nvshmem
from portapipe.backends.base import BackendUnavailable
from portapipe.backends.cuda import CUDABackend
from portapipe.ranks.launch import run_ranks

from . import nvshmem_checks
from .standin_nvshmem import SymmMemDouble, install, kernel_blocks_per_peer


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch):
    """The transport on one process: the double with a one-rank group."""
    double = SymmMemDouble()
    stream = install(monkeypatch.setattr, double)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    return double, stream


GROUP = types.SimpleNamespace(group_name="ep0")


# ------------------------------------------------------------------ 1: allocation at setup
@pytest.mark.multiproc
def test_pipeline_of_exchanges_runs_where_lazy_allocation_would_hang() -> None:
    """pp 2 x ep 2: stage 1 waits for stage 0's activations before its first exchange. Allocating
    at the first exchange, or leaving the op to make its NVSHMEM team there, would leave stage 0
    in a world-collective call that stage 1 never joins (the double times out after 10 s where
    the GPU job would hang). Every rank allocates the same buffers and makes the team (one empty
    exchange) at setup, and never again; 20- and 40-byte rows, buffers reused 3 times."""
    got = run_ranks(nvshmem_checks.pipeline_exchanges, 4, [5, 10], 3, 10.0, wall_timeout_s=120)
    # two input buffers, one output buffer (1 MiB each), the splits and two split/offset buffers
    want = [((2**20,), "torch.uint8")] * 3 + [((2,), "torch.int64")] + [((2, 2), "torch.int64")] * 2
    for res in got:
        assert res["allocs"] == want and res["allocs_after"] == len(want)
        assert res["rendezvous"] == 6 and res["teams"] == 1  # the team exists before the schedule
        assert res["world_collectives_after"] == res["world_collectives"]  # the exchanges made none
        assert res["same"] == [True] * 6 and res["op_calls"] == 1 + 6  # setup's empty exchange, then 6
    assert [r["ep_ranks"] for r in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_an_exchange_never_allocates_nor_makes_a_team(one_rank) -> None:
    double, _ = one_rank
    tr = nvshmem.NvshmemTransport(torch.device("cpu"), 4096)
    with pytest.raises(RuntimeError, match="not allocated at setup.*collective over the whole job"):
        tr.all_to_all(torch.empty(2, 3), torch.randn(2, 3), [2], [2], group=GROUP)
    assert double.allocs == [] and double.world_collectives == []
    tr.setup(GROUP)
    assert double.teams == {"ep0"}  # the op's world-collective team split ran at setup
    n, collectives = len(double.allocs), list(double.world_collectives)
    tr.all_to_all(torch.empty(2, 3), torch.randn(2, 3), [2], [2], group=GROUP)
    assert len(double.allocs) == n and double.world_collectives == collectives


@pytest.mark.parametrize(("ranks", "refusal"), [([3], "one-rank group"), ([0, 1, 3], "not evenly strided")])
def test_double_refuses_the_groups_torchs_team_manager_refuses(one_rank, monkeypatch, ranks, refusal) -> None:
    """TeamManager::group_to_team_pool: more than one rank, evenly strided global ranks."""
    double, _ = one_rank
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda pg: ranks)
    with pytest.raises(RuntimeError, match=refusal):
        double._make_team(object(), "g")
    assert double.teams == set() and double.world_collectives == []


def test_cuda_backend_sets_up_the_transport_in_parallel_groups(one_rank, monkeypatch) -> None:
    double, _ = one_rank
    seen = []
    monkeypatch.setattr(nvshmem.NvshmemTransport, "setup", lambda self, group=None: seen.append(group))
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend=None: types.SimpleNamespace(group_name=f"g{ranks}"))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    be = CUDABackend({"ep_transport": "nvshmem", "dist_backend": "gloo"})
    groups = be.parallel_groups(1, 1, 2)
    assert seen == [groups.ep_group]
    seen.clear()
    CUDABackend({"dist_backend": "gloo"}).parallel_groups(1, 1, 2)  # alltoall: nothing to set up
    assert seen == []


# ------------------------------------------------------------- 2: per-peer block rule
def test_double_refuses_chunks_that_do_not_divide_over_the_blocks(one_rank) -> None:
    double, _ = one_rank
    double.set_backend("NVSHMEM")
    bufs = [double.empty(2**20, dtype=torch.float32) for _ in range(2)]
    splits, oso = double.empty(1, dtype=torch.int64), double.empty(2, 1, dtype=torch.int64)
    for t in (*bufs, splits, oso):
        double.rendezvous(t, "g")
    splits.fill_(15)  # 60 bytes: 4 MiB of input means 64 blocks for the one peer
    with pytest.raises(RuntimeError, match="block_size \\* blocks_per_peer == peer_size"):
        double.all_to_all_vdev(bufs[0], bufs[1], splits, oso, "g")
    splits.fill_(16)
    double.all_to_all_vdev(bufs[0], bufs[1], splits, oso, "g")


@pytest.mark.parametrize("mb", [0.0625, 1, 3, 128])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 9, 16, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_padding_unit_satisfies_the_kernel_in_and_across_nodes(mb, world, dtype) -> None:
    cap = int(mb * 2**20)
    elem = torch.empty((), dtype=dtype).element_size()
    unit = nvshmem.chunk_unit(cap, world, elem)
    for intra in (True, False):
        assert (unit * elem) % kernel_blocks_per_peer(cap, world, intra) == 0
    assert unit * elem <= 2 * math.lcm(64, elem) * 16  # small: a padding, not a second buffer


def test_twenty_and_forty_byte_rows_pass_the_block_rule(one_rank) -> None:
    double, _ = one_rank
    tr = nvshmem.NvshmemTransport(torch.device("cpu"), 2**20)
    tr.setup(GROUP)
    for width in (5, 10):  # float32 rows of 20 and 40 bytes
        for rows in (1, 3, 7):
            x = torch.randn(rows, width)
            out = torch.empty(rows, width)
            tr.all_to_all(out, x, [rows], [rows], group=GROUP)
            assert torch.equal(out, x)
    assert len(double.op_calls) == 1 + 6  # setup's empty exchange, then the six


# ------------------------------------------------------------------ 3: buffer reuse
def test_double_refuses_the_same_input_buffer_twice_in_a_row(one_rank) -> None:
    double, _ = one_rank
    double.set_backend("NVSHMEM")
    inp, out = double.empty(4096, dtype=torch.uint8), double.empty(4096, dtype=torch.uint8)
    splits = double.empty(1, dtype=torch.int64)
    oso = [double.empty(2, 1, dtype=torch.int64) for _ in range(2)]
    for t in (inp, out, splits, *oso):
        double.rendezvous(t, "g")
    splits.fill_(64)
    double.all_to_all_vdev(inp, out, splits, oso[0], "g")
    with pytest.raises(RuntimeError, match="input buffer of the previous exchange is used again"):
        double.all_to_all_vdev(inp, out, splits, oso[1], "g")


def test_transport_alternates_buffers_and_orders_the_read_out(one_rank) -> None:
    """Double buffering: calls alternate input and split/offset buffers (setup's empty exchange
    took the first pair); each call waits for the previous call's read-out of the shared output
    buffer."""
    double, stream = one_rank
    assert torch.cuda.current_stream() == stream and torch.cuda.current_stream() is not stream  # a new wrapper, as torch's
    tr = nvshmem.NvshmemTransport(torch.device("cpu"), 4096)
    tr.setup(GROUP)
    bufs = tr._buffers["ep0"]
    used = []
    real_op = double.all_to_all_vdev

    def spy(inp, out, in_splits, oso, name):
        used.append((inp.data_ptr(), oso.data_ptr()))
        return real_op(inp, out, in_splits, oso, name)

    tr._all_to_all_vdev = lambda: spy
    events = []
    for i in range(4):
        x = torch.randn(3, 5) + i
        out = torch.empty(3, 5)
        work = tr.all_to_all(out, x, [3], [3], group=GROUP, async_op=True)
        work.wait()
        assert torch.equal(out, x)
        events.append(bufs.last_use)
    a = (bufs.inputs[0].data_ptr(), bufs.splits_offsets[0].data_ptr())
    b = (bufs.inputs[1].data_ptr(), bufs.splits_offsets[1].data_ptr())
    assert used == [b, a, b, a]
    waited = [e for e in stream.waited if e in events]
    assert waited[::2] == events  # call i+1 waited for call i's read-out (the odd ones are work.wait)


def test_overflow_and_bad_splits_are_named(one_rank) -> None:
    tr = nvshmem.NvshmemTransport(torch.device("cpu"), 4 * 16)
    tr.setup(GROUP)
    with pytest.raises(ValueError, match="nvshmem_buffer_mb"):
        tr.all_to_all(torch.empty(6, 3), torch.randn(6, 3), [6], [6], group=GROUP)
    with pytest.raises(ValueError, match="splits cover 6 input / 6 output elements but the tensors hold 6 / 9"):
        tr.all_to_all(torch.empty(3, 3), torch.randn(2, 3), [2], [2], group=GROUP)


# ------------------------------------------------------------------ 7: minimum torch
def test_nvshmem_refused_below_the_torch_that_has_its_apis(monkeypatch) -> None:
    from torch.distributed import _symmetric_memory as symm_mem

    monkeypatch.setattr(CUDABackend, "is_available", classmethod(lambda cls: True))
    monkeypatch.setattr(symm_mem, "is_nvshmem_available", lambda: True)
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    monkeypatch.delattr(symm_mem, "set_backend")  # as in 2.8
    with pytest.raises(BackendUnavailable, match=r"needs torch >= 2\.9: torch 2\.8\.0 is older than 2\.9"):
        CUDABackend({"ep_transport": "nvshmem"})


def test_nvshmem_refused_when_an_api_is_missing(monkeypatch) -> None:
    from torch.distributed import _symmetric_memory as symm_mem

    monkeypatch.setattr(CUDABackend, "is_available", classmethod(lambda cls: True))
    monkeypatch.delattr(symm_mem, "get_backend")
    with pytest.raises(BackendUnavailable, match=r"has no torch\.distributed\._symmetric_memory\.get_backend"):
        CUDABackend({"ep_transport": "nvshmem"})
