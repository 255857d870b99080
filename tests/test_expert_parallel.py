"""Expert parallelism: uneven all-to-all dispatch/combine, async handles, autograd, routing plans."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.ranks.launch import run_ranks
from portapipe.models.expert_parallel import ExpertParallel, plan_dispatch, split_weights, with_weights
from portapipe.scheduling.exchange import A2AStats, AllToAll, Pending, exchange


def test_plan_on_one_rank_groups_rows_by_expert() -> None:
    ep = ExpertParallel(CPUBackend())
    idx = torch.tensor([[2, 0], [1, 2], [0, 3]])
    plan = plan_dispatch(ep, idx, 4)
    flat = idx.reshape(-1)
    assert flat[plan.order].tolist() == [0, 0, 1, 2, 2, 3]
    assert plan.order.tolist() == [1, 4, 2, 0, 3, 5]  # stable: ties keep token order
    assert plan.send_splits == plan.recv_splits == [6]
    assert plan.offs.tolist() == [2, 3, 5, 6]
    assert plan.counts.tolist() == [2, 1, 2, 1]
    # every row is local: nothing to exchange, one group per expert
    assert torch.equal(plan.send_order, plan.order) and plan.n_remote == 0
    assert plan.remote_send_splits == plan.remote_recv_splits == [0]
    assert plan.local_offs.tolist() == [2, 3, 5, 6] and plan.remote_offs.numel() == 0
    assert torch.equal(plan.inverse_order[plan.send_order], torch.arange(6))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_experts_on_rows_split_by_source_give_every_row_bit_for_bit(dtype: torch.dtype) -> None:
    """Rank 1 of 3: its own rows through the experts apart from the received ones (while those
    travel) give the values of one grouped matmul over every (source, expert) group: each
    group's product is the same whatever groups run beside it, on the fused kernel (float32,
    bfloat16) and the loop (float64). Input gradients too; weight gradients are two sums
    added instead of three terms, equal to rounding."""
    from portapipe.config import ModelConfig
    from portapipe.models.ffn import Experts

    cfg = ModelConfig(hidden=32, moe_hidden=16, n_experts=9, n_heads=2)
    experts = Experts(cfg, 3, 3, dtype)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    counts = torch.tensor([[4, 0, 7], [5, 3, 2], [1, 6, 3]])  # [source rank, local expert]
    rows = int(counts.sum())
    x = torch.randn(rows, cfg.hidden, generator=g).to(dtype)
    w = torch.rand(rows, generator=g).to(dtype)
    backend = CPUBackend()
    start, end = int(counts[0].sum()), int(counts[:2].sum())
    grad = torch.randn(rows, cfg.hidden, generator=g).to(dtype)

    def run(parts: list[tuple[torch.Tensor, torch.Tensor, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Each (rows, offs, rows per tile) through the experts; outputs and input gradients back in arrival order."""
        experts.zero_grad()
        leaves = [x[idx].clone().requires_grad_() for idx, _, _ in parts]
        outs = [experts(leaf, w[idx], offs, backend, tiles) for leaf, (idx, offs, tiles) in zip(leaves, parts)]
        torch.autograd.backward(outs, [grad[idx] for idx, _, _ in parts])
        order = torch.cat([idx for idx, _, _ in parts])
        out, gx = torch.empty_like(x), torch.empty_like(x)
        out[order], gx[order] = torch.cat(outs).detach(), torch.cat([leaf.grad for leaf in leaves])
        return out, gx, [p.grad.clone() for p in experts.parameters()]

    per_source = counts.sum(1).tolist()
    whole = run([(torch.arange(rows), torch.cumsum(counts.reshape(-1), 0), per_source)])
    remote = torch.cat([torch.arange(start), torch.arange(end, rows)])
    split = run([(torch.arange(start, end), torch.cumsum(counts[1], 0), []),
                 (remote, torch.cumsum(counts[[0, 2]].reshape(-1), 0), [per_source[0], per_source[2]])])
    assert torch.equal(split[0], whole[0])
    assert torch.equal(split[1], whole[1])
    for a, b in zip(split[2], whole[2]):
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(a, b, rtol=4 * eps, atol=4 * eps * float(b.abs().max()))


def test_hidden_fraction_is_share_not_spent_waiting() -> None:
    s = A2AStats(total_s=2.0, wait_s=0.5)
    assert s.hidden_frac == 0.75
    assert A2AStats().hidden_frac == 0.0


