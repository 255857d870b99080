"""The CPU/gloo backend on real ranks: batched p2p, uneven all-to-all, reductions, mesh groups."""

from __future__ import annotations

import pytest
import torch

from portapipe.backends import get_backend, mesh_coords
from portapipe.backends.base import grouped_mm_reference
from portapipe.ranks.launch import run_ranks

from . import dist_checks


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_ring_p2p(world: int) -> None:
    got = run_ranks(dist_checks.ring_p2p, world)
    for rank, recv in enumerate(got):
        src = (rank - 1) % world
        assert recv == [100.0 * src + i for i in range(5)]


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_single_uneven_splits(world: int) -> None:
    got = run_ranks(dist_checks.uneven_all_to_all, world)
    for rank, res in enumerate(got):
        # From source j, rank receives j+rank+1 rows tagged (j, rank, i), in source order.
        expect = [[float(j), float(rank), float(i)] for j in range(world) for i in range(j + rank + 1)]
        assert res["out"] == expect


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_reductions(world: int) -> None:
    got = run_ranks(dist_checks.reductions, world)
    total = float(sum(range(1, world + 1)))
    for res in got:
        assert res["sum"] == [total] * 3
        assert res["gather"] == [[float(r), float(r * r)] for r in range(world)]
        assert res["bcast"] == float(world - 1)
    ranks_sum = world * (world + 1) // 2
    whole = [float(i * ranks_sum) for i in range(2 * world)]
    for rank, res in enumerate(got):
        assert res["shard"] == whole[2 * rank : 2 * rank + 2]
        assert res["joined"] == whole


@pytest.mark.multiproc
def test_parallel_groups_on_a_2x2_mesh() -> None:
    got = run_ranks(dist_checks.mesh_groups, 4, 2, 1, 2)
    for rank, res in enumerate(got):
        pp_rank, dp_rank, ep_rank = mesh_coords(rank, 2, 1, 2)
        assert tuple(res["coords"]) == (pp_rank, dp_rank, ep_rank)
        ep_ranks = [pp_rank * 2 + e for e in range(2)]
        pp_ranks = [p * 2 + ep_rank for p in range(2)]
        assert res["ep"] == (ep_ranks, float(sum(ep_ranks)))
        assert res["pp"] == (pp_ranks, float(sum(pp_ranks)))
        assert res["dp"] == ([rank], float(rank))
        assert res["replica"] == (ep_ranks, float(sum(ep_ranks)))


@pytest.mark.multiproc
def test_async_all_to_all_returns_before_the_exchange_and_delivers() -> None:
    """gloo runs the all-to-all on its own thread: the call returns while the peer has not yet
    joined, so rank 0 computes with the exchange in flight, and the data arrives whole."""
    delay = 2.0
    res = run_ranks(dist_checks.all_to_all_async_issue, 2, delay)[0]
    assert res["issue_s"] < delay / 2, res  # did not block until the late peer joined
    assert res["pending_at_issue"] and res["pending_after_compute"], res
    assert res["out"] == [0.0, 1.0, 10.0, 11.0], res


def test_mesh_coords_layout() -> None:
    # ep innermost, then dp, then pp.
    assert [mesh_coords(r, 2, 2, 2) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]
    with pytest.raises(ValueError, match="outside a mesh"):
        mesh_coords(8, 2, 2, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_mm_matches_per_group_matmul(dtype: torch.dtype) -> None:
    backend = get_backend("cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, generator=g, dtype=dtype)
    w = torch.randn(3, 16, 8, generator=g, dtype=dtype)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)  # the middle group is empty
    out = backend.grouped_mm(x, w, offs)
    expect = torch.cat([x[:4] @ w[0], x[10:10] @ w[1], x[4:] @ w[2]])
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    # 2d x 2d: the weight-gradient form.
    gy = torch.randn(10, 8, generator=g, dtype=dtype)
    dw = backend.grouped_mm(x.t().contiguous(), gy, offs)
    torch.testing.assert_close(dw[0], x[:4].t() @ gy[:4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw[1], torch.zeros(16, 8, dtype=dtype))
    torch.testing.assert_close(dw[2], x[4:].t() @ gy[4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped_mm_reference(x, w, offs), expect)


def test_cpu_backend_identity_and_timer() -> None:
    backend = get_backend("cpu")
    assert (backend.name, backend.dist_backend, str(backend.device())) == ("cpu", "gloo", "cpu")
    with backend.stream(backend.comm_stream()):
        ev = backend.event()
        ev.record()
    backend.synchronize()
    with backend.timed() as t:
        sum(range(10000))
    assert t.elapsed_s > 0
    backend.manual_seed(3)
    state = backend.get_rng_state()
    a = torch.rand(3)
    backend.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
    assert backend.max_memory_allocated() > 0
    assert backend.memory_allocated() is None
