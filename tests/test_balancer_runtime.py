"""The balancer of a running model: EPLB / LPLB placement, routing, replica gradients, migration.

One launch of 4 gloo ranks (pp=2, ep=2) runs every multi-rank case, so start-up is paid once:

- EPLB with redundant slots (identity placement, experts 0..ep*r-1 replicated) and after a
  migration to a load-derived placement, on 1F1B and DualPipeV (pp=2, ep=2) and with data
  parallelism (pp=1, dp=2, ep=2) and on ep=4 (replica gradients exchanged between holders): the pipelined float64 step
  matches the single-process reference (loss bit for bit, gradients to 1e-12, biases exactly);
- LPLB on a ring: every micro-batch is routed through the planner, tokens reach the copies, the
  planned rank loads are never worse than sending every token to its original, and the step
  still matches the reference;
- migration alone changes nothing: the same weights give the same losses before and after,
  and each slot's AdamW moments follow its logical expert; a failure while migrating a later
  layer moves the earlier ones back, so every layer stays in the old placement;
- LPLB's periodic placement is adopted and migrated, and restored from a checkpoint's state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from portapipe.balancing.runtime import Rebalance, merge_figures
from portapipe.config import ConfigError, load_config


def _raw(schedule: str, balancer: dict[str, Any], ep: int = 2, pp: int = 2, dp: int = 1) -> dict[str, Any]:
    mb = 2 * pp if schedule in ("dualpipe", "dualpipev") else max(pp, 2)
    return {
        "backend": "cpu",
        "parallel": {"pp": pp, "ep": ep, "dp": dp},
        "schedule": {"name": schedule, "microbatches": mb},
        "model": {
            "vocab_size": 32, "hidden": 16, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32,
            "moe_hidden": 16, "n_experts": 4, "top_k": 2, "seq_len": 8, "n_groups": 2, "topk_groups": 1, "dtype": "float64",
        },
        "balancer": balancer,
        "train": {"micro_batch_size": 2, "seed": 5},
    }


# ------------------------------------------------------------------------------ config checks
@pytest.mark.parametrize(
    "parallel,balancer,expect",
    [
        ({"ep": 1}, {"kind": "lplb", "redundant": 1}, "parallel.ep: 1; balancer.kind lplb"),
        ({"ep": 2}, {"kind": "lplb", "topology": "cube", "redundant": 2}, "balancer.topology: cube groups 8 ranks, which does not divide parallel.ep = 2"),
        ({"ep": 2}, {"kind": "lplb", "topology": "ring"}, "balancer.redundant: 0; lplb with topology ring needs a positive multiple of 1"),
        ({"ep": 2}, {"kind": "lplb", "topology": "ring", "redundant": 3}, "balancer.redundant: 3 > model.n_experts / parallel.ep = 2"),
        ({"ep": 2}, {"kind": "eplb", "groups": 3}, "balancer.groups: 3 does not divide model.n_experts = 4"),
        # one rule whatever the node count: with 2 nodes the hierarchy would fall back to global, still refused
        ({"ep": 2}, {"kind": "eplb", "groups": 3, "nodes": 2}, "balancer.groups: 3 does not divide model.n_experts = 4"),
        ({"ep": 2}, {"kind": "eplb", "groups": 3, "policy": "global"}, "balancer.groups: 3 does not divide model.n_experts = 4"),
        ({"ep": 2}, {"kind": "eplb", "nodes": 4, "groups": 4}, "balancer.nodes: 4 does not divide parallel.ep = 2"),
        ({"ep": 2}, {"kind": "eplb", "nodes": 4, "groups": 1}, "balancer.nodes: 4 does not divide parallel.ep = 2"),
        ({"ep": 2}, {"kind": "eplb", "redundant": 3}, "balancer.redundant: 3 gives 5 slots per EP rank for 4 experts"),
        ({"ep": 2}, {"kind": "eplb", "redundant": 3, "policy": "refined"}, "balancer.redundant: 3 gives 5 slots per EP rank"),
        ({"ep": 2}, {"kind": "eplb", "max_moved": 0}, "balancer.max_moved: 0"),
    ],
)
def test_config_rejects_balancers_that_do_not_fit_the_ep_group(parallel: dict, balancer: dict, expect: str) -> None:
    raw = _raw("1f1b", balancer)
    raw["parallel"].update(parallel)
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    assert any(line.startswith(expect) for line in err.value.problems), err.value.problems


def test_config_accepts_fitting_balancers() -> None:
    load_config(_raw("1f1b", {"kind": "lplb", "topology": "ring", "redundant": 2}))
    load_config(_raw("1f1b", {"kind": "eplb", "redundant": 2, "interval": 2, "min_gain": 0.01}))
    # the published policies may put two replicas of an expert on one rank
    load_config(_raw("1f1b", {"kind": "eplb", "redundant": 3, "policy": "hierarchical"}))
    load_config(_raw("1f1b", {"kind": "eplb", "groups": 2, "nodes": 2, "max_moved": 1.0}))


def test_merge_adds_each_ep_groups_rows_and_takes_each_stages_decision_once() -> None:
    def part(pp_rank: int, loads: list[list[float]], tokens: float, event: Any = None, dp_rank: int = 0) -> dict[str, Any]:
        return {"pp_rank": pp_rank, "dp_rank": dp_rank, "layers": [1, 2], "rank_loads": loads, "orig_loads": [],
                "replica_tokens": tokens, "event": event}

    ev = Rebalance(1, 0.5, 0.9, True, rows_moved=3, layers=[1, 2], policy="incremental", slots_changed=4,
                   rows_inter_node=1, bytes_moved=300, bytes_inter_node=100).as_dict()
    # pipeline ranks 0 and 1 hold the same layers (DualPipe); each of their two EP ranks reports
    # the rows it routed itself (stage 0: [[3, 1], [2, 2]] and 4 tokens in all; stage 1: [[1, 3], [0, 4]] and 2)
    parts = [part(0, [[2, 1], [1, 1]], 1.0, ev), part(0, [[1, 0], [1, 1]], 3.0, ev),
             part(1, [[1, 2], [0, 2]], 1.5, ev), part(1, [[0, 1], [0, 2]], 0.5, ev)]
    out = merge_figures(parts)
    # each EP group waits for its own slowest rank: stage 0's layer 1 [3, 1] -> 2/3, layer 2
    # [2, 2] -> 1; stage 1's [1, 3] -> 2/3 and [0, 4] -> 1/2 (not the copies' sums [4, 4], [2, 6])
    assert out["rank_balancedness"] == pytest.approx((2 / 3 + 1 + 2 / 3 + 1 / 2) / 4, rel=1e-15)
    assert out["replica_tokens"] == 6.0
    assert out["rebalance"]["before"] == 0.5 and out["rebalance"]["after"] == 0.9 and out["rebalance"]["applied"]
    # one event per (stage, layers): the two stages' events are the same layers, taken once
    assert {k: out["rebalance"][k] for k in ("slots_changed", "rows_moved", "rows_inter_node", "bytes_moved", "bytes_inter_node")} == {
        "slots_changed": 4, "rows_moved": 3, "rows_inter_node": 1, "bytes_moved": 300, "bytes_inter_node": 100}


def test_merge_gives_the_step_rows_rank_balancedness_over_dp_replicas() -> None:
    """dp 2 x ep 2: each replica's EP group has its own balancedness (the step row's figure,
    metrics.ep_step_figures over every rank); the loads summed over the replicas would give another."""
    from types import SimpleNamespace

    from portapipe.metrics.step import ep_step_figures
    from portapipe.models.expert_clock import ExpertClock

    routed = {0: [[[3, 1]], [[2, 0]]], 1: [[[0, 2]], [[1, 1]]]}  # dp rank -> each EP rank's rows routed to EP ranks 0, 1 (one layer)
    parts = [{"pp_rank": 0, "dp_rank": d, "layers": [5], "rank_loads": rows, "orig_loads": [[6.0, 0.0]], "replica_tokens": 0.0,
              "event": None} for d, ranks in routed.items() for rows in ranks]
    out = merge_figures(parts)
    # replica 0 computed [5, 1] rows -> 3/5; replica 1 [1, 3] -> 2/3; summed over DP [6, 4] would give 5/6
    assert out["rank_balancedness"] == pytest.approx((3 / 5 + 2 / 3) / 2, rel=1e-15)
    assert out["rank_balancedness_originals"] == 0.5  # one figure per replica's layer, taken once
    summed, layers = 0.0, 0
    for d in routed:  # the step row: each rank's figure from its EP group's clocks, summed over every rank
        computed = torch.tensor(routed[d], dtype=torch.float64).sum(0)[0]  # rows each EP rank of replica d computed
        for e in range(2):
            clock = ExpertClock()
            clock.seconds, clock.rows = 1.0, int(computed[e])
            peer = torch.tensor([[1.0, float(computed[1 - e])]], dtype=torch.float64)

            class Gather:
                def all_gather(self, out: list[torch.Tensor], local: torch.Tensor, group: Any = None, e: int = e, peer: Any = peer) -> None:
                    out[e].copy_(local)
                    out[1 - e].copy_(peer)

            _, bal, n = ep_step_figures(Gather(), SimpleNamespace(ep=2, ep_group=None), [SimpleNamespace(moe=SimpleNamespace(clock=clock))])
            summed, layers = summed + bal, layers + n
    assert out["rank_balancedness"] == pytest.approx(summed / layers, rel=1e-15)


# ------------------------------------------------------------------------------ on 4 ranks
def _fresh(backend: Any, raw: dict[str, Any]) -> Any:
    from portapipe.config import config_from_dict
    from portapipe.compose import PipelineRuntime

    config = config_from_dict(raw)
    be = type(backend)(backend.options)  # its own pp x dp x ep groups
    groups = be.parallel_groups(config.parallel.pp, config.parallel.dp, config.parallel.ep)
    return config, PipelineRuntime(config, be, groups)


def _loads_placement(runtime: Any, seed: int) -> Any:
    """A placement balancing seeded skewed loads (the same on every rank)."""
    from portapipe.balancing.placement import ExpertPlacement

    bal = runtime.ep.balancer
    g = torch.Generator().manual_seed(seed)
    loads = torch.rand(len(bal.layers), bal.num_experts, generator=g) ** 4 * 100
    return ExpertPlacement.from_loads(loads, bal.ep, bal.num_slots, num_groups=2)


def _eval_losses(runtime: Any, data: list) -> list[list[float]]:
    """Per (replica, micro-batch) losses of a step, leaving weights, grads and buffers as they were."""
    saved = {b: {n: t.clone() for n, t in m.named_buffers()} for b, m in runtime.blocks.items()}
    losses = runtime.step(data).losses
    for b, m in runtime.blocks.items():
        for n, t in m.named_buffers():
            t.copy_(saved[b][n])
    for p in runtime.parameters():
        p.grad = None
    return losses


def _expert_state(runtime: Any, optimizer: Any) -> dict[tuple[int, str, str, int], torch.Tensor]:
    """(layer, param, tensor kind, logical expert) -> rows, for this rank's slots."""
    out = {}
    for layer in runtime.moe_layers():
        ex = layer.moe.experts
        for name in ("gate_up", "down"):
            p = getattr(ex, name)
            kinds = {"w": p.detach(), **{k: v for k, v in optimizer.state[p].items() if k in ("exp_avg", "exp_avg_sq")}}
            for kind, t in kinds.items():
                for j, e in enumerate(ex.logical):
                    out[(layer.index, name, kind, e)] = t[j].clone()
    return out