def test_exchange_on_one_rank_is_a_completed_copy() -> None:
    x = torch.arange(6.0).view(3, 2)
    p = exchange(ExpertParallel(CPUBackend()), x, [3], [3])
    assert isinstance(p, Pending) and not p.in_flight
    assert torch.equal(p.wait(), x) and p.wait().data_ptr() != x.data_ptr()


def _ranks(backend: Any) -> dict[str, Any]:
    """On 2 ranks: uneven exchanges (async and autograd) and a dispatch plan agreed by both."""
    groups = backend.parallel_groups(1, 1, 2)
    r = groups.ep_rank
    ep = ExpertParallel(backend, 2, r, groups.ep_group)
    out: dict[str, Any] = {}
    # rank 0 sends 1 row to itself and 3 to rank 1; rank 1 sends 2 to rank 0 and 0 to itself.
    send = [[1, 3], [2, 0]][r]
    recv = [[1, 2], [3, 0]][r]
    x = (torch.arange(sum(send) * 2, dtype=torch.float64).view(-1, 2) + 100 * r).requires_grad_()
    pending = exchange(ep, x, recv, send)
    out["in_flight"] = pending.in_flight
    out["received"] = pending.wait().clone()
    out["stats"] = (ep.stats.count, ep.stats.total_s >= ep.stats.wait_s >= 0.0)
    y = AllToAll.apply(x, ep, recv, send)
    (y * (1 + torch.arange(y.shape[0], dtype=torch.float64)).unsqueeze(1)).sum().backward()
    out["y"] = y.detach().clone()
    out["x_grad"] = x.grad.clone()
    # routing plan: both ranks route 4 tokens x top-2 over 4 experts (2 per rank)
    idx = [torch.tensor([[0, 3], [1, 0], [3, 2], [0, 1]]), torch.tensor([[2, 3], [3, 0], [2, 3], [1, 2]])][r]
    plan = plan_dispatch(ep, idx, 4)
    out["plan"] = (plan.send_splits, plan.recv_splits, plan.offs.tolist())
    out["split"] = (
        plan.send_order.tolist(), plan.n_remote, plan.remote_send_splits, plan.remote_recv_splits,
        plan.remote_offs.tolist(), plan.local_offs.tolist(),
    )
    return out


