"""Benchmark-only routings (``bench:``): round-robin gives every expert the same rows; a loads
file makes each token's experts follow it (k = 1: frequencies within 4 sigma of the file's
shares; k > 1: distinct experts per token); the router's weights stay its own scores."""

from __future__ import annotations

import torch

from portapipe.config import BenchConfig, ModelConfig
from portapipe.models.routing import ForcedRouting, Router, force_routing


def test_round_robin_gives_every_expert_the_same_rows() -> None:
    forced = ForcedRouting(8, 2)
    idx = torch.cat([forced.choose(12, torch.device("cpu")) for _ in range(4)])  # 96 rows, offset carried over calls
    assert torch.equal(torch.bincount(idx.flatten(), minlength=8), torch.full((8,), 12))
    assert bool((idx[:, 0] != idx[:, 1]).all())


def test_drawn_experts_follow_the_loads() -> None:
    p = torch.tensor([8.0, 4.0, 2.0, 1.0, 1.0])
    p = p / p.sum()
    n = 20000
    idx = ForcedRouting(5, 1, torch.log(p), seed=3).choose(n, torch.device("cpu"))
    freq = torch.bincount(idx.flatten(), minlength=5).double() / n
    sigma = torch.sqrt(p.double() * (1 - p.double()) / n)
    assert bool(((freq - p.double()).abs() < 4 * sigma).all()), (freq, p)
    two = ForcedRouting(5, 2, torch.log(p), seed=3).choose(1000, torch.device("cpu"))
    assert bool((two[:, 0] != two[:, 1]).all())


def test_force_routing_sets_the_routers_and_keeps_their_weights(tmp_path) -> None:
    loads = tmp_path / "loads.txt"
    loads.write_text("1 1 1 1 1 1 1 9\n")
    model = ModelConfig(hidden=16, n_layers=3, n_dense=1, n_experts=8, top_k=2)
    routers = {1: Router(model, torch.float32), 2: Router(model, torch.float32)}
    for r in routers.values():
        torch.nn.init.normal_(r.gate.weight, std=0.5)
    x = torch.randn(64, 16)
    force_routing(BenchConfig(router_skew_from=str(loads)), model, routers, seed=1)
    w, idx = routers[1](x)
    scores = torch.sigmoid(x @ routers[1].gate.weight.t())
    chosen = scores.gather(1, idx)
    assert torch.allclose(w, chosen / chosen.sum(1, keepdim=True))  # normalised top-k weights of the forced choice
    assert (idx == 7).any(1).float().mean() > 0.6  # the heavy expert is in most tokens' pair
    plain = Router(model, torch.float32)
    force_routing(BenchConfig(), model, {1: plain}, seed=1)  # no bench option: the router chooses
    assert plain.forced is None and routers[2].forced is not None