def _data(config: Any, rt: Any) -> list:
    from portapipe.verify.pipelined import microbatches

    return microbatches(config, rt.groups.dp_rank * rt.groups.ep + rt.groups.ep_rank)  # as portapipe verify feeds them


def _ranks(backend: Any, raws: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from portapipe.verify.pipelined import step_report

    out: dict[str, Any] = {}
    # (1) EPLB, identity placement with replicas, and after migrating to a load-derived placement
    for key in ("eplb_1f1b", "eplb_dualpipev", "eplb_dp", "eplb_ep4"):
        config, rt = _fresh(backend, raws[key])
        out[key] = step_report(rt, _data(config, rt))
        config, rt = _fresh(backend, raws[key])
        new = _loads_placement(rt, 7)
        assert not torch.equal(new.phy2log, rt.ep.balancer.placement.phy2log)
        out[key + "_moved"] = rt.ep.balancer.apply(new)
        out[key + "_migrated"] = step_report(rt, _data(config, rt))

    # (3) LPLB on a ring: every micro-batch through the planner
    config, rt = _fresh(backend, raws["lplb"])
    calls: list[Any] = []
    for planner in rt.ep.balancer.planners:
        run = planner.run

        def traced(indices: torch.Tensor, _run: Any = run, _p: Any = planner) -> torch.Tensor:
            phys = _run(indices)
            calls.append((indices.clone(), phys.clone(), _p.last_plan, _p.log2phy.clone()))
            return phys

        planner.run = traced
    report = step_report(rt, _data(config, rt))
    slot_counts = torch.stack([layer.moe.slot_counts.clone() for layer in rt.moe_layers()])
    out["lplb"] = report
    out["lplb_calls"] = calls
    out["lplb_slots"] = slot_counts
    out["lplb_layout"] = (rt.ep.balancer.slots_per_rank, rt.ep.balancer.planners[0].local_logical)
    # a periodic LPLB placement (heaviest experts replicated) survives a checkpoint round trip
    bal = rt.ep.balancer
    # expert 1 heaviest: at the start only expert 0 of rank 0 has a copy, so a re-plan gains
    skew = torch.ones(bal.num_experts, dtype=torch.float64).index_fill_(0, torch.tensor([1]), 100.0)
    for row in range(len(bal.layers)):
        bal.window.record(torch.zeros(len(bal.layers), bal.num_experts).index_fill_(0, torch.tensor([row]), 1) * skew)
    event = bal._decide(1, None)
    state = bal.state_dict()
    _, fresh = _fresh(backend, raws["lplb"])
    fresh.ep.balancer.load_state_dict(state)
    out["lplb_restore"] = {
        "applied": event.applied,
        "same_placement": torch.equal(fresh.ep.balancer.placement.phy2log, bal.placement.phy2log),
        "same_planners": all(torch.equal(a.log2phy, b.log2phy) for a, b in zip(fresh.ep.balancer.planners, bal.planners)),
        "labels": [layer.moe.experts.logical for layer in fresh.moe_layers()] == [layer.moe.experts.logical for layer in rt.moe_layers()],
    }

    # (2-bis) migration with AdamW state: the same weights give the same outputs
    config, rt = _fresh(backend, raws["eplb_1f1b"])
    data = _data(config, rt)
    opt = torch.optim.AdamW(list(rt.parameters()), lr=1e-2)
    rt.step(data)
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = _eval_losses(rt, data)
    state = _expert_state(rt, opt)
    everyone: list[Any] = [None] * torch.distributed.get_world_size(rt.groups.ep_group)
    torch.distributed.all_gather_object(everyone, state, group=rt.groups.ep_group)
    moved = rt.ep.balancer.apply(_loads_placement(rt, 11), opt)
    after = _eval_losses(rt, data)
    known = {k: v for part in everyone for k, v in part.items()}
    mismatched = [k for k, v in _expert_state(rt, opt).items() if not torch.equal(v, known[k])]
    out["migration"] = {"before": before, "after": after, "moved": moved, "mismatched": mismatched}

    # a failure while migrating the second MoE layer of a stage: the first is moved back
    from portapipe.balancing.migration import MigrationError

    bal = rt.ep.balancer
    old, weights = bal.placement, {n: p.detach().clone() for n, p in rt.named_parameters()}
    prepared: list[int] = []

    def fault(phase: str, rank: int) -> None:
        if phase == "prepare":
            prepared.append(rank)
            if len(prepared) == 2:
                raise RuntimeError("injected failure")

    try:
        bal.apply(_loads_placement(rt, 13), opt, fault=fault)
        out["failure"] = "no error"
    except MigrationError:
        out["failure"] = {
            "layers": len(bal.layers),
            "kept": bal.placement is old and all(torch.equal(p, weights[n]) for n, p in rt.named_parameters()),
            "labels": [layer.moe.experts.logical for layer in rt.moe_layers()] == [old.experts_on(bal.ep_rank, i).tolist() for i in range(len(bal.layers))],
        }
    return out


@pytest.fixture(scope="module")
def four_ranks() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from portapipe.ranks.launch import run_ranks

    raws = {
        "eplb_1f1b": _raw("1f1b", {"kind": "eplb", "redundant": 1}),
        "eplb_dualpipev": _raw("dualpipev", {"kind": "eplb", "redundant": 2}),
        "eplb_dp": _raw("1f1b", {"kind": "eplb", "redundant": 1}, pp=1, dp=2),
        # every expert on 2 of 4 ranks: the replica gradients are exchanged between holders, not all-reduced
        "eplb_ep4": _raw("1f1b", {"kind": "eplb", "redundant": 1}, ep=4, pp=1),
        "lplb": _raw("1f1b", {"kind": "lplb", "topology": "ring", "redundant": 1}),
    }
    return raws, run_ranks(_ranks, 4, raws, wall_timeout_s=300)


def _assert_exact(raw: dict[str, Any], reports: list[dict[str, Any]]) -> None:
    from portapipe.config import config_from_dict
    from portapipe.verify.compare import compare

    r = compare(config_from_dict(raw), reports)
    assert r.loss_diff == 0.0, (r.loss, r.ref_loss)
    assert r.max_rel_grad_diff <= 1e-12, (r.max_rel_grad_diff, r.worst_param)
    assert r.max_bias_diff == 0.0
    assert r.ok


@pytest.mark.multiproc
@pytest.mark.parametrize("key", ["eplb_1f1b", "eplb_dualpipev", "eplb_dp", "eplb_ep4"])
def test_eplb_replicas_match_the_single_process_reference(four_ranks: Any, key: str) -> None:
    raws, ranks = four_ranks
    reports = [r[key] for r in ranks]
    ids = [r["expert_ids"] for r in reports]
    # redundant slots really hold replicas: some expert sits in two slots of the EP group
    name = next(iter(ids[0]))
    ep = raws[key]["parallel"]["ep"]  # ranks 0 .. ep - 1 form the first EP group
    held = [e for i in range(ep) for e in ids[i][name]]
    assert len(held) == 4 + ep * raws[key]["balancer"]["redundant"] and len(set(held)) == 4
    _assert_exact(raws[key], reports)


@pytest.mark.multiproc
@pytest.mark.parametrize("key", ["eplb_1f1b", "eplb_dualpipev", "eplb_dp", "eplb_ep4"])
def test_eplb_after_migration_to_a_load_placement_still_matches(four_ranks: Any, key: str) -> None:
    raws, ranks = four_ranks
    if key == "eplb_1f1b":  # 3 slots per rank for 4 experts: some expert must cross ranks
        assert all(r[key + "_moved"] > 0 for r in ranks)
    before = [r[key]["expert_ids"] for r in ranks]
    after = [r[key + "_migrated"]["expert_ids"] for r in ranks]
    assert before != after
    _assert_exact(raws[key], [r[key + "_migrated"] for r in ranks])


@pytest.mark.multiproc
def test_migration_keeps_outputs_and_moves_adam_state_with_each_expert(four_ranks: Any) -> None:
    _, ranks = four_ranks
    for r in ranks:
        m = r["migration"]
        assert m["moved"] > 0
        assert m["after"] == m["before"]  # same weights, same routing per token: the same losses bit for bit
        assert m["mismatched"] == []


@pytest.mark.multiproc
def test_a_failed_migration_leaves_every_layer_in_the_old_placement(four_ranks: Any) -> None:
    _, ranks = four_ranks
    for i, r in enumerate(ranks):
        if i < 2:  # stage 0 has one MoE layer: no second layer to fail on
            assert r["failure"] == "no error"
        else:
            assert r["failure"] == {"layers": 2, "kept": True, "labels": True}


@pytest.mark.multiproc
def test_lplb_routes_every_microbatch_through_the_planner_and_matches_the_reference(four_ranks: Any) -> None:
    raws, ranks = four_ranks
    per, local = ranks[0]["lplb_layout"]
    moved_total = 0
    for i, rank in enumerate(ranks):
        calls = rank["lplb_calls"]
        # one planner run per forward of each MoE layer: stage 0 holds MoE layer 1, stage 1 layers 2 and 3
        assert len(calls) == (1 if i < 2 else 2) * 2
        for logical, phys, plan, log2phy in calls:
            orig, copy = log2phy[logical, 0], log2phy[logical, 1]
            # each entry goes to its expert's original or its copy, nothing else
            assert bool(((phys == orig) | ((phys == copy) & (copy >= 0))).all())
            moved_total += int((phys == copy).sum())
            # the planned rank loads never exceed sending everything to the originals
            counts = plan.counts.sum(0)
            orig_rank = torch.zeros(2, dtype=torch.int64).index_add_(0, log2phy[:, 0] // per, counts)
            assert int(plan.rank_load.max()) <= int(orig_rank.max())
            assert int(plan.rank_load.sum()) == int(counts.sum())
        # the copy slots (local index >= originals) received tokens counted by the layer
        assert rank["lplb_slots"].shape[1] == 2 * per
    assert moved_total > 0
    copies = sum(int(r["lplb_slots"].view(-1, 2, per)[:, :, local:].sum()) for r in ranks)
    assert copies == moved_total
    _assert_exact(raws["lplb"], [r["lplb"] for r in ranks])


@pytest.mark.multiproc
def test_lplb_periodic_placement_migrates_and_survives_a_checkpoint(four_ranks: Any) -> None:
    _, ranks = four_ranks
    for r in ranks:
        assert r["lplb_restore"] == {"applied": True, "same_placement": True, "same_planners": True, "labels": True}