@pytest.mark.multiproc
def test_uneven_exchanges_and_plans_on_two_ranks() -> None:
    r0, r1 = run_ranks(_ranks, 2)
    # rank 0 gets its own row 0 then rank 1's rows 0-1; rank 1 gets rank 0's rows 1-3
    assert r0["received"].tolist() == [[0.0, 1.0], [100.0, 101.0], [102.0, 103.0]]
    assert r1["received"].tolist() == [[2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    assert r0["in_flight"] and r1["in_flight"]
    assert r0["stats"] == (1, True) and r1["stats"] == (1, True)
    assert torch.equal(r0["y"], r0["received"]) and torch.equal(r1["y"], r1["received"])
    # d(sum_i (i+1) y_i)/dx: each sent row gets the weight of the slot it landed in
    assert r0["x_grad"][:, 0].tolist() == [1.0, 1.0, 2.0, 3.0]
    assert r1["x_grad"][:, 0].tolist() == [2.0, 3.0]
    # rank 0 routes experts 0,1 (rank 0): 3+2 rows, experts 2,3 (rank 1): 1+2 rows
    # rank 1 routes experts 0,1: 1+1 rows, experts 2,3: 3+3 rows
    assert r0["plan"] == ([5, 3], [5, 2], [3, 5, 6, 7])
    assert r1["plan"] == ([2, 6], [3, 6], [1, 3, 6, 9])
    # the rows routed to a rank's own experts go last and are not exchanged
    assert r0["split"] == ([5, 1, 4, 0, 3, 6, 2, 7], 3, [0, 3], [0, 2], [1, 2], [3, 5])
    assert r1["split"] == ([3, 6, 0, 4, 7, 1, 2, 5], 2, [2, 0], [3, 0], [1, 3], [3, 6])


def test_router_weights_travel_as_a_column_of_the_rows_and_come_back_exactly() -> None:
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(5, 4, generator=g, dtype=torch.float32, requires_grad=True)
    weights = torch.rand(5, generator=g, dtype=torch.float32, requires_grad=True)
    sent = with_weights(rows, weights)
    assert sent.shape == (5, 5) and torch.equal(sent[:, 4], weights.detach())
    got_rows, got_weights = split_weights(sent)
    assert got_rows.is_contiguous() and got_weights.is_contiguous()
    assert torch.equal(got_rows, rows.detach()) and torch.equal(got_weights, weights.detach())
    # the gradients come back through the one column each, unchanged
    g_rows, g_weights = torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    torch.autograd.backward([got_rows, got_weights], [g_rows, g_weights])
    assert torch.equal(rows.grad, g_rows) and torch.equal(weights.grad, g_weights)
    with pytest.raises(ValueError, match="router weights in torch.float64"):
        with_weights(rows, weights.detach().double())


@pytest.mark.parametrize("n", [0, 1, 2])
def test_split_rows_and_weights_own_their_memory_so_the_received_buffer_can_be_freed(n: int) -> None:
    # one row's slices count as contiguous: a view would die with the freed buffer
    from portapipe.tensors.storage import free_storage

    received = torch.arange(n * 5, dtype=torch.float64).view(n, 5)
    want_rows, want_weights = received[:, :4].clone(), received[:, 4].clone()
    rows, weights = split_weights(received)
    if n:  # a shared storage would be read after free (checked first, so a regression fails instead of crashing)
        mine = received.untyped_storage().data_ptr()
        assert rows.untyped_storage().data_ptr() != mine and weights.untyped_storage().data_ptr() != mine
    free_storage(received)
    assert torch.equal(rows, want_rows) and torch.equal(weights, want_weights)
    assert rows.is_contiguous() and weights.is_contiguous()


class _SlowCounts(CPUBackend):
    """Two EP ranks in one process: the counts exchange hands back this rank's own counts as the
    other rank's too, and reports when its result is waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        assert kwargs.get("async_op") is True  # the counts travel while the caller goes on
        log, half = self.log, input.numel() // 2
        log.append("issue")

        class Work:
            def wait(self) -> bool:
                log.append("wait")
                output.copy_(input.view(2, half)[0].repeat(2))  # the other rank's chunk for this one: this one's own
                return True

        return Work()


def test_the_receiving_side_of_a_plan_waits_for_the_counts_when_first_read() -> None:
    backend = _SlowCounts()
    ep = ExpertParallel(backend, size=2, rank=0)
    idx = torch.tensor([[0, 3], [1, 0], [3, 2], [0, 1]])
    plan = plan_dispatch(ep, idx, 4)
    # what this rank sends needs nothing from the other: known at once, nothing waited for
    assert backend.log == ["issue"] and plan.counts_exchange.in_flight
    assert plan.send_splits == [5, 3] and plan.remote_send_splits == [0, 3] and plan.local_offs.tolist() == [3, 5]
    assert backend.log == ["issue"]
    # what it receives waits for the counts, once
    assert plan.remote_recv_splits == [0, 5]  # the "other rank" routed as this one: 3 + 2 rows to experts 0, 1
    assert plan.recv_splits == [5, 5] and plan.offs.tolist() == [3, 5, 8, 10]
    assert plan.remote_offs.tolist() == [3, 5] and plan.remote_tile_rows == [5]
    assert backend.log == ["issue", "wait"]
    # its time is the counts' own, apart from the rows' exchanges (the executor's counts_a2a_*)
    assert ep.counts_stats.count == 1 and ep.stats.count == 0


def test_the_moe_program_yields_while_the_counts_travel_before_any_rows_do() -> None:
    from types import SimpleNamespace

    from portapipe.config import ModelConfig
    from portapipe.models.moe import build_blocks
    from portapipe.scheduling.overlap import Tape

    class Rows(_SlowCounts):
        def expert_all_to_all(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.log.append("rows")
            output.zero_()
            return SimpleNamespace(wait=lambda: True)

    backend = Rows()
    cfg = ModelConfig(
        dtype="float64", vocab_size=32, hidden=16, n_layers=1, n_dense=0, n_heads=2, moe_hidden=16, n_experts=4, top_k=2, seq_len=8,
    )
    block = build_blocks(cfg, [0], 1, ExpertParallel(backend, size=2, rank=0), seed=3)[0]
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    program = block.program(Tape(), tokens, tokens)
    first = next(program)  # an F&B pair's other program would run now
    assert backend.log == ["issue"] and first is not None and first.in_flight
    second = next(program)
    assert backend.log == ["issue", "wait", "rows"] and second.in_flight  # the dispatch, after the counts
