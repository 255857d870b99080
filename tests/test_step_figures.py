"""A balancer's per-step figures as one fixed-shape tensor (balancing/step_figures.py): every
rank's dict comes back exactly as the object gather gives it, and so merges the same."""

from __future__ import annotations

from typing import Any

import pytest

from portapipe.balancing.runtime import Rebalance, merge_figures
from portapipe.balancing.step_figures import FigureGather, pack_figures, unpack_figures

EP = 2


def _figures(rank: int) -> dict[str, Any]:
    """Rank r's figures: pipeline rank r // 2, with a third of a token and LPLB's originals on
    the first stage, whose ranks also carry a decision and min_gain auto's price; no MoE layer
    and no switch on the last rank."""
    if rank == 3:
        return {"pp_rank": 1, "dp_rank": 0, "layers": [], "rank_loads": [], "orig_loads": [], "replica_tokens": 0.0, "switch": None,
                "event": None}
    layers = [1, 2] if rank < 2 else [3]
    loads = [[10.0 / 3 + i, 7.25 * (i + 1)] for i in range(len(layers))]
    out = {
        "pp_rank": rank // 2, "dp_rank": rank % 2, "layers": layers, "rank_loads": loads,
        "orig_loads": [[r[0] + r[1], 0.0] for r in loads] if rank < 2 else [],
        "replica_tokens": 1.0 / 3 + rank, "switch": {"gain_s": 0.1 * rank + 1e-7, "cost_s": 2.0 / 7, "refresh_s": 0.03 * rank},
        "event": None,
    }
    if rank < 2:
        out["min_gain"] = 0.0123 / 7
        out["event"] = Rebalance(12, 0.9 / 7, 0.99, rank == 0, rows_moved=5, layers=layers, policy=("incremental+refined", "lplb")[rank],
                                 slots_changed=6, rows_inter_node=2, bytes_moved=5 * 2**40 + 3, bytes_inter_node=2 * 2**40 + 1).as_dict()
    return out


@pytest.mark.parametrize("rank", range(4))
def test_a_row_unpacks_to_the_same_dict(rank: int) -> None:
    assert unpack_figures(pack_figures(_figures(rank), 3, EP), 3, EP) == _figures(rank)


def test_foreign_events_and_too_many_layers_are_refused() -> None:
    with pytest.raises(ValueError, match="a decision on layers \\[3\\] travels with the figures of layers \\[1, 2\\]"):
        pack_figures({**_figures(0), "event": {**_figures(0)["event"], "layers": [3]}}, 3, EP)
    with pytest.raises(ValueError, match="a decision by policy 'mine'"):
        pack_figures({**_figures(0), "event": {**_figures(0)["event"], "policy": "mine"}}, 3, EP)
    with pytest.raises(ValueError, match="2 MoE layers on this rank but rows were sized for 1"):
        pack_figures(_figures(0), 1, EP)


def _gather(backend: Any) -> dict[str, Any]:
    import torch.distributed as dist

    mine = _figures(dist.get_rank())
    objects: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(objects, mine)
    gather = FigureGather(backend, len(mine["layers"]), EP)
    real = dist.all_gather_object

    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the after-step's figures gathered as Python objects")

    dist.all_gather_object = refused  # a rebalance step's figures too travel as one row per rank
    try:
        tensor = gather(mine)
    finally:
        dist.all_gather_object = real
    return {"tensor": tensor, "object": objects}


def test_the_tensor_gather_gives_what_the_object_gather_gives() -> None:
    from portapipe.ranks.launch import run_ranks

    out = run_ranks(_gather, 4, wall_timeout_s=120)
    for r in out:
        assert r["tensor"] == r["object"] == [_figures(i) for i in range(4)]
    assert merge_figures(out[0]["tensor"]) == merge_figures(out[0]["object"])
