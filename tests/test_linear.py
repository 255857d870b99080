"""Linear and grouped-linear layers: gradients equal torch's, deferred or not, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from portapipe.backends.cpu import CPUBackend
from portapipe.models.linear import grouped_linear, linear
from portapipe.scheduling.wgrad import WeightGradQueue, deferring


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_linear_matches_torch_gradients() -> None:
    x, w, g = _rand(3, 5, 7, seed=1), _rand(4, 7, seed=2), _rand(3, 5, 4, seed=3)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    linear(xa, wa).backward(g)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(xb, wb).backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-14, atol=0)
    torch.testing.assert_close(wa.grad, wb.grad, rtol=1e-14, atol=0)


def test_linear_deferred_weight_grad_is_identical_and_waits_for_the_queue() -> None:
    x, w, g = _rand(6, 8, seed=4), _rand(5, 8, seed=5), _rand(6, 5, seed=6)
    full_x, full_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    linear(full_x, full_w).backward(g)

    dx, dw = x.clone().requires_grad_(), w.clone().requires_grad_()
    queue = WeightGradQueue()
    with deferring(queue):
        linear(dx, dw).backward(g)
    assert torch.equal(dx.grad, full_x.grad)
    assert dw.grad is None and len(queue) == 1  # B done, W pending
    queue.run()
    assert torch.equal(dw.grad, full_w.grad) and len(queue) == 0


def test_deferred_weight_grads_accumulate_over_microbatches() -> None:
    w = _rand(3, 4, seed=7).requires_grad_()
    xs, gs = [_rand(2, 4, seed=10 + i) for i in range(3)], [_rand(2, 3, seed=20 + i) for i in range(3)]
    queue = WeightGradQueue()
    for x, g in zip(xs, gs):
        with deferring(queue):
            linear(x, w).backward(g)
    queue.run()
    want = sum(g.t() @ x for x, g in zip(xs, gs))
    torch.testing.assert_close(w.grad, want, rtol=1e-14, atol=0)


@pytest.mark.parametrize("defer", [False, True])
def test_heads_linear_equals_linear_of_merged_heads_and_keeps_no_copy(defer: bool) -> None:
    """linear(o, heads=True) is linear over o's merged heads, bit for bit (values, both
    gradients, deferred or not), and what it keeps for backward is ``o`` itself."""
    o, w, g = _rand(2, 3, 5, 4, seed=30), _rand(6, 12, seed=31), _rand(2, 5, 6, seed=32)
    oa, wa = o.clone().requires_grad_(), w.clone().requires_grad_()
    want = linear(oa.transpose(1, 2).reshape(2, 5, 12), wa)
    want.backward(g)
    ob, wb = o.clone().requires_grad_(), w.clone().requires_grad_()
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        got = linear(ob, wb, heads=True)
    queue = WeightGradQueue() if defer else None
    with deferring(queue):
        got.backward(g)
    if queue is not None:
        queue.run()
    assert torch.equal(got, want)
    assert torch.equal(ob.grad, oa.grad) and torch.equal(wb.grad, wa.grad)
    assert [t.shape for t in kept] == [ob.shape, wb.shape]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grouped_linear_forward_and_gradients_match_per_group_matmuls(dtype: torch.dtype) -> None:
    backend = CPUBackend()
    counts = [3, 0, 5, 2]  # an empty group too
    offs = torch.tensor(counts).cumsum(0)
    x, w, g = _rand(10, 8, seed=30).to(dtype), _rand(4, 8, 16, seed=31).to(dtype), _rand(10, 16, seed=32).to(dtype)

    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_linear(xa, wa, offs, backend)
    y.backward(g)

    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    starts = [0] + offs.tolist()[:-1]
    ref = torch.cat([xb[s:e] @ wb[i] for i, (s, e) in enumerate(zip(starts, offs.tolist()))])
    ref.backward(g)
    tol = 1e-13 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(wa.grad, wb.grad, rtol=tol, atol=tol)
    assert torch.equal(wa.grad[1], torch.zeros_like(wa.grad[1]))  # the empty group's weights get zero


def test_grouped_linear_deferred_equals_full_bitwise() -> None:
    backend = CPUBackend()
    offs = torch.tensor([4, 4, 9])
    x, w, g = _rand(9, 6, seed=40), _rand(3, 6, 5, seed=41), _rand(9, 5, seed=42)
    full_x, full_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    grouped_linear(full_x, full_w, offs, backend).backward(g)
    dx, dw = x.clone().requires_grad_(), w.clone().requires_grad_()
    queue = WeightGradQueue()
    with deferring(queue):
        grouped_linear(dx, dw, offs, backend).backward(g)
    assert dw.grad is None
    queue.run()
    assert torch.equal(dx.grad, full_x.grad) and torch.equal(dw.grad, full_w.grad)


def test_tiled_grouped_linear_uses_weight_of_group_mod_g_and_sums_tile_gradients() -> None:
    # Expert parallelism: groups are (source rank, expert) pairs, group i using expert i % G.
    backend = CPUBackend()
    counts = [2, 3, 0, 4, 1, 2]  # 3 tiles (sources) x 2 experts
    offs = torch.tensor(counts).cumsum(0)
    x, w, g = _rand(12, 4, seed=50), _rand(2, 4, 3, seed=51), _rand(12, 3, seed=52)
    wa, xa = w.clone().requires_grad_(), x.clone().requires_grad_()
    y = grouped_linear(xa, wa, offs, backend, tiles=[5, 4, 3])  # rows per tile
    queue = WeightGradQueue()
    with deferring(queue):
        y.backward(g)
    queue.run()
    wb, xb = w.clone().requires_grad_(), x.clone().requires_grad_()
    bounds = [0] + offs.tolist()
    ref = torch.cat([xb[bounds[i] : bounds[i + 1]] @ wb[i % 2] for i in range(6)])
    ref.backward(g)
    # each group is its own product: its rows come out as they do alone (float64 sums over k in
    # order, which a BLAS matmul's fused multiply-adds need not: equal to it within rounding)
    alone = torch.cat([backend.grouped_mm(x[bounds[i] : bounds[i + 1]], w[i % 2 : i % 2 + 1], torch.tensor([counts[i]])) for i in range(6)])
    assert torch.equal(y, alone)
    torch.testing.assert_close(y, ref, rtol=1e-14, atol=0)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-14, atol=0)
    torch.testing.assert_close(wa.grad, wb.grad, rtol=1e-14, atol=0)


@pytest.mark.parametrize("defer", [False, True])
def test_each_tiles_weight_gradient_reaches_a_wider_accumulator_on_its_own(defer: bool) -> None:
    """bfloat16 weights accumulating in float32 (a main_grad, as the gradient buckets give them):
    every tile's bfloat16 weight gradient is added to it apart, as one process adds each source's
    micro-batch; a sum of the tiles rounded to bfloat16 first would differ."""
    from portapipe.scheduling.wgrad import accumulate_grad

    backend = CPUBackend()
    counts = [5, 7, 6, 3, 4, 8]  # 3 tiles (sources) x 2 experts
    offs = torch.tensor(counts).cumsum(0)
    x, w, g = (_rand(33, 16, seed=80).bfloat16(), _rand(2, 16, 8, seed=81).bfloat16(), _rand(33, 8, seed=82).bfloat16())
    wa = w.clone().requires_grad_()
    wa.main_grad = torch.zeros(2, 16, 8)  # float32
    def into_main(p: torch.Tensor) -> None:  # what the buckets' hook does with autograd's accumulation
        if p.grad is not None:
            accumulate_grad(p, p.grad)
            p.grad = None

    wa.register_post_accumulate_grad_hook(into_main)
    y = grouped_linear(x, wa, offs, backend, tiles=[12, 9, 12])
    queue = WeightGradQueue()
    with deferring(queue if defer else None):
        y.backward(g)
    queue.run()
    parts = [backend.grouped_mm(x[a:b].t(), g[a:b], torch.tensor(counts[2 * t : 2 * t + 2]).cumsum(0)) for t, (a, b) in enumerate([(0, 12), (12, 21), (21, 33)])]
    want = torch.zeros(2, 16, 8)
    for part in parts:
        want += part
    assert wa.grad is None and torch.equal(wa.main_grad, want)
    assert not torch.equal(wa.main_grad, (parts[0] + parts[1] + parts[2]).float())  # the tiles summed in bfloat16 first


class _WatchedBackend(CPUBackend):
    """Records the weight operand of every grouped matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[torch.Tensor] = []

    def grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        self.weights.append(b)
        return super().grouped_mm(a, b, offs)


