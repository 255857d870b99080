"""Applying a plan: routing to replicas, migration plans, and migration on 4 gloo ranks."""

from __future__ import annotations

import zlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from portapipe.balancing.eplb import rebalance_experts
from portapipe.balancing.migration import MigrationError, migrate, migrate_parameters, plan_migration
from portapipe.balancing.placement import ExpertPlacement
from portapipe.ranks.launch import run_ranks

E, R, RANKS, D, H = 8, 12, 4, 6, 5  # experts, slots, EP ranks, model dim, hidden dim
S = R // RANKS


# ------------------------------------------------------------------------------ single process
def test_route_spreads_replicas_evenly_and_deterministically() -> None:
    # layer 0: expert 0 in slots 0, 4, 8 (three replicas); expert 1 in slots 1, 5; others once
    p2l = torch.tensor([[0, 1, 2, 3, 0, 1, 4, 5, 0, 6, 7, 2]])
    pl = ExpertPlacement(p2l, num_ranks=4)
    assert pl.logcnt[0].tolist() == [3, 2, 2, 1, 1, 1, 1, 1]
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 7], [0, 1], [-1, 0], [0, 3]])
    slots = pl.route(0, ids)
    assert torch.equal(slots, pl.route(0, ids))
    assert (p2l[0][slots[ids >= 0]] == ids[ids >= 0]).all()
    assert slots[5, 0] == -1
    zero = slots[ids == 0].tolist()
    assert sorted(zero.count(s) for s in (0, 4, 8)) == [2, 2, 3]  # 7 entries over 3 replicas
    assert zero[:3] == [0, 4, 8]  # in replica order, starting at the original
    assert pl.route(0, ids, offset=1)[ids == 0].tolist()[:3] == [4, 8, 0]
    assert pl.tokens_per_rank(slots).tolist() == [int((pl.rank_of(slots[slots >= 0]) == r).sum()) for r in range(4)]
    assert pl.tokens_per_rank(slots).sum() == 13


def test_route_follows_the_plans_replica_order() -> None:
    w = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86]])
    plan = rebalance_experts(w, 16, 4, 2, 8)
    pl = ExpertPlacement.from_plan(plan, 8)
    first = pl.route(0, torch.arange(12))
    assert first.tolist() == plan[1][0, :, 0].tolist()  # each expert's first entry -> its original


def test_migration_plan_moves_only_what_changes() -> None:
    # rank r holds slots 3r..3r+2; expert 0..3 have two replicas in the old placement
    old = ExpertPlacement(torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]), 4)
    new = ExpertPlacement(torch.tensor([[0, 1, 7, 2, 4, 5, 6, 3, 0, 0, 1, 3]]), 4)
    plan = plan_migration(old, new)
    assert plan.source[0] == [("keep", 0), ("keep", 1), ("recv", 0)]  # 7 comes from rank 2
    assert plan.source[1] == [("recv", 0), ("keep", 1), ("keep", 2)]  # 2 from rank 0 (rank 3 has it too)
    assert plan.source[2] == [("keep", 0), ("recv", 0), ("keep", 2)]  # 3 from rank 1
    assert plan.source[3] == [("recv", 0), ("copy", 0), ("keep", 2)]  # 0 from rank 0; 1 was local
    assert plan.sends == {(2, 0): [1], (0, 1): [2], (1, 2): [0], (0, 3): [0]}
    assert plan.rows_moved == 4 and plan.rows_kept == 7 and plan.rows_copied == 1
    same = plan_migration(old, old)
    assert same.rows_moved == 0 and same.rows_kept == 12


def test_an_expert_needed_twice_on_a_rank_crosses_once() -> None:
    old = ExpertPlacement(torch.tensor([[0, 1, 2, 3, 0, 1]]), 2)
    new = ExpertPlacement(torch.tensor([[3, 3, 2, 0, 1, 2]]), 2)
    plan = plan_migration(old, new)
    assert plan.source[0] == [("recv", 0), ("recv", 0), ("keep", 2)]
    assert plan.source[1] == [("copy", 1), ("copy", 2), ("recv", 0)]
    assert plan.sends == {(1, 0): [0], (0, 1): [2]} and plan.rows_moved == 2


def test_bad_placements_are_named() -> None:
    with pytest.raises(ValueError, match="10 slots over 4 ranks"):
        ExpertPlacement(torch.arange(10).unsqueeze(0), 4)
    with pytest.raises(ValueError, match="expert 2 of layer 0 has none"):
        ExpertPlacement(torch.tensor([[0, 1, 3, 3]]), 2, num_experts=4)
    with pytest.raises(ValueError, match="placements differ"):
        plan_migration(ExpertPlacement.identity(1, 4, 2), ExpertPlacement.identity(1, 4, 2, 8))