@pytest.mark.parametrize("counts", [[2, 3, 0, 4, 1, 2], [2, 3, 0, 0, 1, 2], [0, 0, 0, 0, 0, 0], [0, 0, 4, 1, 0, 0]])
def test_tiled_grouped_linear_never_copies_the_weights_and_equals_one_call_over_tiled_weights(counts: list[int]) -> None:
    # 3 tiles of 2 groups, empty tiles among them: the result is the one grouped matmul over the
    # weights repeated per tile, bit for bit, without ever making that repeated copy
    backend = _WatchedBackend()
    offs = torch.tensor(counts).cumsum(0)
    tiles = [counts[0] + counts[1], counts[2] + counts[3], counts[4] + counts[5]]
    n = sum(counts)
    x, w, g = _rand(n, 4, seed=60), _rand(2, 4, 3, seed=61), _rand(n, 3, seed=62)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_linear(xa, wa, offs, backend, tiles=tiles)
    y.backward(g)
    weight_operands = {t.untyped_storage().data_ptr() for t in backend.weights if t.dim() == 3}
    assert weight_operands <= {wa.untyped_storage().data_ptr()}  # the weight itself (or its transpose view)
    plain = CPUBackend()
    want = plain.grouped_mm(x, w.repeat(3, 1, 1), offs)
    assert y.shape == (n, 3) and torch.equal(y, want)
    want_dx = plain.grouped_mm(g, w.repeat(3, 1, 1).transpose(1, 2), offs)
    assert torch.equal(xa.grad, want_dx)
    want_dw = plain.grouped_mm(x.t(), g, offs).view(3, 2, 4, 3).sum(0)
    torch.testing.assert_close(wa.grad, want_dw, rtol=1e-14, atol=0)


def test_tiles_that_do_not_fit_the_offsets_are_refused() -> None:
    offs = torch.tensor([2, 5, 5, 9])
    with pytest.raises(ValueError, match="2 tiles of 2 groups holding 8 rows do not fit 4 offsets over 9 rows"):
        grouped_linear(_rand(9, 4, seed=70), _rand(2, 4, 3, seed=71), offs, CPUBackend(), tiles=[5, 3])