# ------------------------------------------------------------------------------ 4 gloo ranks
def expert_weights(e: int) -> dict[str, torch.Tensor]:
    """Logical expert e's original tensors (weights and Adam moments), reproducible anywhere."""
    g = torch.Generator().manual_seed(1000 + e)
    w1, w2 = torch.randn(D, H, generator=g, dtype=torch.float64), torch.randn(H, D, generator=g, dtype=torch.float64)
    return {"w1": w1, "w2": w2, "w1.exp_avg": w1 * 0.1, "w1.exp_avg_sq": w1 * w1, "w2.exp_avg": -w2, "w2.exp_avg_sq": w2.abs()}


def local_tensors(pl: ExpertPlacement, rank: int, layer: int) -> dict[str, torch.Tensor]:
    per_expert = [expert_weights(e) for e in pl.experts_on(rank, layer).tolist()]
    return {k: torch.stack([x[k] for x in per_expert]) for k in per_expert[0]}


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().numpy().tobytes())


def slot_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {k: [crc(row) for row in v] for k, v in tensors.items()}


def ep_forward(backend: Any, pl: ExpertPlacement, layer: int, rank: int, x: torch.Tensor, ids: torch.Tensor,
               gates: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """A routed expert layer: dispatch by all-to-all to the placement's slots, compute, combine."""
    slots = pl.route(layer, ids, offset=rank).reshape(-1)
    token = torch.arange(x.shape[0]).repeat_interleave(ids.shape[1])
    order = pl.rank_of(slots).sort(stable=True).indices
    send = pl.tokens_per_rank(slots)
    recv = torch.empty_like(send)
    backend.all_to_all_single(recv, send)
    sc, rc = send.tolist(), recv.tolist()
    rx = x.new_empty(sum(rc), x.shape[1])
    backend.all_to_all_single(rx, x[token[order]], rc, sc)
    rslot = torch.empty(sum(rc), dtype=torch.int64)
    backend.all_to_all_single(rslot, pl.local_index(slots[order]), rc, sc)
    y = torch.zeros_like(rx)
    for j in range(pl.slots_per_rank):
        m = rslot == j
        y[m] = torch.relu(rx[m] @ w1[j]) @ w2[j]
    back = torch.empty(len(order), x.shape[1], dtype=x.dtype)
    backend.all_to_all_single(back, y, sc, rc)
    contrib = torch.empty_like(back)
    contrib[order] = back
    return torch.zeros_like(x).index_add_(0, token, contrib * gates.reshape(-1, 1))


def model_dispatch_forward(backend: Any, pl: ExpertPlacement, layer: int, rank: int, x: torch.Tensor, ids: torch.Tensor,
                           gates: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The same layer through the MoE model's dispatch planner, fed physical slots instead of experts."""
    from portapipe.models.expert_parallel import ExpertParallel, plan_dispatch
    from portapipe.scheduling.exchange import exchange

    ep = ExpertParallel(backend, size=pl.num_ranks, rank=rank)
    plan = plan_dispatch(ep, pl.route(layer, ids, offset=rank), pl.num_slots)
    token = torch.arange(ids.numel()) // ids.shape[1]
    recv = exchange(ep, x[token[plan.order]], plan.recv_splits, plan.send_splits).wait()
    y = torch.empty_like(recv)
    ends = plan.offs.tolist()
    for group, (start, end) in enumerate(zip([0] + ends[:-1], ends)):  # (source rank, local slot) groups
        j = group % pl.slots_per_rank
        y[start:end] = torch.relu(recv[start:end] @ w1[j]) @ w2[j]
    back = exchange(ep, y, plan.send_splits, plan.recv_splits).wait()
    contrib = torch.empty_like(back)
    contrib[plan.order] = back
    return torch.zeros_like(x).index_add_(0, token, contrib * gates.reshape(-1, 1))


def reference_forward(x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            w = expert_weights(int(ids[t, k]))
            out[t] += gates[t, k] * (torch.relu(x[t] @ w["w1"]) @ w["w2"])
    return out


def placements() -> tuple[ExpertPlacement, ExpertPlacement]:
    g = torch.Generator().manual_seed(0)
    a = torch.exp(torch.randn(2, E, generator=g) * 1.5)
    b = torch.exp(torch.randn(2, E, generator=g) * 1.5)
    return (ExpertPlacement.from_plan(rebalance_experts(a, R, 4, 2, RANKS), RANKS),
            ExpertPlacement.from_plan(rebalance_experts(b, R, 4, 2, RANKS, policy="refined"), RANKS))


class Boom(RuntimeError):
    pass


def _migration_ranks(backend: Any) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    old, new = placements()
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(10, D, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(10)])
    gates = torch.rand(10, 2, generator=g, dtype=torch.float64)
    out["reference"] = reference_forward(x, ids, gates)
    for layer in (0, 1):
        before = local_tensors(old, rank, layer)
        out[f"y_before{layer}"] = ep_forward(backend, old, layer, rank, x, ids, gates, before["w1"], before["w2"])
        after = migrate(old, new, before, backend, layer=layer)
        out[f"input_intact{layer}"] = slot_checksums(before) == slot_checksums(local_tensors(old, rank, layer))
        out[f"after{layer}"] = slot_checksums(after)
        out[f"y_after{layer}"] = ep_forward(backend, new, layer, rank, x, ids, gates, after["w1"], after["w2"])
        out[f"y_model{layer}"] = model_dispatch_forward(backend, new, layer, rank, x, ids, gates, after["w1"], after["w2"])

    # a rank failing mid-migration (after the exchange, while building) or before it
    for phase, victim in (("build", 2), ("prepare", 1)):
        def fault(p: str, r: int) -> None:
            if p == phase and r == victim:
                raise Boom(f"injected at {p}")
        state = local_tensors(old, rank, 0)
        try:
            migrate(old, new, state, backend, layer=0, fault=fault)
            out[f"fail_{phase}"] = None
        except MigrationError as err:
            out[f"fail_{phase}"] = (err.failed_ranks, str(err))
        out[f"kept_{phase}"] = slot_checksums(state)

    # parameters with a gradient and Adam-layout optimizer state, migrated in place. (A stand-in
    # holder of the state: constructing torch.optim.Adam imports torch._dynamo, seconds per rank.)
    t = local_tensors(old, rank, 1)
    w1 = torch.nn.Parameter(t["w1"].clone())
    w1.grad = t["w1.exp_avg"] * (rank + 1)
    opt = SimpleNamespace(state={w1: {"step": torch.tensor(1.0), "exp_avg": t["w1.exp_avg"] + rank,
                                      "exp_avg_sq": t["w1.exp_avg_sq"] * 2}})
    snap = {"w1": w1.detach().clone(), "grad": w1.grad.clone(), "exp_avg": opt.state[w1]["exp_avg"].clone(),
            "exp_avg_sq": opt.state[w1]["exp_avg_sq"].clone()}
    # each slot's row content after the step, known to every rank: gather all ranks' rows
    gathered = {k: [torch.empty_like(v) for _ in range(RANKS)] for k, v in snap.items()}
    for k, v in snap.items():
        backend.all_gather(gathered[k], v)
    migrate_parameters(old, new, {"w1": w1}, backend, layer=1, optimizer=opt)  # type: ignore[arg-type]
    expected_src = {}  # new local slot -> an old global slot with the same expert
    for j, e in enumerate(new.experts_on(rank, 1).tolist()):
        s = int((old.phy2log[1] == e).nonzero()[0])
        expected_src[j] = (s // S, s % S)
    out["params_ok"] = all(
        torch.equal(cur[j], gathered[k][src_rank][src_j])
        for k, cur in (("w1", w1.detach()), ("grad", w1.grad), ("exp_avg", opt.state[w1]["exp_avg"]), ("exp_avg_sq", opt.state[w1]["exp_avg_sq"]))
        for j, (src_rank, src_j) in expected_src.items()
    )
    out["step_kept"] = int(opt.state[w1]["step"])
    return out


@pytest.mark.multiproc
def test_migration_on_four_ranks() -> None:
    results = run_ranks(_migration_ranks, RANKS, pg_timeout_s=30, wall_timeout_s=120)
    old, new = placements()
    assert not torch.equal(old.phy2log, new.phy2log)
    for rank, out in enumerate(results):
        for layer in (0, 1):
            # every slot holds its new logical expert's original tensors, bit for bit
            want = slot_checksums(local_tensors(new, rank, layer))
            assert out[f"after{layer}"] == want, (rank, layer)
            assert out[f"input_intact{layer}"]
            # the routed computation gives the same outputs before and after, equal to one process
            assert torch.allclose(out[f"y_before{layer}"], out["reference"], rtol=1e-12, atol=1e-12)
            assert torch.allclose(out[f"y_after{layer}"], out[f"y_before{layer}"], rtol=1e-12, atol=1e-12)
            assert torch.allclose(out[f"y_model{layer}"], out["reference"], rtol=1e-12, atol=1e-12)
        # injected failures: every rank saw it, named the failing rank, and kept its old tensors
        untouched = slot_checksums(local_tensors(old, rank, 0))
        for phase, victim in (("build", 2), ("prepare", 1)):
            failed, message = out[f"fail_{phase}"]
            assert failed == [victim] and phase in message and "old placement is kept" in message
            assert out[f"kept_{phase}"] == untouched
        assert out["params_ok"] and out["step_kept"] == 1
